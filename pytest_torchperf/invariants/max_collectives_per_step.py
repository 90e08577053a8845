"""Invariant ``max_collectives_per_step``: the collectives a training step calls, per rank, counted exactly.

In multi-process training a collective the step did not need costs a network
round trip on every step and every rank: a metric logged with
``self.log(..., sync_dist=True)`` on every step, DDP re-broadcasting buffers
that never change, an all-reduce per micro-batch. The counts are exact (the
same code makes the same calls), so they make a verdict CI noise cannot flip.

Counted in each rank (the launching run's checks run in every rank,
:mod:`pytest_torchperf.ranks`), over the same steps as ``max_ops_per_step``
(a Lightning train batch, a ``with run.step():`` block; the first
``count_warmup_steps`` not counted): ``all_reduce``, ``broadcast``,
``all_gather`` and ``reduce_scatter`` calls with their bytes (an object
collective's: what its own collectives sent), each at its site, the line of
your code that made it or the framework's (a call made by Lightning for your
``self.log`` line is at your line; one it makes on its own while your
``trainer.fit`` runs, a ``ModelCheckpoint`` broadcast, is at its callback's
line, a note not counted against the budget). DDP's gradient
all-reduce is one call per backward (its reducer's round, however many
buckets), its buffer broadcast one call per forward. A site that calls on a
period (every 10th step or rarer), once per epoch or only outside steps is a
note, as for host syncs.

The value is a budget (calls per step and rank, the heaviest counted step) or
``"baseline"``: each site's calls per step is a baseline entry, so a new site
or more calls per step fail.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import frameworks
from ..core import Check
from ..frames import StackCache, kind_of, locate, owner_label
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import FRAMEWORK, USER, Stack, site_of, until_user_frame
from ..text import plural
from ._counts import BASELINE, CountOrBaseline, StepWindows, counted_entry, per_step
from ._steps import DEFAULT_RATE, PerStep, cadence, cadence_text, frequency

if TYPE_CHECKING:
    from ..core import Run

NAME = "max_collectives_per_step"
#: The label of DDP's own collectives (their site is the forward that armed them).
DDP_GRADIENTS = "DDP gradient all-reduce"
DDP_BUFFERS = "DDP buffer broadcast before the forward"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


class _Site:
    def __init__(self, kind: str, label: str, stack: Stack) -> None:
        self.kind = kind
        self.label = label
        self.stack = stack
        self.calls = PerStep()
        self.bytes = 0


class CollectivesCheck(StepWindows, Check):
    """Per-run state and verdict of ``max_collectives_per_step``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        Check.__init__(self, run)
        StepWindows.__init__(self, run, run.options.count_warmup_steps)
        self.budget = run.options.max_collectives_per_step
        self.sites: dict[Any, _Site] = {}
        self._stacks = StackCache()
        #: id(reducer) -> gradient bytes per round (no reference to the DDP module: ranks must free it).
        self._grad_bytes: dict[int, int] = {}
        self._collectives = run.probe("collectives")

    def window_opened(self, counted: bool) -> None:
        pass

    def window_closed(self, counted: bool) -> None:
        pass

    def _record(self, kind: str, label: str, nbytes: int, key: Any, stack_of: Any) -> None:
        if self.open and not self.in_counted:
            return  # a warm-up step
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = _Site(kind, label, stack_of())
        site.calls.add(self.step)
        site.bytes += nbytes

    def _site_key(self, what: str, frame: Any) -> tuple[Any, Any]:
        """``(key, stack factory)`` of the event whose innermost frame is ``frame``: cheap (a few ``f_back``
        hops); the stack is captured the first time a site is seen. A framework line acting for a line of
        yours (Lightning's ``_sync_ddp`` for your ``self.log(..., sync_dist=True)``) is one site per line of
        yours, cut there; the framework's own collective (a callback's broadcast while your ``trainer.fit``
        runs) is its own line's, past the framework's plumbing (its strategy's ``broadcast``)."""
        located = locate(frame)
        site = located.frame
        user = None
        if located.kind != USER:
            site = _past_plumbing(site)
            user = _acting_for(site)
        where = (site.f_code, site.f_lineno) if site is not None else None
        key = (what, where, (user.f_code, user.f_lineno) if user is not None else None)

        def stack() -> Stack:
            captured = self._stacks.get(key, site)
            return until_user_frame(captured) if user is not None or located.kind == USER else captured

        return key, stack

    def on_collective(self, kind: str, nbytes: int, frame: Any) -> None:
        key, stack = self._site_key(kind, frame)
        self._record(kind, kind, nbytes, key, stack)

    def on_ddp_forward(self, module: Any) -> None:
        key = id(getattr(module, "reducer", None))
        if key not in self._grad_bytes:
            self._grad_bytes[key] = sum(
                p.numel() * p.element_size() for p in module.module.parameters() if p.requires_grad
            )

    def on_ddp_armed(self, reducer: Any) -> None:
        key, stack = self._site_key("ddp-grads", sys._getframe(1))
        self._record("all_reduce", DDP_GRADIENTS, self._grad_bytes.get(id(reducer), 0), key, stack)

    def on_ddp_buffers(self, ddp: Any) -> None:
        key, stack = self._site_key("ddp-buffers", sys._getframe(1))
        nbytes = sum(b.numel() * b.element_size() for b in getattr(ddp, "modules_buffers", ()) or ())
        self._record("broadcast", DDP_BUFFERS, nbytes, key, stack)

    def on_run_end(self) -> None:
        StepWindows.on_run_end(self)

    # -- the verdict ------------------------------------------------------------------------------
    def result(self) -> CheckResult:
        steps = self.counted
        figures: Figures = {
            "max_collectives_per_step": self.budget, "count_warmup_steps": self.warmup, "counted_steps": steps,
        }
        unavailable = self._collectives.unavailable
        if "collectives" in unavailable:
            return CheckResult(NAME, NOT_CHECKED, unavailable["collectives"], 0, [], figures)
        if not steps:
            why = (
                f"no training step counted: {plural(self.windows, 'step')} seen, the first {self.warmup} are "
                "warm-up (count_warmup_steps)" if self.windows else "no training step observed in this process"
            )
            return CheckResult(NAME, NOT_CHECKED, why, 0, [], figures)
        failing: list[_Site] = []
        noted: list[tuple[_Site, str]] = []
        framework: list[_Site] = []
        for site in self.sites.values():
            if _frameworks_own(site):
                framework.append(site)
                continue
            how = cadence(site.calls, steps, DEFAULT_RATE) if site.calls.per_unit else "only outside training steps"
            if how is None:
                failing.append(site)
            else:
                noted.append((site, how))
        per_step_calls: dict[int, int] = {}
        for site in failing:
            for unit, n in site.calls.per_unit.items():
                per_step_calls[unit] = per_step_calls.get(unit, 0) + n
        worst = max(per_step_calls.values(), default=0)
        calls = sum(sum(s.calls.per_unit.values()) for s in failing)
        step_bytes = sum(s.bytes for s in failing if s.calls.outside == 0)
        kinds: dict[str, float] = {}
        for site in failing:
            kinds[site.kind] = kinds.get(site.kind, 0.0) + sum(site.calls.per_unit.values())
        figures.update({
            "collectives_per_step": per_step(calls, steps),
            "worst_step_collectives": worst,
            "bytes_per_step": per_step(step_bytes, steps),
            "per_kind": {k: per_step(int(v), steps) for k, v in sorted(kinds.items())},
        })
        findings = [self._finding(s, steps, "") for s in failing]
        findings += [self._finding(s, steps, f"note: {cadence_text(how, s.calls, steps)}: ") for s, how in noted]
        findings += [self._finding(s, steps, "note: ") for s in framework]
        if self.budget == BASELINE:
            entries = []
            for site in failing:
                frame = site_of(site.stack)
                entries.append(counted_entry(
                    NAME, file=frame.location().rsplit(":", 1)[0] if frame else "", line=frame.lineno if frame else 0,
                    function=frame.function if frame else site.kind, source=frame.source if frame else "",
                    label=site.label, count=sum(site.calls.per_unit.values()),
                    per_step=per_step(sum(site.calls.per_unit.values()), steps),
                ))
            figures["baseline_counts"] = entries  # BASELINE_FIGURE: what a baseline compares
            if not entries:
                summary = f"no collective in every step over {plural(steps, 'counted step')}"
                return CheckResult(NAME, PASSED, summary, 0, findings, figures)
            summary = (
                f"{figures['collectives_per_step']:g} collectives per step at {plural(len(entries), 'site')}: compared "
                "with the baseline file (--torchperf-baseline)"
            )
            return CheckResult(NAME, FAILED, summary, calls, findings, figures)
        over = f"over {plural(steps, 'counted step')}"
        if worst <= self.budget:
            summary = f"at most {worst} collectives per step {over} (max_collectives_per_step={self.budget})"
            kept = findings if worst else [f for f in findings if f.title.startswith("note: ")]
            return CheckResult(NAME, PASSED, summary, 0, kept, figures)
        summary = (
            f"{worst} collectives in one step, max_collectives_per_step={self.budget} ({plural(len(failing), 'site')}; "
            f"{_bytes(int(figures['bytes_per_step']))} per step)"
        )
        return CheckResult(NAME, FAILED, summary, worst - self.budget, findings, figures)

    def _finding(self, site: _Site, steps: int, prefix: str) -> Finding:
        frame = site_of(site.stack)
        whose = "your code" if frame is not None and frame.is_user else "the framework"
        facts = [f"{_bytes(site.bytes)} in all ({site.kind})"]
        hint = _hint(site, frame)
        if site.label in (DDP_GRADIENTS, DDP_BUFFERS):
            whose = "DDP"
        elif _frameworks_own(site):
            owner = owner_label(frame) if frame is not None else "torch"
            whose = f"{owner}, not your code"
            facts.append(f"made by {owner} on its own, not by your code: a note, not counted in {NAME}")
            hint = frameworks.hint(frame, "collective") or (
                f"a collective {owner} makes on its own (not one your code asked for): its own settings decide "
                "how often"
            )
        title = f"{prefix}{site.label}: {frequency(site.calls.per_unit, site.calls.outside, steps)}, by {whose}"
        finding = Finding(title, facts, [Site(site.label, site.stack, site.calls.count)], hint)
        if _frameworks_own(site) and frame is not None:  # beside a failure of yours: one line (-v shows it)
            short = f"{frame.filename.replace(chr(92), '/').rsplit('/', 1)[-1]}:{frame.lineno}"
            finding.framework_note = (owner_label(frame), short, site.calls.count)
        return finding


