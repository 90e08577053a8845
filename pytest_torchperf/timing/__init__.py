"""Framework vs vanilla timing: the vanilla loop derived from a module, and sound A/B statistics.

Plain Python, no pytest. Two public entry points:

- :func:`vanilla_fit` trains a LightningModule (or any ``nn.Module`` with
  ``training_step`` and ``configure_optimizers``) with the plain PyTorch loop
  its own methods describe, and returns the seconds each epoch took;
- :func:`parity` times two callables against each other (each runs one epoch,
  or returns the epoch times it measured itself) and says whether the first is
  within ``max_overhead`` of the second.

The modules, bottom up:

- :mod:`.stats`: the paired-rounds estimate, its interval, the three verdicts and the stop rule (pure);
- :mod:`.clock`: the stopwatch and its units, the thread count to time with, the
  load meter, the timing lock, the frozen heap;
- :mod:`.vanilla`: the derived loop (:class:`VanillaLoop`, :func:`vanilla_fit`);
- :mod:`.parity`: :func:`parity` and :class:`ParityResult`, the verdict the
  ``max_overhead`` invariant reports too.

Nothing here imports torch at import time.
"""

from __future__ import annotations

from .clock import (
    CUDA_EVENT_TIME,
    LOCK_ENV,
    THREAD_TIME,
    WALL_TIME,
    LoadMeter,
    LockInfo,
    Stopwatch,
    clock_unit,
    cpu_wait,
    frozen_heap,
    synchronize,
    timing_lock,
    timing_threads,
    torch_threads,
)
from .parity import ParityResult, parity
from .stats import CONFIDENCE, MIN_ROUNDS, Estimate, Rounds, SideStats, estimate, median, quantile, t_quantile, verdict
from .vanilla import WARMUP_BATCHES, NotMirrored, VanillaLoop, vanilla_fit

__all__ = [
    "CONFIDENCE",
    "CUDA_EVENT_TIME",
    "LOCK_ENV",
    "MIN_ROUNDS",
    "THREAD_TIME",
    "WALL_TIME",
    "WARMUP_BATCHES",
    "Estimate",
    "LoadMeter",
    "LockInfo",
    "NotMirrored",
    "ParityResult",
    "Rounds",
    "SideStats",
    "Stopwatch",
    "VanillaLoop",
    "clock_unit",
    "cpu_wait",
    "estimate",
    "frozen_heap",
    "median",
    "parity",
    "quantile",
    "synchronize",
    "t_quantile",
    "timing_lock",
    "timing_threads",
    "torch_threads",
    "vanilla_fit",
    "verdict",
]
