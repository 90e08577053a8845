"""Invariant ``no_empty_cache``: your code does not call ``torch.cuda.empty_cache()`` in the steps of the run.

``empty_cache()`` hands PyTorch's cached, unused GPU blocks back to the
driver. It frees nothing your tensors hold; the next allocations go through
``cudaMalloc`` again (slow, and it synchronises), so calling it in a training
loop makes every step pay for memory it already had. It is only worth it to
leave memory to *another* process.

The probe :mod:`pytest_torchperf.probes.cuda_cache` wraps ``torch.cuda.empty_cache``
(and ``torch.cuda.memory.empty_cache``, where it lives), so calls are counted
on a CPU-only machine too, where the real function does nothing. Each call is
attributed to the innermost frame outside torch and counted per step and per
epoch (a pass over a DataLoader). A site of your code that calls it in most
steps fails; one that calls it on a period, the way ``no_host_sync`` judges
syncs (``max_empty_cache_rate``, default 0.1: every 10th step or rarer; once
per epoch; once, like after training), is a note. Calls made by Lightning
itself (once per Trainer call, when it restores a checkpoint state or tears
down a CUDA accelerator) are listed in the figures, not blamed.

Blind spot: a function imported by name before the run (``from torch.cuda
import empty_cache``) is not seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Argument, Flag, Fraction
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import FRAMEWORK, Frame, Stack, site_of
from ..text import plural, times
from ._steps import DEFAULT_RATE, CountsEpochs, PerStep, cadence, cadence_text, cadences_text, frequency

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_empty_cache"

_HINT = (
    "empty_cache() frees no memory your tensors hold: it returns PyTorch's cached blocks to the "
    "driver, so the next allocations call cudaMalloc again (slow, and it synchronises). Remove it "
    "from the training code; for fragmentation, set "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead."
)


class _CallSite(PerStep):
    """One line of your code that calls ``empty_cache()``."""

    def __init__(self, stack: Stack, frame: Optional[Frame]) -> None:
        super().__init__()
        self.stack = stack
        self.frame = frame
        self.cadence: Optional[str] = None


class EmptyCacheCheck(CountsEpochs, Check):
    """Per-run state and verdict of ``no_empty_cache``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.limit: float = run.options.max_empty_cache_rate
        self.sites: dict[Any, _CallSite] = {}
        self.framework: list[Stack] = []
        self.in_scope = 0

    def on_empty_cache(self, stack: Stack) -> None:
        frame = site_of(stack)
        if frame is not None and frame.kind == FRAMEWORK:
            self.framework.append(stack)
            return
        key = frame.location() if frame is not None else None
        site = self.sites.get(key)
        if site is None:
            site = self.sites[key] = _CallSite(stack, frame)
        site.add(self.run.unit if self.run.in_scope else None, self.epoch)
        self.in_scope += bool(self.run.in_scope)

    def _finding(self, site: _CallSite, note: bool) -> Finding:
        total = self.run.units
        unit = self.run.unit_name
        label = "torch.cuda.empty_cache() called"
        if note:
            title = f"note: {label} by your code: {cadence_text(site.cadence or 'once', site, total, unit)}"
            facts = [
                "a call on a period (every 10th step or rarer with the default max_empty_cache_rate, once per "
                "epoch, once) costs the steps little: a note, not a failure; max_empty_cache_rate=0 fails on it"
            ]
            return Finding(title, facts, [Site(label, site.stack, site.count)], "")
        title = (f"{label} {times(site.count)} by your code during the run: "
                 f"{frequency(site.per_unit, site.outside, total, unit)}")
        facts = []
        if self.run.steps:
            facts.append(
                f"{sum(site.per_unit.values())} of these calls inside a training step ({self.run.steps} steps ran)"
            )
        if self.framework:
            facts.append(f"the framework made {times(len(self.framework))} more (not counted)")
        return Finding(title, facts, [Site(label, site.stack, site.count)], _HINT)

    def result(self) -> CheckResult:
        total = self.run.units
        sites = list(self.sites.values())
        for site in sites:
            site.cadence = cadence(site, total, self.limit)
        failing = [s for s in sites if s.cadence is None]
        noted = [s for s in sites if s.cadence is not None]
        framework_sites = merge_sites([Site("framework call", s) for s in self.framework])
        calls = sum(s.count for s in sites)
        count = sum(s.count for s in failing)
        figures: Figures = {
            "calls": calls,
            "calls_in_scope": self.in_scope,
            "periodic_calls": calls - count,
            "max_empty_cache_rate": self.limit,
            "steps": self.run.steps,
            "framework_calls": len(self.framework),
            "framework_sites": [s.to_dict()["site"] for s in framework_sites],
        }
        findings = [self._finding(s, False) for s in failing] + [self._finding(s, True) for s in noted]
        if not failing:
            summary = "no torch.cuda.empty_cache() call by your code"
            if noted:
                summary = f"no frequent torch.cuda.empty_cache() call by your code; {cadences_text(noted)} (noted)"
            if self.framework:
                summary += f" ({times(len(self.framework))} by the framework, not counted)"
            return CheckResult(NAME, PASSED, summary, 0, findings, figures)
        summary = f"{plural(count, 'torch.cuda.empty_cache() call')} by your code"
        return CheckResult(NAME, FAILED, summary, count, findings, figures)


class Figures(TypedDict, total=False):
    """The figures of a no_empty_cache verdict (see :mod:`pytest_torchperf.figures`)."""

    calls: int
    calls_in_scope: int
    periodic_calls: int
    max_empty_cache_rate: float
    steps: int
    framework_calls: int
    framework_sites: list[Any]


INVARIANT = Invariant(
    name=NAME,
    doc="no torch.cuda.empty_cache() call by your code in the steps (a call on a period is a note)",
    check=EmptyCacheCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("cuda_cache", "iterators"),
    arguments=(
        Argument(
            "max_empty_cache_rate",
            Fraction(),
            DEFAULT_RATE,
            "no_empty_cache notes, without failing, a call of your code made periodically: after its first "
            "step in each epoch, in at most this share of the steps, at most once per epoch, or once; 0 fails on every "
            "call",
            meaning="the largest share of the steps a periodic empty_cache() call may take",
        ),
    ),
)