def _frameworks_own(site: _Site) -> bool:
    """The site is a framework's own collective (a Lightning callback's broadcast), not one of yours or DDP's."""
    if site.label in (DDP_GRADIENTS, DDP_BUFFERS):
        return False
    frame = site_of(site.stack)
    return frame is None or not frame.is_user


def _past_plumbing(frame: Any) -> Any:
    """``frame``, or its first caller outside a framework's plumbing (its strategy's ``broadcast``)."""
    f = frame
    while f is not None and kind_of(f.f_code) == FRAMEWORK and frameworks.plumbing(str(f.f_globals.get("__name__"))):
        f = f.f_back
    return f if f is not None else frame


def _acting_for(frame: Any) -> Any:
    """The line of your code a framework's collective at ``frame`` was made for, or None: the framework's own.

    That is the innermost frame of your code outwards from ``frame`` when the framework called it back (a
    ``training_step`` or a callback of yours, calling ``self.log``), or when no framework's training call is in
    flight (your loop calling a framework's helper). The line that called the framework's training call
    (``trainer.fit(...)``) asked for none of the collectives the framework makes on its own.
    """
    f = frame
    while f is not None and kind_of(f.f_code) != USER:
        f = f.f_back
    if f is None or frameworks.current_call() is None:
        return f
    outer = f.f_back
    while outer is not None:
        if kind_of(outer.f_code) == FRAMEWORK:
            return f
        outer = outer.f_back
    return None


