"""Invariant ``no_empty_cache``: your code does not call ``torch.cuda.empty_cache()`` during the run.

``empty_cache()`` hands PyTorch's cached, unused GPU blocks back to the
driver. It frees nothing your tensors hold; the next allocations go through
``cudaMalloc`` again (slow, and it synchronises), so calling it in a training
loop makes every step pay for memory it already had. It is only worth it to
leave memory to *another* process.

The probe :mod:`pytest_torchperf.probes.cuda_cache` wraps ``torch.cuda.empty_cache``
(and ``torch.cuda.memory.empty_cache``, where it lives), so calls are counted
on a CPU-only machine too, where the real function does nothing. Each call is attributed to
the innermost frame outside torch. Calls made by Lightning itself (once per
Trainer call, when it restores a checkpoint state or tears down a CUDA
accelerator) are listed in the figures, not blamed: they are not per step and
not yours to remove.

Blind spot: a function imported by name before the run (``from torch.cuda
import empty_cache``) is not seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..arguments import Flag
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import FRAMEWORK, Stack, site_of
from ..text import plural, times

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_empty_cache"


class EmptyCacheCheck(Check):
    """Per-run state and verdict of ``no_empty_cache``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        super().__init__(run)
        self.calls: list[tuple[Stack, bool]] = []  # (stack, inside a step)

    def on_empty_cache(self, stack: Stack) -> None:
        self.calls.append((stack, self.run.in_scope))

    def result(self) -> CheckResult:
        mine = [(s, step) for s, step in self.calls if _whose(s) != FRAMEWORK]
        framework = [s for s, _ in self.calls if _whose(s) == FRAMEWORK]
        in_steps = sum(1 for _, step in mine if step)
        framework_sites = merge_sites([Site("framework call", s) for s in framework])
        figures: dict[str, Any] = {
            "calls": len(mine),
            "calls_in_scope": in_steps,
            "steps": self.run.steps,
            "framework_calls": len(framework),
            "framework_sites": [s.to_dict()["site"] for s in framework_sites],
        }
        if not mine:
            summary = "no torch.cuda.empty_cache() call by your code"
            if framework:
                summary += f" ({times(len(framework))} by the framework, not counted)"
            return CheckResult(NAME, PASSED, summary, 0, [], figures)
        sites = merge_sites([Site("torch.cuda.empty_cache() called", s) for s, _ in mine])
        title = f"torch.cuda.empty_cache() called {times(len(mine))} by your code during the run"
        facts = []
        if self.run.steps:
            facts.append(f"{in_steps} of these calls inside a training step ({self.run.steps} steps ran)")
        if framework:
            facts.append(f"the framework made {times(len(framework))} more (not counted)")
        hint = (
            "empty_cache() frees no memory your tensors hold: it returns PyTorch's cached blocks to the "
            "driver, so the next allocations call cudaMalloc again (slow, and it synchronises). Remove it "
            "from the training code; for fragmentation, set "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True instead."
        )
        summary = f"{plural(len(mine), 'torch.cuda.empty_cache() call')} by your code"
        return CheckResult(NAME, FAILED, summary, len(mine), [Finding(title, facts, sites, hint)], figures)


def _whose(stack: Stack) -> str:
    frame = site_of(stack)
    return frame.kind if frame is not None else ""


INVARIANT = Invariant(
    name=NAME,
    doc="no torch.cuda.empty_cache() call by your code in the run",
    check=EmptyCacheCheck,
    kind=Flag(),
    default=False,
    probes=("cuda_cache",),
)
