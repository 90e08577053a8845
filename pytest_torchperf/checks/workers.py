"""Invariants ``min_workers`` and ``pin_memory``: how the training DataLoaders load and hand over batches.

``min_workers=N``: every DataLoader that feeds training has ``num_workers >= N``.
With ``num_workers=0`` each batch is read and collated in the training process,
between steps, while the accelerator waits (Lightning warns about it with a
``PossibleUserWarning``; this turns the warning into a verdict that names the
loader and the line that built it).

``pin_memory=True``: on a CUDA run, every DataLoader that feeds training pins
its batches (``pin_memory=True``), so the host-to-device copy reads
page-locked memory and ``.to(device, non_blocking=True)`` (what Lightning does)
overlaps it with compute. A CUDA run is one where an optimizer stepped
parameters on a CUDA device. On a machine without CUDA, or when nothing was
trained on CUDA, the verdict is "not checked" with that reason, never a pass;
a loader whose batches already are on the device is not blamed.

Which loaders feed training, where each was built and what it yielded comes
from the shared DataLoader probe (:mod:`._loaders`); the device a run trains on
from the optimizer step hook (:mod:`._optimizers`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from . import _optimizers
from ._loaders import LoaderRecord, log_for

if TYPE_CHECKING:
    from ..watch import Run

MIN_WORKERS = "min_workers"
PIN_MEMORY = "pin_memory"

#: Device types whose host-to-device copies pinned memory speeds up.
ACCELERATORS: tuple[str, ...] = ("cuda",)


def accelerator_available() -> bool:
    """Whether this machine has a device pinned memory is for."""
    import torch

    return bool(torch.cuda.is_available())


def _site(rec: LoaderRecord) -> list[Site]:
    if rec.created is not None:
        return [Site("created", rec.created)]
    if rec.first_iterated is not None:
        return [Site("first iterated (it was created before the run started)", rec.first_iterated)]
    return []


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


class MinWorkersCheck:
    """Per-run state and verdict of ``min_workers``."""

    name = MIN_WORKERS

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.minimum = int(run.options.min_workers or 1)
        self.log = log_for(run)

    def _finding(self, rec: LoaderRecord) -> Finding:
        title = (
            f"{rec.describe(num_workers=rec.num_workers)} feeds training with "
            f"{_plural(rec.num_workers, 'worker')}, fewer than min_workers={self.minimum}"
        )
        facts = [f"iterated in: {rec.labels_text()}"]
        if rec.num_workers == 0:
            facts.append(
                "with num_workers=0 every batch is read and collated in the training process, "
                "between steps, while the model waits"
            )
        cores = os.cpu_count() or 1
        hint = (
            f"pass num_workers={max(self.minimum, 1)} or more (Lightning suggests up to the "
            f"{cores} CPU cores of this machine; a usual start is 4 per GPU) and "
            "persistent_workers=True, so the workers start once and prepare the next batches "
            "while the step runs."
        )
        return Finding(title, facts, _site(rec), hint)

    def result(self) -> CheckResult:
        loaders = self.log.training_loaders()
        few = [r for r in loaders if r.num_workers < self.minimum]
        figures: dict[str, Any] = {
            "min_workers": self.minimum,
            "training_loaders": len(loaders),
            "loaders_below_minimum": len(few),
            "fewest_workers": min((r.num_workers for r in loaders), default=None),
            "loaders": [r.to_dict() for r in loaders],
        }
        if not loaders:
            return CheckResult(
                MIN_WORKERS,
                NOT_CHECKED,
                "no DataLoader fed a training step in the run",
                figures=figures,
            )
        if few:
            summary = (
                f"{_plural(len(few), 'training DataLoader')} below min_workers={self.minimum} "
                f"(fewest: {figures['fewest_workers']})"
            )
            return CheckResult(MIN_WORKERS, FAILED, summary, len(few), [self._finding(r) for r in few], figures)
        summary = (
            f"{_plural(len(loaders), 'training DataLoader')}, the fewest workers: {figures['fewest_workers']}"
        )
        return CheckResult(MIN_WORKERS, PASSED, summary, 0, [], figures)


class PinMemoryCheck:
    """Per-run state and verdict of ``pin_memory``."""

    name = PIN_MEMORY

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.log = log_for(run)
        #: Device type -> optimizer steps of parameters on it.
        self.steps_on: dict[str, int] = {}

    def on_optimizer_step(self, optimizer: Any) -> None:
        devices, _ = _optimizers.placement(optimizer)
        for device in devices:
            self.steps_on[device] = self.steps_on.get(device, 0) + 1

    def _finding(self, rec: LoaderRecord, device: str) -> Finding:
        title = f"{rec.describe(pin_memory=False)} feeds training on {device} without pinned memory"
        facts = [
            f"iterated in: {rec.labels_text()}",
            f"each batch is copied to {device} from pageable host memory: the copy is staged "
            "and cannot overlap with compute",
        ]
        hint = (
            "pass pin_memory=True to this DataLoader, and move batches with "
            f".to('{device}', non_blocking=True) (Lightning already does)."
        )
        return Finding(title, facts, _site(rec), hint)

    def result(self) -> CheckResult:
        loaders = self.log.training_loaders()
        on = sorted(d for d in self.steps_on if d in ACCELERATORS)
        available = accelerator_available()
        unpinned = [r for r in loaders if not r.pin_memory and r.batch_device is None]
        figures: dict[str, Any] = {
            "accelerator_available": available,
            "trained_on": sorted(self.steps_on),
            "training_loaders": len(loaders),
            "unpinned_loaders": len(unpinned),
            "loaders": [r.to_dict() for r in loaders],
        }
        if not available:
            return CheckResult(
                PIN_MEMORY,
                NOT_CHECKED,
                f"not applicable: no {'/'.join(ACCELERATORS).upper()} device on this machine "
                "(pinned memory only speeds up copies to a GPU)",
                figures=figures,
            )
        if not on:
            return CheckResult(
                PIN_MEMORY,
                NOT_CHECKED,
                f"not applicable: no optimizer stepped parameters on a {'/'.join(ACCELERATORS).upper()} device",
                figures=figures,
            )
        if not loaders:
            return CheckResult(
                PIN_MEMORY, NOT_CHECKED, "no DataLoader fed a training step in the run", figures=figures
            )
        if unpinned:
            summary = f"{_plural(len(unpinned), 'training DataLoader')} without pin_memory=True on {on[0]}"
            findings = [self._finding(r, on[0]) for r in unpinned]
            return CheckResult(PIN_MEMORY, FAILED, summary, len(unpinned), findings, figures)
        summary = f"{_plural(len(loaders), 'training DataLoader')} on {on[0]}, all pinned"
        return CheckResult(PIN_MEMORY, PASSED, summary, 0, [], figures)
