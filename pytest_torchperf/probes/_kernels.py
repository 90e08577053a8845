"""Kernel launches of one CUDA training step, from ``torch.profiler`` (``max_ops_per_step`` on a GPU).

An ATen op may launch no kernel (a view), one, or several (a fused optimizer
launches few for all parameters, a per-parameter loop one per tensor), and the
ops of a compiled graph are not ATen calls at all, while their kernels are.
So on a CUDA run one counted step (the one after the sample step) runs under
``torch.profiler.profile(activities=[CUDA])`` and its device kernels are
counted (memory copies and sets left out). Not when another profiler is
running (``--torchperf-trace``, the user's own): then the figure is missing
and the report says why.
"""

from __future__ import annotations

from typing import Any, Optional

from .. import core

__all__ = ["KernelStep"]


class KernelStep:
    """``start()`` at the step's start, ``stop()`` at its end; then ``launches`` (or ``why_not``)."""

    def __init__(self) -> None:
        self.launches: Optional[int] = None
        self.why_not = ""
        self._prof: Any = None

    def start(self) -> None:
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if torch.autograd.profiler._is_profiler_enabled:
                self.why_not = "another profiler was running in that step"
                return
            with core.suspended():
                self._prof = profile(activities=[ProfilerActivity.CUDA])
                self._prof.__enter__()
        except Exception as exc:  # noqa: BLE001 - a missing count, never the user's error
            self._prof = None
            self.why_not = f"the profiler could not start: {type(exc).__name__}: {exc}"

    def stop(self) -> None:
        prof, self._prof = self._prof, None
        if prof is None:
            return
        try:
            import torch

            with core.suspended():
                torch.cuda.synchronize()  # the step's kernels, all of them (after its last op)
                prof.__exit__(None, None, None)
                self.launches = count_kernels(prof.events())
        except Exception as exc:  # noqa: BLE001
            self.why_not = f"the profiler failed: {type(exc).__name__}: {exc}"


def count_kernels(events: Any) -> int:
    """Device kernels among the profiler's events (memcpy / memset are transfers, not launches)."""
    from torch.autograd import DeviceType

    count = 0
    for event in events:
        if getattr(event, "device_type", None) != DeviceType.CUDA:
            continue
        name = str(getattr(event, "name", "") or getattr(event, "key", ""))
        if name.startswith(("Memcpy", "Memset", "cudaMemcpy", "cudaMemset")):
            continue
        count += 1
    return count