def _hint(site: _Site, frame: Optional[Any]) -> str:
    if site.label == DDP_BUFFERS:
        return (
            "DDP broadcasts every buffer from rank 0 before each forward: if no buffer changes during training, "
            "build DDP with broadcast_buffers=False (forward_sync_buffers=False where torch deprecates it; Lightning: "
            "strategy=DDPStrategy(...)); see no_constant_buffer_broadcast"
        )
    if site.label == DDP_GRADIENTS:
        return "one gradient all-reduce per backward is DDP's job; more per optimizer step: see no_sync_accumulation"
    source = frame.source if frame is not None else ""
    if "sync_dist" in source:
        return (
            "self.log(..., sync_dist=True) all-reduces on every step it logs: log with on_step=False, on_epoch=True "
            "(one reduction per epoch), or log the local value every step and sync only on the epoch"
        )
    return "a collective on every step: reduce once per epoch or every N steps, or let the framework do it"


class Figures(TypedDict, total=False):
    """The figures of a max_collectives_per_step verdict (see :mod:`pytest_torchperf.figures`)."""

    max_collectives_per_step: Optional[int]
    count_warmup_steps: int
    counted_steps: int
    collectives_per_step: float
    worst_step_collectives: int
    bytes_per_step: float
    per_kind: dict[str, float]
    baseline_counts: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc=(
        "collectives (all_reduce, broadcast, all_gather, reduce_scatter) a training step calls per rank: at most "
        "this many, or 'baseline' (per site, no more than the baseline file has); periodic ones are notes"
    ),
    check=CollectivesCheck,
    figures=Figures,
    kind=CountOrBaseline(),
    default=None,
    probes=("collectives", "ddp"),
    meaning="collective calls a training step may make per rank",
)
