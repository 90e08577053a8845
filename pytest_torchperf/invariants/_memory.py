"""CUDA allocated memory at step boundaries: the trace ``no_graph_retention`` reports and ``max_memory_growth`` judges.

At the end of each training step, ``torch.cuda.memory_allocated()`` of the
current device (read from the allocator's statistics without flattening them
into the dict ``memory_stats`` builds). Only on a process where CUDA is
already initialised: reading never initialises it. With a ``budget`` (the
figure ``no_graph_retention`` reports), the boundaries after the first
``WARMUP_STEPS + 3`` steps are only read while reads cost less than that share
of the time between them; without one (``max_memory_growth``), every boundary
is read.

On CPU there is no such counter: torch's CPU allocator keeps no statistics,
and the process's resident memory is not one (glibc keeps freed blocks and
Python's own allocations move it by more than a leaked tensor of a few bytes
per step), so CPU runs are not measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, TypedDict

from ..clocks import perf_counter

__all__ = ["Growth", "MemoryTrace", "WARMUP_STEPS", "format_bytes"]

#: Steps whose boundaries are not judged: the first optimizer steps allocate state (Adam's moments) and gradients.
WARMUP_STEPS = 2


def format_bytes(n: float) -> str:
    """``512 B``, ``1.5 KiB``, ``3.0 MiB``."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    return f"{sign}{n:.1f} GiB"  # pragma: no cover


def _reader() -> Optional[Callable[[], int]]:
    """A function returning the allocated bytes of the current CUDA device, or None without an initialised CUDA."""
    import sys

    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        if cuda is None or not cuda.is_available() or not cuda.is_initialized():
            return None
    except Exception:  # noqa: BLE001 - a broken driver is no device
        return None
    stats = getattr(getattr(torch, "_C", None), "_cuda_memoryStats", None)
    if stats is not None:
        current_device = cuda.current_device

        def read() -> int:
            return int(stats(current_device())["allocated_bytes"]["all"]["current"])

        try:
            read()
            return read
        except Exception:  # noqa: BLE001 - another layout of the statistics: the public function
            pass
    return lambda: int(cuda.memory_allocated())


@dataclass
class Growth:
    """How allocated memory moved across the judged step boundaries."""

    #: Average bytes added per step, first judged boundary to last.
    per_step: float
    first: int
    last: int
    #: The steps at whose end memory was higher than at the previous boundary read.
    grew_in: list[int]
    #: Boundaries compared (reads after the warm-up, minus one).
    intervals: int
    #: First and last judged step.
    steps: tuple[int, int]

    @property
    def steady(self) -> bool:
        """It grew in at least half of the intervals, and in total."""
        return self.last > self.first and 2 * len(self.grew_in) >= self.intervals

    def describe(self) -> str:
        return (
            f"{format_bytes(self.per_step)} per step on average, from {format_bytes(self.first)} at the end of step "
            f"{self.steps[0]} to {format_bytes(self.last)} at the end of step {self.steps[1]}; it grew in "
            f"{len(self.grew_in)} of {self.intervals} steps"
        )


class MemoryFigures(TypedDict, total=False):
    """The allocated-memory figures of the checks that read CUDA memory every step."""

    cuda_memory_reads: int
    cuda_allocated_first: int
    cuda_allocated_last: int
    cuda_memory_growth_per_step: float
    cuda_memory_grew_in_steps: int
    cuda_memory_intervals: int


class MemoryTrace:
    """Allocated CUDA bytes at the end of each step (see the module's docstring)."""

    def __init__(self, budget: Optional[float] = None) -> None:
        #: The share of the run's time reads may take after the first boundaries (None: read every one).
        self.budget = budget
        #: ``(step, allocated bytes)`` at the end of each step read.
        self.samples: list[tuple[int, int]] = []
        self._read: Optional[Callable[[], int]] = None
        self._next_due = 0.0
        self.reads = 0
        self.skipped = 0

    def sample(self, step: int) -> None:
        """Read the allocated bytes at the end of ``step`` (when CUDA is in use and a read is due)."""
        now = perf_counter()
        if now < self._next_due and step > WARMUP_STEPS + 3:
            self.skipped += 1
            return
        read = self._read
        if read is None:
            read = self._read = _reader()
            if read is None:
                self._next_due = now + 0.05  # CUDA not initialised yet: look again a little later
                return
        value = read()
        end = perf_counter()
        self.reads += 1
        self.samples.append((step, value))
        if self.budget is not None:
            self._next_due = end + (end - now) / self.budget

    @property
    def measured(self) -> bool:
        return bool(self.samples)

    def growth(self) -> Optional[Growth]:
        """The growth over the boundaries after the warm-up, or None with fewer than three of them."""
        points = [(s, b) for s, b in self.samples if s > WARMUP_STEPS]
        if len(points) < 3:
            return None
        grew = [s2 for (_, b1), (s2, b2) in zip(points, points[1:]) if b2 > b1]
        span = points[-1][0] - points[0][0]
        per_step = (points[-1][1] - points[0][1]) / span if span else 0.0
        return Growth(per_step, points[0][1], points[-1][1], grew, len(points) - 1, (points[0][0], points[-1][0]))

    def figures(self) -> MemoryFigures:
        growth = self.growth()
        out: MemoryFigures = {"cuda_memory_reads": self.reads}
        if self.samples:
            out["cuda_allocated_first"] = self.samples[0][1]
            out["cuda_allocated_last"] = self.samples[-1][1]
        if growth is not None:
            out["cuda_memory_growth_per_step"] = round(growth.per_step, 1)
            out["cuda_memory_grew_in_steps"] = len(growth.grew_in)
            out["cuda_memory_intervals"] = growth.intervals
        return out
