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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .. import lightning
from ..arguments import Flag
from ..core import Check
from ..probes.iterators import DROP, POOL, SHUTDOWN
from ..registry import Invariant
from ..report import FAILED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import Stack

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_iterator_reset"

@dataclass
class _Event:
    kind: str
    stack: Stack
    segment: int
    label: str = ""
    sanity: bool = False
    how: str = ""


class _Loader:
    """What one run saw of one DataLoader."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader  # held until the verdict, so its id cannot be reused meanwhile
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.persistent = bool(getattr(loader, "persistent_workers", False))
        dataset = getattr(loader, "dataset", None)
        self.description = (
            f"{type(loader).__name__}(dataset={type(dataset).__name__}, "
            f"num_workers={self.num_workers}, persistent_workers={self.persistent})"
        )
        self.passes = 0
        self.events: list[_Event] = []

    def pools(self, segment: Optional[int] = None) -> list[_Event]:
        return [e for e in self.events if e.kind == POOL and (segment is None or e.segment == segment)]


class IteratorResetCheck(Check):
    """Per-run state and verdict of ``no_iterator_reset``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        super().__init__(run)
        self._segment = 0
        self._loaders: dict[int, _Loader] = {}

    # -- events from the probe ----------------------------------------------------
    def on_trainer_call(self, kind: str, trainer: Any, model: Any) -> None:
        self._segment += 1

    def _record(self, loader: Any) -> _Loader:
        rec = self._loaders.get(id(loader))
        if rec is None or rec.loader is not loader:
            rec = self._loaders[id(loader)] = _Loader(loader)
        return rec

    def _label(self, rec: _Loader) -> tuple[str, bool]:
        stage = lightning.stage_label()
        if stage is not None:
            return stage
        return f"pass {rec.passes}", False

    def on_dataloader_pass(self, loader: Any) -> None:
        self._record(loader).passes += 1

    def on_worker_pool(self, kind: str, loader: Any, stack: Stack, how: str = "") -> None:
        rec = self._record(loader)
        label, sanity = self._label(rec)
        rec.events.append(_Event(kind, stack, self._segment, label, sanity, how))

    # -- verdict ----------------------------------------------------------------
    def _extra_pools(self, rec: _Loader) -> list[_Event]:
        """Pools beyond the one each segment may start."""
        extra = []
        for segment in sorted({e.segment for e in rec.pools()}):
            pools = rec.pools(segment)
            if not rec.persistent:
                pools = [p for p in pools if not p.sanity]
            extra.extend(pools[1:])
        return extra

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
            title = (
                f"{rec.description} started a new worker pool in each of its "
                f"{len(epochs)} epochs{sanity}"
            )
        facts = [f"worker pools started in: {where}"]
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
            hint = (
                f"pass persistent_workers=True to this DataLoader so its {rec.num_workers} workers "
                "and their copies of the dataset survive between epochs instead of being respawned."
            )
        return Finding(title, facts, sites, hint)

    def result(self) -> CheckResult:
        with_workers = [r for r in self._loaders.values() if r.num_workers > 0]
        findings = []
        extra_total = 0
        for rec in with_workers:
            extra = self._extra_pools(rec)
            if extra:
                extra_total += len(extra)
                findings.append(self._finding(rec, extra))
        pools_total = sum(len(r.pools()) for r in with_workers)
        figures = {
            "loaders_with_workers": len(with_workers),
            "loaders_without_workers": len(self._loaders) - len(with_workers),
            "pools_started": pools_total,
            "extra_pools": extra_total,
            "loaders": [
                {
                    "loader": r.description,
                    "num_workers": r.num_workers,
                    "persistent_workers": r.persistent,
                    "passes": r.passes,
                    "pools_started": len(r.pools()),
                    "pools_started_in": [p.label for p in r.pools()],
                }
                for r in with_workers
            ],
        }
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




INVARIANT = Invariant(
    name=NAME,
    doc="each DataLoader with workers starts its worker pool at most once",
    check=IteratorResetCheck,
    kind=Flag(),
    default=True,
    probes=("iterators",),
)
