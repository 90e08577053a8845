"""What runs inside a rank process: the launching process's runs started again, and their reports sent back.

A rank process learns that it is one in one of two ways:

- a launcher that runs a *function* in each process (``torch.multiprocessing``
  ``start_processes``/``spawn``: Lightning's and Fabric's ``ddp_spawn``, a plain
  ``mp.spawn``, torchrun's API with a function) is handed a :class:`RankEntry`
  in place of the function; it pickles (``spawn``, ``forkserver``) or is
  inherited (``fork``) with the launching runs' options and the directory to
  report to, and runs the function under those runs;
- a launcher that runs a *command* in each process finds the
  :data:`ENV` variable in the process's environment: Lightning's and Fabric's
  ``ddp`` re-run the launching command (under pytest, the pytest command: the
  test runs again in each rank, with its own marker or fixture watch, and those
  runs report back); torchrun's API with a script runs it through
  :mod:`pytest_torchperf.ranks.boot`, which starts the runs.

Each run writes its report to ``<directory>/d<depth>-l<local rank>.json``
(:mod:`pytest_torchperf.ranks.wire`) when it ends; ``depth`` pairs it with the
launching process's run at the same nesting depth (a marker's run is 0, a
fixture's run inside it 1). The launching process judges; a rank that re-runs
its launcher's command never fails anything itself (:func:`judged_elsewhere`).
"""

from __future__ import annotations

import json
import os
import traceback
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

from .. import core, frameworks, registry
from ..core import Run
from ..options import Options
from ..stacks import TORCHPERF, USER, classify, display_path
from ..watching import finish, start, stop
from .wire import VERSION, report_to_data, write_json

__all__ = [
    "ENV",
    "ChildRuns",
    "RankEntry",
    "RankSpec",
    "context",
    "describe_error",
    "error_of",
    "judged_elsewhere",
    "rank_of",
]

#: Set in a rank process started by a command: JSON ``{"dir": ..., "mode": "rerun" | "boot", ...}``.
ENV = "PYTEST_TORCHPERF_RANKS"

#: Invariants that only the launching process checks (``max_overhead`` replays a whole fit).
MAIN_PROCESS_ONLY = ("max_overhead",)


def context() -> Optional[dict[str, Any]]:
    """The rank context this process was started with (from :data:`ENV`), or None."""
    raw = os.environ.get(ENV)
    if not raw:
        return None
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    return data if isinstance(data, dict) and data.get("version") == VERSION else None


def judged_elsewhere() -> bool:
    """Whether this process is a rank re-running its launcher's command (Lightning's and Fabric's ``ddp``).

    Everything such a process watches, its launcher watches too (the same
    test, the same script), and judges, with this rank's report merged in. So
    here torchperf never fails a test or raises: the rank's outcomes stay what
    they would be without torchperf (Lightning kills the launching process
    when a rank exits with an error), and the JSON report is the launcher's.
    A rank started with a function, or through :mod:`~pytest_torchperf.ranks.boot`,
    reports the launching runs from its own runs; a ``watch()`` the user's code
    opens there is the user's own, judged there.
    """
    ctx = context()
    return ctx is not None and ctx.get("mode") == "rerun"

#: Run -> the global rank this process got while the run was active (``init_process_group``).
_RANKS: weakref.WeakKeyDictionary[Run, int] = weakref.WeakKeyDictionary()


def rank_seen(rank: int) -> None:
    """``torch.distributed.init_process_group`` returned in this process with ``rank``."""
    for run in core.active_runs():
        _RANKS[run] = rank


def rank_of(run: Run, default: Optional[int] = None) -> Optional[int]:
    """This process's rank for ``run``: from ``init_process_group`` during it, the process group, or ``RANK``."""
    if run in _RANKS:
        return _RANKS[run]
    import sys

    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except Exception:  # noqa: BLE001 - a broken process group is no rank
        pass
    raw = os.environ.get("RANK")
    return int(raw) if raw and raw.isdigit() else default


def describe_error(exc: BaseException) -> dict[str, Any]:
    """``{"type", "message", "where", "traceback"}``: what ended a rank, pointing at the user's line."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if classify(f.filename) != TORCHPERF]
    user = [f for f in frames if classify(f.filename) == USER]
    at = (user or frames)[-1] if (user or frames) else None
    where = f"{display_path(at.filename)}:{at.lineno} in {at.name}" if at is not None else ""
    lines = []
    for f in frames[-4:]:
        lines.append(f"{display_path(f.filename)}:{f.lineno} in {f.name}")
        if f.line:
            lines.append(f"    {f.line.strip()}")
    lines.append(f"{type(exc).__name__}: {exc}"[:400])
    return {"type": type(exc).__name__, "message": str(exc)[:400], "where": where, "traceback": lines}


def child_options(values: dict[str, Any]) -> Options:
    """The launching run's options for a run in a rank process.

    Arguments this process does not know (an invariant registered at run time
    in the launching process only) are left out: that invariant is then not
    checked in the rank. :data:`MAIN_PROCESS_ONLY` invariants are off.
    """
    known = registry.all_arguments()
    kept = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items() if k in known}
    for name in MAIN_PROCESS_ONLY:
        if name in kept:
            kept[name] = known[name][0].default
    return Options(**kept)


@dataclass
class RankSpec:
    """What a rank process needs to know: where to report, and the launching runs' options by depth."""

    directory: str
    launcher: str
    runs: list[dict[str, Any]] = field(default_factory=list)  # [{"depth": 0, "options": {...}}]
    #: ``(framework, kind, package)`` of the framework call the launch happened in, if its ranks re-run it
    #: (:func:`pytest_torchperf.frameworks.launch_spec`).
    call: Optional[tuple[str, ...]] = None

    def to_env(self, mode: str) -> str:
        return json.dumps(
            {"version": VERSION, "mode": mode, "dir": self.directory, "launcher": self.launcher, "runs": self.runs}
        )


