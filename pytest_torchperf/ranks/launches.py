"""The launching side: which launches a run saw, how each reaches its ranks, and collecting their reports.

Patched while a run watches (on the base patcher, undone with it):

- ``torch.multiprocessing.start_processes`` (and the module global that
  ``torch.multiprocessing.spawn`` calls): the launched function is handed to
  each process wrapped in a :class:`~pytest_torchperf.ranks.child.RankEntry`.
  Lightning's and Fabric's ``ddp_spawn`` (``spawn``, ``fork``, ``forkserver``),
  a plain ``mp.spawn`` and torchrun's API with a function all start processes
  here. The call is made with ``join=False`` and joined exactly as
  ``start_processes`` joins, so that each process's exit code is known.
- Lightning's and Fabric's ``_SubprocessScriptLauncher`` (``strategy="ddp"``):
  it re-runs the launching command (``sys.executable -m pytest <the same
  arguments>``, or the script) once per extra local rank, with ``LOCAL_RANK``,
  ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the
  environment it copies from ``os.environ``. :data:`~pytest_torchperf.ranks.child.ENV`
  is put in ``os.environ`` for that copy only (and taken out at once), naming
  this process's report directory. The re-run test's own watch reports for
  the rank. Lightning leaves ``LOCAL_RANK`` in the launching process's
  environment, so a later ``ddp`` fit there starts no process: the same rank
  processes run the later test too, and report for it under its node id.
- torchrun's agent (``torch.distributed.run.main`` / ``elastic_launch`` in the
  test's process) with a script: each rank's command runs the script through
  ``python -m pytest_torchperf.ranks.boot``, with :data:`ENV` in that rank's
  environment only.
- ``torch.distributed.init_process_group``: which rank this process is.

When a run ends, it waits for the reports of the ranks launched while it was
active (until each arrives, its process has exited, or :data:`REPORT_TIMEOUT`
passes), merges them with its own (:mod:`pytest_torchperf.ranks.merge`) and
removes the directories. Nothing is left in ``os.environ``.
"""

from __future__ import annotations

import atexit
import inspect
import os
import re
import shutil
import signal
import sys
import tempfile
import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core, frameworks
from ..clocks import monotonic, sleep
from ..core import Run
from ..patching import wraps
from . import child
from .child import ENV, RankEntry, RankSpec, report_path
from .merge import Part, merge
from .wire import read_json, report_from_data

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["REPORT_TIMEOUT", "Launch", "collect", "install"]

#: Seconds a run waits, once it ends, for a rank's report whose process is still running.
REPORT_TIMEOUT = 60.0
#: ... and when the run's own block raised (the ranks may be stuck waiting for this process).
REPORT_TIMEOUT_AFTER_ERROR = 5.0

#: The module that re-runs a torchrun script under watch.
BOOT_MODULE = "pytest_torchperf.ranks.boot"


@dataclass
class Launch:
    """One launch of rank processes while runs were watching."""

    launcher: str
    directory: str
    #: Local rank -> the process (``mp.Process`` or ``Popen``), or None when unknown.
    expected: dict[int, Any] = field(default_factory=dict)
    #: Depth -> the launching run at that depth that still has to collect this launch.
    runs: dict[int, Run] = field(default_factory=dict)

    def spec(self) -> RankSpec:
        runs = [{"depth": depth, "options": run.options.to_dict()} for depth, run in sorted(self.runs.items())]
        call = frameworks.launch_spec()
        return RankSpec(self.directory, self.launcher, runs, tuple(call) if call else None)


#: Run -> the launches it has to collect when it ends.
_LAUNCHES: weakref.WeakKeyDictionary[Run, list[Launch]] = weakref.WeakKeyDictionary()

#: Report directories are ``torchperf-ranks-<pid of the launching process>-<random>``.
PREFIX = "torchperf-ranks-"
_swept = [False]


