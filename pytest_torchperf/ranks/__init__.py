"""Multi-process runs: every rank of a watched run observed, and one report merged over them.

A test that launches training processes (Lightning ``ddp_spawn`` / ``ddp``,
Fabric with several devices, ``torch.multiprocessing.spawn``, torchrun's API)
gets its invariants checked in every training process, and one verdict per
invariant over all of them, each finding labelled with its ranks:

- :mod:`~pytest_torchperf.ranks.launches`: the launchers patched while a run
  watches, and collecting the ranks' reports when the run ends;
- :mod:`~pytest_torchperf.ranks.child`: what runs in a rank process;
- :mod:`~pytest_torchperf.ranks.boot`: the entry point of a torchrun rank;
- :mod:`~pytest_torchperf.ranks.wire` and :mod:`~pytest_torchperf.ranks.merge`:
  the report files and the merged report.

This package registers itself with :mod:`pytest_torchperf.watch` when it is
imported (the package's ``__init__`` imports it). Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Optional

from ..watch import EXTENSIONS
from ..core import Run
from . import launches
from .child import ENV, judged_elsewhere
from .merge import RankedReport

__all__ = ["ENV", "RankedReport", "judged_elsewhere"]


class _Extension:
    """The hooks :func:`pytest_torchperf.watch.start` / ``finish`` / ``watch`` call."""

    def install(self, patcher: Any) -> None:
        launches.install(patcher)

    def finished(self, run: Run, exc: Optional[BaseException]) -> None:
        try:
            launches.collect(run, exc)
            launches.report_tagged(run, exc)
        except Exception as error:  # noqa: BLE001 - never into the user's code
            if run.report is not None:
                run.report.internal_errors.setdefault("ranks", f"{type(error).__name__}: {error}")

    def judges(self, run: Run) -> bool:
        return not judged_elsewhere()


if not any(isinstance(e, _Extension) for e in EXTENSIONS):
    EXTENSIONS.append(_Extension())