def report_path(directory: str, depth: int, local_rank: int) -> str:
    return os.path.join(directory, f"d{depth}-l{local_rank}.json")


def write_report(
    run: Run, directory: str, depth: int, local_rank: int, launcher: str, error: Optional[dict[str, Any]]
) -> None:
    """Send ``run``'s report to the launching process (never raises)."""
    try:
        report = run.report
        data = {
            "version": VERSION,
            "depth": depth,
            "local_rank": local_rank,
            "rank": rank_of(run, default=local_rank),
            "pid": os.getpid(),
            "launcher": launcher,
            "report": report_to_data(report) if report is not None else None,
            "error": error,
        }
        os.makedirs(directory, exist_ok=True)
        write_json(report_path(directory, depth, local_rank), data)
    except Exception:  # noqa: BLE001 - the launching process will say that no report came
        pass


def error_of(exc: Optional[BaseException]) -> Optional[dict[str, Any]]:
    """What to report about the exception that ended a rank's block (None: it ended normally)."""
    if exc is None:
        return None
    if isinstance(exc, SystemExit) and exc.code in (None, 0):
        return None
    if isinstance(exc, KeyboardInterrupt):
        return {
            "type": "KeyboardInterrupt",
            "message": "interrupted (another rank failed?)",
            "where": "",
            "traceback": [],
        }
    return describe_error(exc)


class ChildRuns:
    """``with ChildRuns(spec, local_rank):`` runs the block under the launching runs' options, then reports.

    Runs the launching process had active (a ``fork`` child inherits them) are
    hidden for the block. Never raises into the block's code: a run that cannot
    start is reported as a missing report by the launching process.
    """

    def __init__(self, spec: RankSpec, local_rank: int) -> None:
        self.spec = spec
        self.local_rank = local_rank
        self.runs: list[tuple[int, Run]] = []
        self._hidden: Any = None
        self._call: Any = None

    def __enter__(self) -> ChildRuns:
        try:
            self._hidden = core.suspended()
            self._hidden.__enter__()
            for spec in sorted(self.spec.runs, key=lambda s: s["depth"]):
                run = Run(child_options(spec["options"]))
                start(run)
                self.runs.append((int(spec["depth"]), run))
        except Exception:  # noqa: BLE001 - never into the user's code
            pass
        return self

    def observe_call(self, launchers: frameworks.Launchers, args: tuple[Any, ...]) -> None:
        """Observe the framework call a launcher re-runs in this process (what it passed its function: ``args``)."""
        if self.spec.call is None or not self.runs:
            return
        framework, kind, package = self.spec.call
        try:
            observed = launchers.observe(kind, package, args, [run for _, run in self.runs])
            if observed is not None:
                observed.__enter__()
                self._call = observed
        except Exception as exc:  # noqa: BLE001
            core.probe_failed(framework, exc)

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        error = error_of(exc)
        if self._call is not None:
            self._call.__exit__(exc_type, exc, tb)
        for _depth, run in reversed(self.runs):
            try:
                stop(run)
                finish(run, exc)  # merges what ranks this rank launched itself, if any
            except Exception:  # noqa: BLE001
                pass
        for depth, run in self.runs:
            write_report(run, self.spec.directory, depth, self.local_rank, self.spec.launcher, error)
        # Hold nothing of the user's past this point: the process exits next, and what torchperf kept alive
        # (a trainer, a DDP module and its process group) would be freed during interpreter shutdown.
        self.runs.clear()
        self._call = None
        if self._hidden is not None:
            self._hidden.__exit__(None, None, None)


class RankEntry:
    """Runs in each process of a function launcher, in place of the launched function ``fn``.

    Called as ``fn`` is (``fn(index, *args)``) and returns what it returns;
    the launcher sees the same exceptions. Pickles by reference to ``fn``, so a
    ``spawn`` launch that could pickle ``fn`` can pickle this.
    """

    def __init__(self, fn: Any, spec: RankSpec) -> None:
        self.fn = fn
        self.spec = spec

    def __call__(self, index: int, *args: Any) -> Any:
        __tracebackhide__ = True
        with ChildRuns(self.spec, index) as runs:
            launchers = frameworks.launchers(self.spec.call[0]) if self.spec.call else None
            if launchers is not None and launchers.is_launch(self.fn):
                runs.observe_call(launchers, args)
            return self.fn(index, *args)

    def __repr__(self) -> str:
        return f"<torchperf rank entry for {self.fn!r}>"
