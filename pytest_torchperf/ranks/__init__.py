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

The engine (:mod:`pytest_torchperf.engine`) loads :data:`EXTENSION` by name
when the first run starts. Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Optional

from ..core import Run
from . import launches
from .child import ENV, judged_elsewhere
from .merge import RankedReport

__all__ = ["ENV", "EXTENSION", "RankedReport", "judged_elsewhere"]


class _Extension:
    """The hooks the engine calls (:class:`pytest_torchperf.engine.Extension`)."""

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


#: Multi-process support, as the engine's extension.
EXTENSION = _Extension()
