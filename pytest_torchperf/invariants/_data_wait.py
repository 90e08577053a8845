"""What ``max_data_wait`` measures of one training DataLoader, and the words its report uses.

:class:`LoaderWait` sums a loader's training passes (from the ``batches``
probe, :mod:`pytest_torchperf.probes.batches`) into the figures the verdict
judges: the share of the loop spent waiting inside ``__next__`` (each pass's
first batch apart), the wait per batch, where it went (with ``num_workers=0``:
the dataset, ``collate_fn``, the rest), and the rate the loader can deliver.
"""

from __future__ import annotations

import math
import os
import statistics
from typing import Any, Optional

from ..durations import format_seconds as fmt
from ..probes.batches import BatchesProbe, LoaderInfo, Pass
from ..stacks import USER, classify, display_path

__all__ = ["LoaderWait", "function_name", "percent"]

#: Above this share of the loop spent waiting, the loader is taken to be the bottleneck: its rate is what it delivered.
STARVED = 0.5


def percent(share: float) -> str:
    value = share * 100
    return f"{value:.0f}%" if value >= 10 or value == 0 else f"{value:.1f}%"


def function_name(fn: Any, owner: str = "") -> str:
    """``SleepyDataset.__getitem__ (test_data.py:9)``, ``torch's default_collate``."""
    code = getattr(fn, "__code__", None)
    qualname = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__
    if owner and "." in qualname:
        qualname = f"{owner}.{qualname.rsplit('.', 1)[1]}"
    if code is None:
        module = getattr(fn, "__module__", "") or ""
        return f"torch's {qualname}" if module.startswith("torch") else qualname
    kind = classify(code.co_filename)
    if kind != USER:
        package = "torch" if kind == "torch" else kind
        return f"{package}'s {qualname}" if package in ("torch",) else f"{qualname} ({kind} code)"
    return f"{qualname} ({display_path(code.co_filename)}:{code.co_firstlineno})"


