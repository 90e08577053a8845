"""Invariant ``pin_memory``: on a CUDA run, every DataLoader that feeds training pins its batches.

``pin_memory=True`` makes the host-to-device copy read page-locked memory, so
``.to(device, non_blocking=True)`` (what Lightning does) overlaps it with
compute. A CUDA run is one where an optimizer stepped parameters on a CUDA
device (:mod:`pytest_torchperf.probes.optimizers`). On a machine without CUDA,
or when nothing was trained on CUDA, the verdict is "not checked" with that
reason, never a pass; a loader whose batches already are on the device is not
blamed. Which loaders feed training comes from :mod:`pytest_torchperf.probes.loaders`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypedDict

from ..arguments import Flag
from ..core import Check
from ..probes import cuda_available
from ..probes.loaders import LoaderRecord
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..text import plural
from ._loaders import loader_site

if TYPE_CHECKING:
    from ..core import Run

NAME = "pin_memory"

#: Device types whose host-to-device copies pinned memory speeds up.
ACCELERATORS: tuple[str, ...] = ("cuda",)


class PinMemoryCheck(Check):
    """Per-run state and verdict of ``pin_memory``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.log = run.probe("loaders").log_for(run, batches=True)
        self._optimizers = run.probe("optimizers")
        #: Device type -> optimizer steps of parameters on it.
        self.steps_on: dict[str, int] = {}

    def on_optimizer_step(self, optimizer: Any) -> None:
        devices, _ = self._optimizers.placement(optimizer)
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
        return Finding(title, facts, loader_site(rec), hint)

    def result(self) -> CheckResult:
        loaders = self.log.training_loaders()
        on = sorted(d for d in self.steps_on if d in ACCELERATORS)
        available = cuda_available()
        unpinned = [r for r in loaders if not r.pin_memory and r.batch_device is None]
        figures: Figures = {
            "accelerator_available": available,
            "trained_on": sorted(self.steps_on),
            "training_loaders": len(loaders),
            "unpinned_loaders": len(unpinned),
            "loaders": [r.to_dict() for r in loaders],
        }
        if not available:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                f"not applicable: no {'/'.join(ACCELERATORS).upper()} device on this machine "
                "(pinned memory only speeds up copies to a GPU)",
                figures=figures,
            )
        if not on:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                f"not applicable: no optimizer stepped parameters on a {'/'.join(ACCELERATORS).upper()} device",
                figures=figures,
            )
        if not loaders:
            return CheckResult(
                NAME, NOT_CHECKED, "no DataLoader fed a training step in the run", figures=figures
            )
        if unpinned:
            summary = f"{plural(len(unpinned), 'training DataLoader')} without pin_memory=True on {on[0]}"
            findings = [self._finding(r, on[0]) for r in unpinned]
            return CheckResult(NAME, FAILED, summary, len(unpinned), findings, figures)
        summary = f"{plural(len(loaders), 'training DataLoader')} on {on[0]}, all pinned"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a pin_memory verdict (see :mod:`pytest_torchperf.figures`)."""

    accelerator_available: bool
    trained_on: list[str]
    training_loaders: int
    unpinned_loaders: int
    loaders: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="on a CUDA run, every training DataLoader pins its batches (not applicable on CPU)",
    check=PinMemoryCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("loaders", "optimizers"),
)
