"""Invariant ``max_memory_growth``: on a CUDA run, allocated GPU memory does not grow steadily from step to step.

``max_memory_growth=N`` (bytes per step) reads ``torch.cuda.memory_allocated()``
at the end of each training step (:mod:`pytest_torchperf.invariants._memory`)
and fails when, after the first two steps (which allocate gradients and
optimizer state), memory grew in at least half of the steps and by more than
``N`` bytes per step on average from the first judged boundary to the last.
A one-off allocation (a cache filled at step 5, a bigger last batch) is no
steady growth and passes; the report names the steps memory grew in.

It measures what ``no_graph_retention`` explains: any leak, not only autograd
graphs (a list of detached CUDA tensors grows too). On CPU it is "not checked":
torch's CPU allocator keeps no count of allocated bytes, and the process's
resident memory does not measure live tensors (freed blocks stay with the
allocator, Python's own objects move it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..arguments import Integer
from ..core import Check
from ..probes import cuda_available
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..text import plural
from ._memory import WARMUP_STEPS, MemoryFigures, MemoryTrace, format_bytes

if TYPE_CHECKING:
    from ..core import Run

NAME = "max_memory_growth"


class MemoryGrowthCheck(Check):
    """Per-run state and verdict of ``max_memory_growth``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self._optimizers = run.probe("optimizers")
        self.budget: int = run.options.max_memory_growth
        self.memory = MemoryTrace()
        self.cuda_steps = 0
        self.optimizer_steps = 0

    def on_step_end(self) -> None:
        self.memory.sample(self.run.steps)

    def on_optimizer_step(self, optimizer: Any) -> None:
        self.optimizer_steps += 1
        devices, _ = self._optimizers.placement(optimizer)
        if "cuda" in devices:
            self.cuda_steps += 1

    def result(self) -> CheckResult:
        figures: Figures = {"budget_bytes_per_step": self.budget, "steps": self.run.steps}
        figures.update(self.memory.figures())
        if not cuda_available():
            return CheckResult(
                NAME, NOT_CHECKED, "no CUDA device: allocated memory is only measured on CUDA", 0, [], figures
            )
        if not self.cuda_steps or not self.memory.measured:
            return CheckResult(NAME, NOT_CHECKED, "nothing was trained on CUDA in the run", 0, [], figures)
        growth = self.memory.growth()
        if growth is None:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                f"fewer than 3 step boundaries read after the {WARMUP_STEPS} warm-up steps "
                f"({plural(self.run.steps, 'step')} ran)",
                0,
                [],
                figures,
            )
        if growth.steady and growth.per_step > self.budget:
            shown = ", ".join(str(s) for s in growth.grew_in[:20]) + (" ..." if len(growth.grew_in) > 20 else "")
            facts = [
                f"allocated CUDA memory grew {growth.describe()}",
                f"steps it grew in: {shown}",
                f"budget: {format_bytes(self.budget)} per step",
            ]
            hint = (
                "something keeps tensors from every step: turn on no_graph_retention=True to find tensors that "
                "keep their autograd graph (losses or outputs kept without .detach()), else look for lists, dicts "
                "or caches that gain a CUDA tensor each step."
            )
            title = f"allocated CUDA memory grows by {format_bytes(growth.per_step)} per step"
            summary = f"+{format_bytes(growth.per_step)} per step in {len(growth.grew_in)} of {growth.intervals} steps"
            return CheckResult(NAME, FAILED, summary, len(growth.grew_in), [Finding(title, facts, [], hint)], figures)
        summary = f"{format_bytes(growth.per_step)} per step (budget {format_bytes(self.budget)})"
        if not growth.steady and growth.per_step > self.budget:
            summary += f", no steady growth (grew in {len(growth.grew_in)} of {growth.intervals} steps)"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(MemoryFigures, total=False):
    """The figures of a max_memory_growth verdict (see :mod:`pytest_torchperf.figures`)."""

    budget_bytes_per_step: float
    steps: int


INVARIANT = Invariant(
    name=NAME,
    doc=(
        "on a CUDA run, allocated GPU memory grows by at most this many bytes per training step "
        "(steady growth after the first 2 steps fails; not checked on CPU)"
    ),
    check=MemoryGrowthCheck,
    figures=Figures,
    kind=Integer(minimum=0),
    default=None,
    probes=("optimizers",),
    meaning="bytes of CUDA memory a training step may add",
)