class LoaderWait:
    """The training passes of one DataLoader, summed."""

    def __init__(
        self, info: LoaderInfo, passes: list[Pass], description: str, built_at: Optional[str], batches: BatchesProbe
    ) -> None:
        self.info = info
        self.passes = passes
        self.description = description
        self.built_at = built_at
        self.waits = sum(p.waits for p in passes)
        self.span = sum(p.span for p in passes)
        self.batches = sum(p.batches for p in passes)
        self.firsts = [p.first for p in passes if p.first is not None]
        self.data_s = sum(p.data_s for p in passes)
        self.collate_s = sum(p.collate_s for p in passes)
        self.fetches = sum(p.fetches for p in passes)
        self.pools = sum(1 for p in passes if p.new_pool)
        self.workers = info.num_workers
        # The workers' own time per batch, from the pools these passes ran on (forked while every batch was timed).
        seconds, count = 0.0, 0
        for pool in sorted({p.pool for p in passes if p.pool >= 0}):
            s, c = batches.worker_times(pool, self.workers)
            seconds, count = seconds + s, count + c
        self.worker_s = seconds / count if count else None
        self.worker_batches = count

    @property
    def untimed(self) -> str:
        """Why the workers' own time per batch was not measured (with workers, when it was not)."""
        method = self.info.start_method
        if method in ("spawn", "forkserver"):
            return f"workers started with {method!r} run unpatched"
        if not any(p.new_pool for p in self.passes):
            return "its worker pool was started before the run, when its workers were not timed"
        return "its workers reported no batch"

    # -- figures ----------------------------------------------------------------------
    @property
    def share(self) -> float:
        return self.waits / self.span if self.span > 0 else 0.0

    @property
    def wait(self) -> float:
        """Seconds waited per batch (each pass's first apart)."""
        return self.waits / self.batches if self.batches else 0.0

    @property
    def step(self) -> float:
        """Seconds per batch outside ``__next__``: the step and whatever else the loop does between batches."""
        return max(self.span - self.waits, 0.0) / self.batches if self.batches else 0.0

    @property
    def first_batch(self) -> Optional[float]:
        return statistics.median(self.firsts) if self.firsts else None

    def rate(self) -> tuple[Optional[float], str]:
        """``(batches per second the loader can deliver, how that was measured)``.

        ``main process``: with num_workers=0 every batch is made in the training process, so its rate is one over
        the time inside ``__next__``; ``workers``: from the workers' own time per batch, ``num_workers`` at once
        (bounded by the hand-off the training process pays per batch); ``delivered``: the loader kept the loop
        waiting most of its time, so what it delivered is what it can; ``at least``: only a lower bound (the
        workers ran unpatched, and the loader kept up).
        """
        if not self.batches:
            return None, "none"
        if self.workers == 0:
            return (1.0 / self.wait if self.wait > 0 else None), "main process"
        if self.worker_s:
            capacity = self.workers / self.worker_s
            if self.wait > 0:
                capacity = min(capacity, 1.0 / self.wait)
            return capacity, "workers"
        delivered = self.batches / self.span if self.span > 0 else None
        return delivered, ("delivered" if self.share >= STARVED else "at least")

    def predicted(self, step: float) -> Optional[float]:
        """The share of the loop that would be spent waiting with a step of ``step`` seconds."""
        rate, how = self.rate()
        if rate is None:
            return None
        if self.workers == 0:
            wait = self.wait
        elif how == "at least" and rate * step >= 1:
            wait = 0.0
        elif how == "at least":
            return None
        else:
            wait = max(1.0 / rate - step, 0.0)
        return wait / (wait + step) if wait + step > 0 else 0.0

    # -- words --------------------------------------------------------------------------
    def where_it_went(self) -> list[str]:
        """With num_workers=0: the wait per batch split between the dataset, collate_fn and the rest."""
        if self.workers or not self.fetches:
            return []
        data, collate = self.data_s / self.fetches, self.collate_s / self.fetches
        other = max(self.wait - data - collate, 0.0)
        dataset = function_name(self.info.getitem, self.info.dataset_type) if self.info.getitem else "the dataset"
        collate_name = function_name(self.info.collate) if self.info.collate is not None else "collate_fn"
        return [
            f"in the training process, per batch: {fmt(data)} in {dataset}, {fmt(collate)} in collate_fn "
            f"({collate_name}), {fmt(other)} in the rest (sampler, pin_memory, hand-off)"
        ]

    def dominant(self) -> str:
        """``dataset``, ``collate`` or ``other``: what took most of a num_workers=0 batch's time."""
        if not self.fetches:
            return "other"
        data, collate = self.data_s / self.fetches, self.collate_s / self.fetches
        other = max(self.wait - data - collate, 0.0)
        return max((data, "dataset"), (collate, "collate"), (other, "other"))[1]

    def hint(self, cuda: bool, share: float, target: Optional[float] = None) -> str:
        """The fix that fits what was measured; ``share``: the wait judged (at ``target`` when one was given)."""
        cores = os.cpu_count() or 1
        info = self.info
        dataset = function_name(info.getitem, info.dataset_type) if info.getitem else "the dataset"
        pin = (
            " and pin_memory=True (the copies to the GPU then overlap the step)" if cuda and not info.pin_memory else ""
        )
        if self.workers == 0:
            workers = max(min(cores, 4), 2)
            if self.dominant() == "collate":
                return (
                    "collate_fn takes most of each batch's time: make it cheaper (return ready tensors from the "
                    "dataset, stack or pad once per batch, not per sample), or run it in workers: "
                    f"num_workers={workers}, persistent_workers=True{pin}"
                )
            per_item = ""
            if info.batch_size and self.fetches:
                per_item = f" ({fmt(self.data_s / self.fetches / info.batch_size)} per sample)"
            text = (
                f"pass num_workers={workers} and persistent_workers=True{pin}, so workers run {dataset}{per_item} "
                "while the step runs; or move the transform it does off the hot path (do it once, in __init__ or "
                "offline, or on the whole batch on the device)"
            )
            if self.fetches and self.collate_s >= 0.25 * self.waits:
                text += (
                    f"; collate_fn takes {fmt(self.collate_s / self.fetches)} a batch too: a cheaper collate (samples "
                    "of ready tensors: a list of numbers is collated into one tensor per position)"
                )
            return text
        parts = []
        if not info.persistent and self.pools > 1:
            parts.append(
                f"pass persistent_workers=True: each pass starts a new pool of {self.workers} workers "
                f"({fmt(self.first_batch or 0.0)} to its first batch)"
            )
        step = target if target is not None else self.step
        if self.worker_s is not None and share >= 0.05 and step > 0:
            needed = math.ceil(self.worker_s / step)
            parts.append(
                f"its {self.workers} workers take {fmt(self.worker_s)} per batch each: a {fmt(step)} step needs "
                f"about {needed} such workers (this machine has {cores} cores), or a cheaper {dataset} (move its "
                "transform off the hot path, or onto the whole batch on the device)"
            )
        elif share >= 0.05:
            parts.append(
                f"add workers (this machine has {cores} cores) or raise prefetch_factor, or make {dataset} cheaper "
                "(move its transform off the hot path)"
            )
        if pin:
            parts.append("pass" + pin)
        return "; ".join(parts) or f"the loader keeps up; its batches cost {fmt(self.wait)} each to hand over"

    def to_dict(self, target: Optional[float]) -> dict[str, Any]:
        rate, how = self.rate()
        out: dict[str, Any] = {
            "loader": self.description,
            "built_at": self.built_at,
            "num_workers": self.workers,
            "persistent_workers": self.info.persistent,
            "passes": len(self.passes),
            "batches": self.batches,
            "data_wait": round(self.share, 4),
            "wait_per_batch_s": round(self.wait, 6),
            "step_s": round(self.step, 6),
            "first_batch_s": round(self.first_batch, 4) if self.first_batch is not None else None,
            "first_batch_s_each": [round(f, 4) for f in self.firsts[:16]],
            "batches_per_s": round(rate, 1) if rate is not None else None,
            "batches_per_s_from": how,
        }
        if self.workers == 0 and self.fetches:
            out["dataset_s_per_batch"] = round(self.data_s / self.fetches, 6)
            out["collate_s_per_batch"] = round(self.collate_s / self.fetches, 6)
        if self.worker_s is not None:
            out["worker_s_per_batch"] = round(self.worker_s, 6)
        if target is not None:
            predicted = self.predicted(target)
            out["needed_batches_per_s"] = round(1.0 / target, 1)
            out["predicted_data_wait"] = round(predicted, 4) if predicted is not None else None
        return out