def make_directory() -> str:
    """A new report directory; the first one of a process also removes those of dead processes.

    A launching process removes its directories itself, even when its test
    fails or crashes; only one that was killed (Lightning kills its launcher
    when a ``ddp`` rank fails) leaves one behind, which the next run sweeps.
    """
    if not _swept[0]:
        _swept[0] = True
        _sweep(tempfile.gettempdir())
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def _sweep(root: str) -> None:
    try:
        names = [n for n in os.listdir(root) if n.startswith(PREFIX)]
    except OSError:
        return
    for name in names:
        pid = name[len(PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except OSError:  # alive, someone else's
            pass


def new_launch(launcher: str, directory: Optional[str] = None, only: Optional[list[Run]] = None) -> Optional[Launch]:
    """A launch for the active runs (or those of them in ``only``), with its report directory; None without runs."""
    runs = [run for run in core.active_runs() if run.active]
    if not runs or (only is not None and not only):
        return None
    if directory is None:
        directory = make_directory()
    else:
        os.makedirs(directory, exist_ok=True)
    launch = Launch(launcher, directory)
    for depth, run in enumerate(runs):
        if only is None or run in only:
            launch.runs[depth] = run
            _LAUNCHES.setdefault(run, []).append(launch)
    return launch


# -- collecting ------------------------------------------------------------------------------


def _exit_code(process: Any) -> Optional[int]:
    if process is None:
        return None
    if hasattr(process, "poll"):  # subprocess.Popen
        return process.poll()
    return getattr(process, "exitcode", None)  # multiprocessing.Process


def _why_missing(process: Any, waited: float, timed_out: bool) -> str:
    code = _exit_code(process)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"no report: the process was killed by {name} before its watch ended"
    if code is not None:
        return f"no report: the process exited with code {code} before its watch ended"
    if timed_out:
        return f"no report within {waited:.0f} s of the end of this watch (the process is still running)"
    return "no report: the process never reached the end of its watch"


def _wait_for(path: str, process: Any, deadline: float) -> Optional[str]:
    """Wait until ``path`` exists, ``process`` exited or ``deadline`` passed; the reason it is missing, or None."""
    start = monotonic()
    pause = 0.005
    while True:
        if os.path.exists(path):
            return None
        if process is not None and _exit_code(process) is not None:
            return None if os.path.exists(path) else _why_missing(process, monotonic() - start, False)
        if monotonic() >= deadline:
            return _why_missing(process, monotonic() - start, True)
        sleep(pause)
        pause = min(pause * 2, 0.1)


def _part(path: str, local: int, launcher: str, missing: Optional[str]) -> Part:
    data = read_json(path) if missing is None else None
    if data is None:
        return Part(local, None, launcher=launcher, missing=missing or "no readable report")
    report = report_from_data(data["report"]) if data.get("report") is not None else None
    rank = data.get("rank")
    return Part(
        rank if isinstance(rank, int) else local,
        report,
        pid=data.get("pid"),
        launcher=data.get("launcher", launcher),
        error=data.get("error"),
        missing="" if report is not None else "the rank's watch made no report",
    )


def _release(launch: Launch, run: Run) -> None:
    for depth, other in list(launch.runs.items()):
        if other is run:
            del launch.runs[depth]
    if not launch.runs:
        shutil.rmtree(launch.directory, ignore_errors=True)


def collect(run: Run, exc: Optional[BaseException]) -> None:
    """Merge the reports of the ranks launched while ``run`` watched into ``run.report`` (never raises)."""
    launches = _LAUNCHES.pop(run, [])
    if not launches:
        return
    parts: list[Part] = []
    try:
        timeout = REPORT_TIMEOUT_AFTER_ERROR if exc is not None else REPORT_TIMEOUT
        deadline = monotonic() + timeout
        for launch in launches:
            depth = next((d for d, r in launch.runs.items() if r is run), None)
            if depth is None:
                continue
            for local, process in sorted(launch.expected.items()):
                path = report_path(launch.directory, depth, local)
                parts.append(_part(path, local, launch.launcher, _wait_for(path, process, deadline)))
    finally:
        for launch in launches:
            _release(launch, run)
    if not parts or run.report is None:
        return
    try:
        own = Part(child.rank_of(run), run.report, pid=os.getpid(), launcher="")
        parts.sort(key=lambda p: (p.rank is None, p.rank if p.rank is not None else 0))
        run.report = merge([own] + parts)
    except Exception as error:  # noqa: BLE001 - a torchperf bug must not decide the test
        run.report.internal_errors.setdefault("ranks", f"{type(error).__name__}: {error}")


# -- function launchers: torch.multiprocessing.start_processes ---------------------------------


def _wrap_start_processes(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @wraps(original)
    def start_processes(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not core.active_runs():
            return original(*args, **kwargs)
        try:
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            values = bound.arguments
            launch = new_launch("torch.multiprocessing")
        except Exception as exc:  # noqa: BLE001 - the call itself will say what is wrong with it
            core.probe_failed("ranks", exc)
            return original(*args, **kwargs)
        if launch is None:
            return original(*args, **kwargs)
        join = values["join"]
        values["fn"] = RankEntry(values["fn"], launch.spec())
        values["join"] = False
        context = original(**values)
        for index, process in enumerate(getattr(context, "processes", None) or ()):
            launch.expected[index] = process
        if not join:
            return context
        while not context.join():  # what start_processes does with join=True
            pass
        return None

    return start_processes


# -- command launchers: Lightning's and Fabric's subprocess script launcher ---------------------

#: The launcher modules of Lightning (both package names) and Fabric.
_SCRIPT_LAUNCHERS = {
    "pytorch_lightning.strategies.launchers.subprocess_script": "lightning ddp",
    "lightning.pytorch.strategies.launchers.subprocess_script": "lightning ddp",
    "lightning_fabric.strategies.launchers.subprocess_script": "fabric ddp",
    "lightning.fabric.strategies.launchers.subprocess_script": "fabric ddp",
}
_SCRIPT_NAMES = frozenset(_SCRIPT_LAUNCHERS.values())


class _ScriptState:
    """This process's report directory for re-run ranks, the rank processes it started, launches per test."""

    def __init__(self) -> None:
        self.directory: Optional[str] = None
        #: Local rank -> Popen of the rank processes this process started with the environment variable.
        self.children: dict[int, Any] = {}
        #: (node id) -> launches counted so far, in this process and in its re-run ranks alike.
        self.counts: dict[str, int] = {}
        #: The launch whose ``_call_children_scripts`` is running.
        self.current: Optional[Launch] = None

    def session_directory(self) -> str:
        if self.directory is None or not os.path.isdir(self.directory):
            self.directory = make_directory()
            atexit.register(shutil.rmtree, self.directory, True)
        return self.directory

    def next_key(self) -> str:
        """``<node id>#<n>``: the n-th ddp launch of the current test (or script), the same in every rank."""
        nodeid = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
        count = self.counts[nodeid] = self.counts.get(nodeid, 0) + 1
        return f"{nodeid}#{count}"


_SCRIPT = _ScriptState()


def _key_directory(base: str, key: str) -> str:
    return os.path.join(base, re.sub(r"[^A-Za-z0-9_.-]+", "_", key)[-150:])


#: Run -> (report directory, depth) for runs of a re-run rank that saw a ddp launch: they report at their end.
_TAGGED: weakref.WeakKeyDictionary[Run, tuple[str, int]] = weakref.WeakKeyDictionary()


def _wrap_script_launch(original: Callable[..., Any], launcher: str) -> Callable[..., Any]:
    @wraps(original)
    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        runs = [run for run in core.active_runs() if run.active]
        if not runs:
            return original(self, *args, **kwargs)
        pending: Optional[Launch] = None
        try:
            ctx = child.context()
            if ctx is not None and ctx.get("mode") == "rerun":
                # A re-run rank: its runs report to the launching process at their end.
                directory = _key_directory(ctx["dir"], _SCRIPT.next_key())
                for depth, run in enumerate(runs):
                    _TAGGED.setdefault(run, (directory, depth))
            elif ctx is None:
                key = _SCRIPT.next_key()
                # A run reports once per rank process: its first ddp launch collects; later ones reuse the ranks.
                fresh = [
                    run
                    for run in runs
                    if not any(launch.launcher in _SCRIPT_NAMES for launch in _LAUNCHES.get(run, ()))
                ]
                pending = new_launch(launcher, _key_directory(_SCRIPT.session_directory(), key), only=fresh)
                if pending is not None:
                    pending.expected.update(_live(_SCRIPT.children))
                    _SCRIPT.current = pending
        except Exception as exc:  # noqa: BLE001
            core.probe_failed("ranks", exc)
        try:
            return original(self, *args, **kwargs)
        finally:
            if pending is not None and _SCRIPT.current is pending:
                _SCRIPT.current = None

    return launch


def _live(children: dict[int, Any]) -> dict[int, Any]:
    return {local: proc for local, proc in children.items() if proc.poll() is None}


def _wrap_call_children(original: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(original)
    def _call_children_scripts(self: Any) -> None:
        __tracebackhide__ = True
        launch = _SCRIPT.current
        if launch is None:
            return original(self)
        previous = os.environ.get(ENV)
        os.environ[ENV] = RankSpec(_SCRIPT.session_directory(), launch.launcher).to_env("rerun")
        try:
            original(self)
        finally:
            if previous is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = previous
        for index, proc in enumerate(getattr(self, "procs", None) or ()):
            _SCRIPT.children[index + 1] = proc
            launch.expected[index + 1] = proc

    return _call_children_scripts


def report_tagged(run: Run, exc: Optional[BaseException]) -> None:
    """In a re-run rank: send ``run``'s report to the launching process, if it saw a ddp launch."""
    tag = _TAGGED.pop(run, None)
    if tag is None:
        return
    directory, depth = tag
    ctx = child.context() or {}
    local = os.environ.get("LOCAL_RANK", "0")
    error = child.error_of(exc)
    child.write_report(run, directory, depth, int(local) if local.isdigit() else 0, ctx.get("launcher", ""), error)


# -- torchrun's agent with a script ---------------------------------------------------------------

#: (run id, restart, node) of the agent's current round -> its launch.
_ELASTIC: dict[tuple, Launch] = {}

_PYTHON = re.compile(r"python[0-9.]*(\.exe)?$")
#: Interpreter options that take a value as the next argument.
_OPTION_WITH_VALUE = ("-W", "-X", "-Q")


def _boot_args(args: tuple) -> Optional[tuple]:
    """``args`` of a Python command with the script (or ``-m module``) run through :data:`BOOT_MODULE`."""
    items = [str(a) for a in args]
    i = 0
    while i < len(items) and items[i].startswith("-") and items[i] not in ("-m", "-c", "-"):
        i += 2 if items[i] in _OPTION_WITH_VALUE else 1
    if i >= len(items) or items[i] in ("-c", "-"):
        return None
    return tuple(items[:i] + ["-m", BOOT_MODULE] + items[i:])


def _wrap_subprocess_handler(original: Callable[..., Any]) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @wraps(original)
    def get_subprocess_handler(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not core.active_runs():
            return original(*args, **kwargs)
        launch = None
        try:
            bound = signature.bind(*args, **kwargs)
            values = bound.arguments
            entrypoint = str(values.get("entrypoint", ""))
            boot = _boot_args(tuple(values.get("args", ()))) if _PYTHON.search(os.path.basename(entrypoint)) else None
            if boot is not None:
                env = dict(values.get("env") or {})
                key = (env.get("TORCHELASTIC_RUN_ID"), env.get("TORCHELASTIC_RESTART_COUNT"), env.get("GROUP_RANK"))
                launch = _ELASTIC.get(key)
                if launch is None or not launch.runs:
                    launch = _ELASTIC[key] = new_launch("torchrun")  # type: ignore[assignment]
                if launch is not None:
                    env[ENV] = launch.spec().to_env("boot")
                    values["env"] = env
                    values["args"] = boot
                    args, kwargs = bound.args, bound.kwargs
        except Exception as exc:  # noqa: BLE001
            core.probe_failed("ranks", exc)
            launch = None
        handler = original(*args, **kwargs)
        if launch is not None:
            try:
                local = int(bound.arguments.get("local_rank_id", len(launch.expected)))
                launch.expected[local] = getattr(handler, "proc", None)
            except Exception as exc:  # noqa: BLE001
                core.probe_failed("ranks", exc)
        return handler

    return get_subprocess_handler


# -- the rank of this process -------------------------------------------------------------------


def _wrap_init_process_group(original: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        result = original(*args, **kwargs)
        if core.active_runs():
            try:
                import torch.distributed as dist

                child.rank_seen(int(dist.get_rank()))
            except Exception:  # noqa: BLE001 - the rank is then read at the end of the run
                pass
        return result

    return init_process_group


# -- installing ------------------------------------------------------------------------------------


def install(patcher: Patcher) -> None:
    """Patch the launchers (those imported later, when they are imported)."""

    def on_spawn_module(module: Any) -> None:
        original = vars(module).get("start_processes")
        if original is None:
            return
        wrapped = _wrap_start_processes(original)
        patcher.setattr(module, "start_processes", wrapped)
        package = sys.modules.get("torch.multiprocessing")
        if package is not None and getattr(package, "start_processes", None) is original:
            patcher.setattr(package, "start_processes", wrapped)

    def on_script_module(module: Any, launcher: str) -> None:
        cls = getattr(module, "_SubprocessScriptLauncher", None)
        if cls is None:
            return
        if "launch" in vars(cls):
            patcher.setattr(cls, "launch", _wrap_script_launch(vars(cls)["launch"], launcher))
        if "_call_children_scripts" in vars(cls):
            patcher.setattr(cls, "_call_children_scripts", _wrap_call_children(vars(cls)["_call_children_scripts"]))

    def on_elastic(module: Any) -> None:
        original = vars(module).get("get_subprocess_handler")
        if original is not None:
            patcher.setattr(module, "get_subprocess_handler", _wrap_subprocess_handler(original))

    def on_c10d(module: Any) -> None:
        package = sys.modules.get("torch.distributed")
        original = vars(module).get("init_process_group")
        if original is None:
            return
        wrapped = _wrap_init_process_group(original)
        patcher.setattr(module, "init_process_group", wrapped)
        if package is not None and getattr(package, "init_process_group", None) is original:
            patcher.setattr(package, "init_process_group", wrapped)

    def guarded(fn: Callable[..., None], *extra: Any) -> Callable[[Any], None]:
        def attach(module: Any) -> None:
            try:
                fn(module, *extra)
            except Exception as exc:  # noqa: BLE001 - never into the user's import
                core.probe_failed("ranks", exc)

        return attach

    patcher.on_import("torch.multiprocessing.spawn", guarded(on_spawn_module))
    for module_name, launcher in _SCRIPT_LAUNCHERS.items():
        patcher.on_import(module_name, guarded(on_script_module, launcher))
    patcher.on_import("torch.distributed.elastic.multiprocessing.api", guarded(on_elastic))
    patcher.on_import("torch.distributed.distributed_c10d", guarded(on_c10d))
    patcher.callback(_ELASTIC.clear)
