"""Invariant ``min_workers=N``: every DataLoader that feeds training has ``num_workers >= N``.

With ``num_workers=0`` each batch is read and collated in the training process,
between steps, while the accelerator waits (Lightning warns about it with a
``PossibleUserWarning``; this turns the warning into a verdict that names the
loader and the line that built it). Which loaders feed training, and where
each was built, comes from the DataLoader probe (:mod:`pytest_torchperf.probes.loaders`).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Integer
from ..core import Check
from ..probes.loaders import LoaderRecord
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..text import plural
from ._loaders import loader_site

if TYPE_CHECKING:
    from ..core import Run

NAME = "min_workers"


class MinWorkersCheck(Check):
    """Per-run state and verdict of ``min_workers``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.minimum = int(run.options.min_workers or 1)
        self.log = run.probe("loaders").log_for(run, batches=True)

    def _finding(self, rec: LoaderRecord) -> Finding:
        title = (
            f"{rec.describe(num_workers=rec.num_workers)} feeds training with "
            f"{plural(rec.num_workers, 'worker')}, fewer than min_workers={self.minimum}"
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
        return Finding(title, facts, loader_site(rec), hint)

    def result(self) -> CheckResult:
        loaders = self.log.training_loaders()
        few = [r for r in loaders if r.num_workers < self.minimum]
        figures: Figures = {
            "min_workers": self.minimum,
            "training_loaders": len(loaders),
            "loaders_below_minimum": len(few),
            "fewest_workers": min((r.num_workers for r in loaders), default=None),
            "loaders": [r.to_dict() for r in loaders],
        }
        if not loaders:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                "no DataLoader fed a training step in the run",
                figures=figures,
            )
        if few:
            summary = (
                f"{plural(len(few), 'training DataLoader')} below min_workers={self.minimum} "
                f"(fewest: {figures['fewest_workers']})"
            )
            return CheckResult(NAME, FAILED, summary, len(few), [self._finding(r) for r in few], figures)
        summary = (
            f"{plural(len(loaders), 'training DataLoader')}, the fewest workers: {figures['fewest_workers']}"
        )
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a min_workers verdict (see :mod:`pytest_torchperf.figures`)."""

    min_workers: int
    training_loaders: int
    loaders_below_minimum: int
    fewest_workers: Optional[int]
    loaders: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="every training DataLoader has at least this many worker processes (num_workers)",
    check=MinWorkersCheck,
    figures=Figures,
    kind=Integer(minimum=1),
    default=None,
    probes=("loaders",),
    meaning="the fewest DataLoader worker processes each training loader may have",
)
