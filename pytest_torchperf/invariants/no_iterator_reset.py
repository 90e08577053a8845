"""Invariant ``no_iterator_reset``: a DataLoader with workers starts its worker pool at most once.

Starting a pool forks (or spawns) ``num_workers`` processes and sends each a
copy of the dataset. ``persistent_workers=True`` keeps one pool for the
loader's lifetime, unless something drops ``loader._iterator`` (what
pytorch-lightning 1.5.0 did every epoch); ``persistent_workers=False`` starts a
new pool every epoch by design. What the probe :mod:`pytest_torchperf.probes.iterators`
sees: each pass over a loader, each pool started, each drop of the iterator
and each shutdown of a persistent pool, with the stacks.

A Lightning ``Trainer`` call (fit, validate, test, predict) starts a new
segment: Lightning shuts the workers down when a call ends, so the next call
starting a pool again is expected. Sanity-check passes do not count as an
epoch of a non-persistent loader (they do count as a pool start of a
persistent one, which the following epochs must reuse).

A loader *rebuilt* every epoch (a new ``DataLoader`` object from the same
line, each starting its own pool) is caught too: loaders with workers built
by the same chain of your lines (:mod:`pytest_torchperf.probes.loaders`
records where each was built) count as one, so every pool after the first
in a segment is extra. Lightning's ``reload_dataloaders_every_n_epochs`` is
named as the cause when the Trainer has it. Each loader is named with the
line that built it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import frameworks
from ..arguments import Flag
from ..core import Check
from ..probes.batches import Pass
from ..probes.iterators import DROP, POOL, SHUTDOWN
from ..registry import Invariant
from ..report import FAILED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import Frame, Stack
from ..text import times
from ._pool_cost import RunClock, first_batch_line, first_batches, pool_cost

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall
    from ..probes.loaders import LoadersProbe

NAME = "no_iterator_reset"
_ORDINALS = {1: "first", 2: "second", 3: "third"}

@dataclass
class _Event:
    kind: str
    stack: Stack
    segment: int
    label: str = ""
    sanity: bool = False
    how: str = ""
    #: For a pool: the pass it was started for, timed to its first batch (probe batches).
    timing: Optional[Pass] = None


class _Loader:
    """What one run saw of one DataLoader."""

    def __init__(self, loader: Any, loaders: LoadersProbe) -> None:
        self.loader = loader  # held until the verdict, so its id cannot be reused meanwhile
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.persistent = bool(getattr(loader, "persistent_workers", False))
        dataset = getattr(loader, "dataset", None)
        self.kind = (
            f"{type(loader).__name__}(dataset={type(dataset).__name__}, "
            f"num_workers={self.num_workers}, persistent_workers={self.persistent})"
        )
        #: Where it was built (None: built before the run), and your frames on the way there, outermost first.
        self.created: Optional[Stack] = loaders.created.get(loader)
        #: Its rank among the loaders built while the run watched (None: built before).
        self.order = next((i for i, built in enumerate(loaders.created.keys()) if built is loader), None)
        mine = [f for f in self.created or () if f.is_user]
        self.chain: tuple[Frame, ...] = tuple(mine)
        self.built_at = self.chain[-1].location() if self.chain else None
        #: The framework whose code built it from your line (the Hugging Face Trainer builds its own), or None.
        self.built_by: Optional[str] = loaders.built_by.get(loader)
        #: Set by the verdict: the name shown in reports (with the line that built it).
        self.description = self.kind
        self.passes = 0
        self.events: list[_Event] = []
        #: The check's clock at this loader's first and last pass or pool: when it was in use.
        self.first_used: Optional[int] = None
        self.last_used: Optional[int] = None
        #: Its passes timed to their first batch (probe batches), read when the run ends.
        self.timed: list[Pass] = []

    def used(self, clock: int) -> None:
        if self.first_used is None:
            self.first_used = clock
        self.last_used = clock

    @property
    def key(self) -> Optional[tuple[str, ...]]:
        """The chain of your lines that built it: loaders with the same key are the same loader rebuilt."""
        return tuple(f.location() for f in self.chain) if self.chain else None

    def pools(self, segment: Optional[int] = None) -> list[_Event]:
        return [e for e in self.events if e.kind == POOL and (segment is None or e.segment == segment)]

    def counted_pools(self, segment: int) -> list[_Event]:
        """The pools of a segment that count (a non-persistent loader's sanity-check pool does not)."""
        pools = self.pools(segment)
        return pools if self.persistent else [p for p in pools if not p.sanity]


class IteratorResetCheck(Check):
    """Per-run state and verdict of ``no_iterator_reset``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self._segment = 0
        self._clock = 0
        self._loaders: dict[int, _Loader] = {}
        #: Segment -> the Trainer's reload_dataloaders_every_n_epochs, for the segments of a Trainer call.
        self._reload: dict[int, int] = {}
        #: Where each loader was built or first iterated: the loaders probe fills it while the run has it.
        self.loaders = run.probe("loaders")
        self.log = self.loaders.log_for(run)
        #: The first batch of each pass, timed (probe batches).
        self.batches = run.probe("batches")
        #: When the run and its Trainer calls ran (what a rebuilt pool's seconds are a share of).
        self.clock = RunClock()

    # -- events from the probe ----------------------------------------------------
    def on_framework_call(self, call: FrameworkCall) -> None:
        self._segment += 1
        self.clock.call(call.kind)
        reload = getattr(call.trainer, "reload_dataloaders_every_n_epochs", 0)
        if isinstance(reload, int) and reload > 0:
            self._reload[self._segment] = reload

    def on_framework_call_end(self, call: FrameworkCall) -> None:
        self.clock.call_end()

    def on_run_end(self) -> None:
        self.clock.end()
        for rec in self._loaders.values():  # the probe forgets them when it is removed, before the verdict
            rec.timed = first_batches(self.batches, rec.loader, self.clock.started)

    def _record(self, loader: Any) -> _Loader:
        rec = self._loaders.get(id(loader))
        if rec is None or rec.loader is not loader:
            rec = self._loaders[id(loader)] = _Loader(loader, self.loaders)
        return rec

    def _label(self, rec: _Loader) -> tuple[str, bool]:
        stage = frameworks.stage()
        if stage is not None:
            return stage.label, stage.sanity
        return f"pass {rec.passes}", False

    def on_dataloader_pass(self, loader: Any) -> None:
        rec = self._record(loader)
        rec.passes += 1
        self._clock += 1
        rec.used(self._clock)

    def on_worker_pool(self, kind: str, loader: Any, stack: Stack, how: str = "") -> None:
        rec = self._record(loader)
        self._clock += 1
        rec.used(self._clock)
        label, sanity = self._label(rec)
        timing = self.batches.latest_pass(loader) if kind == POOL else None
        rec.events.append(_Event(kind, stack, self._segment, label, sanity, how, timing))

    # -- verdict ----------------------------------------------------------------
    def _extra_pools(self, rec: _Loader) -> list[_Event]:
        """Pools beyond the one each segment may start."""
        extra = []
        for segment in sorted({e.segment for e in rec.pools()}):
            extra.extend(rec.counted_pools(segment)[1:])
        return extra

    def _rebuilt(self, group: list[_Loader]) -> list[tuple[_Loader, _Event]]:
        """Pools of loaders rebuilt from the same lines beyond the first per segment (each loader's own first).

        Only a succession is a rebuild: each loader in use after the previous one's last use. Two loaders
        from one line used side by side (``fit(model, loader(True), loader(False))``) are two loaders.
        """
        used = sorted((r for r in group if r.first_used is not None), key=lambda r: r.first_used or 0)
        for before, after in zip(used, used[1:]):
            if (after.first_used or 0) <= (before.last_used or 0):
                return []
        extra = []
        for segment in sorted({e.segment for rec in group for e in rec.pools()}):
            firsts = [(rec, pools[0]) for rec in group for pools in [rec.counted_pools(segment)] if pools]
            extra.extend(firsts[1:])
        return extra

    def _rebuilt_finding(self, group: list[_Loader], extra: list[tuple[_Loader, _Event]]) -> Finding:
        first = group[0]
        pools = [(rec, p) for rec in group for p in rec.pools()]
        where = f"by {first.built_by}, called from {first.built_at}" if first.built_by else f"at {first.built_at}"
        title = (
            f"{first.kind} built {where} was built again {times(len(group) - 1)}, and each new "
            f"loader started its own worker pool: {len(pools)} pools"
        )
        facts = [f"worker pools started in: {', '.join(p.label for _, p in pools)}"]
        facts.extend(self._cost(group, [p for _, p in extra], len(pools)))
        reload = sorted({v for seg, v in self._reload.items() if any(p.segment == seg for _, p in pools)})
        sites = [Site("DataLoader built", first.created or ())]
        sites.extend(merge_sites([Site("worker pool started by a rebuilt loader", p.stack) for _, p in extra]))
        hint = (
            f"build this DataLoader once, outside the epoch loop, with persistent_workers=True: one pool of "
            f"{first.num_workers} workers (and their copies of the dataset) then serves every epoch"
        )
        own = frameworks.setting(first.built_by, NAME)
        if own:
            hint = own
        if reload:
            every = reload[0]
            period = "every epoch" if every == 1 else f"every {every} epochs"
            facts.append(f"the Trainer has reload_dataloaders_every_n_epochs={every}: Lightning calls your "
                         f"*_dataloader() hook again {period}")
            hint = (
                f"Trainer(reload_dataloaders_every_n_epochs={every}) rebuilds the loaders, and each new one starts "
                "its own worker pool: drop the option unless the data really changes between epochs, and build "
                "the loader with persistent_workers=True"
            )
        return Finding(title, facts, sites, hint)

    def _finding(self, rec: _Loader, extra: list[_Event]) -> Finding:
        pools = rec.pools()
        where = ", ".join(p.label for p in pools)
        if rec.persistent:
            title = (
                f"{rec.description} started {len(pools)} worker pools; "
                f"persistent_workers=True should keep one"
            )
        else:
            epochs = [p for p in pools if not p.sanity]
            sanity = " (and the sanity check)" if len(epochs) < len(pools) else ""
            # Lightning's stages are epochs; outside Lightning each `iter(loader)` is a pass, whatever the loop
            unit = "passes over it" if all(p.label.startswith("pass ") for p in epochs) else "epochs"
            title = (
                f"{rec.description} started a new worker pool in each of its "
                f"{len(epochs)} {unit}{sanity}"
            )
        facts = [f"worker pools started in: {where}"]
        facts.extend(self._cost([rec], extra, len(pools)))
        sites: list[Site] = []
        culprits: list[Site] = []
        for pool in extra:
            # The last drop (else shutdown) between the previous pool and this one.
            before = [e for e in rec.events if e.segment == pool.segment]
            before = before[: before.index(pool)]
            since_pool = []
            for e in reversed(before):
                if e.kind == POOL:
                    break
                since_pool.append(e)
            drops = [e for e in since_pool if e.kind == DROP] or [e for e in since_pool if e.kind == SHUTDOWN]
            if drops:
                e = drops[0]
                label = f"iterator {e.how}" if e.kind == DROP else "worker pool shut down"
                culprits.append(Site(label, e.stack))
        sites.extend(merge_sites(culprits))
        sites.extend(merge_sites([Site("worker pool rebuilt", p.stack) for p in extra]))
        if rec.persistent:
            hint = (
                "something drops DataLoader._iterator between epochs, so the "
                f"{rec.num_workers} workers and their copies of the dataset are rebuilt each time; "
                "the stack above shows who. If it is Lightning's code, upgrade "
                "(pytorch-lightning 1.5.0 did this every epoch; fixed in 1.5.1)."
            )
        else:
            hint = frameworks.setting(rec.built_by, NAME) or (
                f"pass persistent_workers=True to this DataLoader so its {rec.num_workers} workers "
                "and their copies of the dataset survive between epochs instead of being respawned."
            )
        return Finding(title, facts, sites, hint)

    def _cost(self, loaders: list[_Loader], extra: list[_Event], pools: int) -> list[str]:
        """The seconds the extra pools cost (fact lines), and their figures kept for the JSON report."""
        passes = [p for rec in loaders for p in rec.timed]
        line, figures = pool_cost(passes, [e.timing for e in extra], pools, self.clock)
        self._costs.append(figures)
        first = first_batch_line(passes)
        return [text for text in (first, line) if text]

    def _name(self, loaders: list[_Loader], rebuilt: list[list[_Loader]]) -> None:
        """Name each loader with the line that built it: the calling line too when two share a helper's line,
        and which one it is when two come from the very same lines (``fit(m, loader(True), loader(False))``).
        A loader rebuilt from the same lines takes the name of the first one built."""
        copies = {id(rec): group[0] for group in rebuilt for rec in group[1:]}
        named = [rec for rec in loaders if id(rec) not in copies]
        by_line: dict[Optional[str], int] = {}
        by_chain: dict[Optional[tuple[str, ...]], list[_Loader]] = {}
        for rec in named:
            by_line[rec.built_at] = by_line.get(rec.built_at, 0) + 1
            by_chain.setdefault(rec.key, []).append(rec)
        for rec in named:
            if rec.built_at is None:
                logged = self.log.records.get(id(rec.loader))
                stack = logged.first_iterated if logged is not None and logged.ref() is rec.loader else None
                mine = [f for f in stack or () if f.is_user]
                where = f"first iterated at {mine[-1].location()}" if mine else "built before the run"
                rec.description = f"{rec.kind} ({where})"
                continue
            where = rec.built_at
            if rec.built_by is not None:
                where = f"by {rec.built_by}, called from {where}"
            if by_line[rec.built_at] > 1 and len(rec.chain) > 1:
                where += f", called from {rec.chain[-2].location()}"
            twins = sorted(by_chain[rec.key], key=lambda r: r.order if r.order is not None else -1)
            if len(twins) > 1:
                where += f", the {_ORDINALS.get(twins.index(rec) + 1, str(twins.index(rec) + 1) + 'th')} built there"
            rec.description = f"{rec.kind} (built {'' if rec.built_by else 'at '}{where})"
        for rec in loaders:
            first = copies.get(id(rec))
            if first is not None:
                rec.description = first.description

    def result(self) -> CheckResult:
        self._costs: list[dict[str, Any]] = []
        with_workers = [r for r in self._loaders.values() if r.num_workers > 0]
        groups: dict[tuple[str, ...], list[_Loader]] = {}
        for rec in with_workers:
            if rec.key is not None:
                groups.setdefault(rec.key, []).append(rec)
        rebuilt = [(group, self._rebuilt(group)) for group in groups.values() if len(group) > 1]
        rebuilt = [(group, extra) for group, extra in rebuilt if extra]
        self._name(with_workers, [group for group, _ in rebuilt])
        findings = []
        extra_total = 0
        for rec in with_workers:
            extra = self._extra_pools(rec)
            if extra:
                extra_total += len(extra)
                findings.append(self._finding(rec, extra))
        for group, rebuilt_extra in rebuilt:
            extra_total += len(rebuilt_extra)
            findings.append(self._rebuilt_finding(group, rebuilt_extra))
        pools_total = sum(len(r.pools()) for r in with_workers)
        figures: Figures = {
            "loaders_with_workers": len(with_workers),
            "loaders_without_workers": len(self._loaders) - len(with_workers),
            "pools_started": pools_total,
            "extra_pools": extra_total,
            "loaders": [
                {
                    "loader": r.description,
                    "built_at": r.built_at,
                    "num_workers": r.num_workers,
                    "persistent_workers": r.persistent,
                    "passes": r.passes,
                    "pools_started": len(r.pools()),
                    "pools_started_in": [p.label for p in r.pools()],
                    "first_batch_s": [round(p.first or 0.0, 4) for p in r.timed][:32],
                }
                for r in with_workers
            ],
        }
        lost = [c["lost_s"] for c in self._costs if c.get("lost_s") is not None]
        shares = [c["lost_share"] for c in self._costs if c.get("lost_share") is not None]
        figures["rebuilt_pools_lost_s"] = round(sum(lost), 4) if lost else 0.0
        figures["rebuilt_pools_lost_share"] = round(sum(shares), 4) if shares else 0.0
        # The verdict is all that is kept: let go of the loaders (and their workers).
        for r in self._loaders.values():
            r.loader = None
        if findings:
            noun = "pool" if extra_total == 1 else "pools"
            loaders = "loader" if len(findings) == 1 else "loaders"
            summary = f"{extra_total} extra worker {noun} in {len(findings)} {loaders}"
            return CheckResult(NAME, FAILED, summary, extra_total, findings, figures)
        if not with_workers:
            summary = "no DataLoader with workers was iterated"
        else:
            loaders = "loader" if len(with_workers) == 1 else "loaders"
            pools = "pool" if pools_total == 1 else "pools"
            summary = f"{len(with_workers)} {loaders} with workers, {pools_total} worker {pools} started"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)




class Figures(TypedDict, total=False):
    """The figures of a no_iterator_reset verdict (see :mod:`pytest_torchperf.figures`)."""

    loaders_with_workers: int
    loaders_without_workers: int
    pools_started: int
    extra_pools: int
    loaders: list[dict[str, Any]]
    rebuilt_pools_lost_s: float
    rebuilt_pools_lost_share: float


INVARIANT = Invariant(
    name=NAME,
    doc="each DataLoader with workers starts its worker pool at most once",
    check=IteratorResetCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("iterators", "loaders", "batches"),
)
