"""The session's settings: the ``--torchperf-*`` options, their ini twins, and how they resolve.

Precedence of every setting: marker (or ``torchperf.watch()`` argument) >
command line > ini file > default. Command-line defaults are None so they
never shadow an ini value; ini values are validated like command-line ones,
and a bad value is a usage error naming it, what it accepts and the closest
valid value.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest

from ..constants import OVERHEAD_INCONCLUSIVE, SCOPES
from ..errors import UsageError, suggest
from . import adoption, project

__all__ = ["Settings", "Threads", "add_options", "apply_threads", "resolve_settings", "session_defaults"]

@dataclass(frozen=True)
class Settings:
    """Session-wide settings, resolved once from the command line, the ini file and defaults."""

    scope: Optional[str] = None  # None: each marker's own default
    report_only: bool = False
    json_path: Optional[str] = None
    threads: str = "auto"  # "auto", "off" or a positive integer
    overhead_inconclusive: Optional[str] = None  # None: each marker's own default
    max_sync_rate: Optional[float] = None  # None: each marker's own default
    user_packages: tuple[str, ...] = ()  # import names counted as the user's code even when installed
    baseline_path: Optional[str] = None
    baseline_update: bool = False
    annotations: str = "auto"  # "auto" (when GITHUB_ACTIONS=true), "on" or "off"
    trace_dir: Optional[str] = None
    full_stacks: bool = False  # reports show every frame, pytest's included


def _scope_arg(value: str) -> str:
    if value not in SCOPES:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(SCOPES)}, got {value!r}{suggest(value, SCOPES)}"
        )
    return value


def _inconclusive_arg(value: str) -> str:
    if value not in OVERHEAD_INCONCLUSIVE:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(OVERHEAD_INCONCLUSIVE)}, got {value!r}{suggest(value, OVERHEAD_INCONCLUSIVE)}"
        )
    return value


def _threads_arg(value: str) -> str:
    if value in ("auto", "off") or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError(f"must be 'auto', 'off' or a positive integer, got {value!r}")


def _rate_arg(value: str) -> float:
    try:
        rate = float(value)
    except ValueError:
        rate = -1.0
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError(f"must be a number from 0 to 1, got {value!r}")
    return rate


def _packages_arg(value: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in value.replace(",", " ").split() if name.strip())


def _annotations_arg(value: str) -> str:
    if value in adoption.ANNOTATIONS:
        return value
    raise argparse.ArgumentTypeError(
        f"must be one of {', '.join(adoption.ANNOTATIONS)}, got {value!r}{suggest(value, adoption.ANNOTATIONS)}"
    )


_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def _flag_arg(value: str) -> bool:
    word = value.lower()
    if word in _TRUE + _FALSE:
        return word in _TRUE
    raise argparse.ArgumentTypeError(f"must be true or false, got {value!r}{suggest(word, _TRUE + _FALSE)}")


def add_options(parser: pytest.Parser) -> None:
    """Register the ``--torchperf-*`` options and their ini twins."""
    group = parser.getgroup("torchperf", "PyTorch/Lightning performance invariants (pytest-torchperf)")
    group.addoption(
        "--torchperf-json",
        metavar="PATH",
        default=None,
        help="write every watched test's verdicts and figures to this JSON file (ini: torchperf_json)",
    )
    group.addoption(
        "--torchperf-scope",
        metavar="SCOPE",
        type=_scope_arg,
        default=None,
        help=f"default scope of the step checks for every marker and watch: {', '.join(SCOPES)} "
        "(a marker's own scope= wins; ini: torchperf_scope)",
    )
    group.addoption(
        "--torchperf-report-only",
        action="store_true",
        default=None,
        help="report broken invariants without failing tests, to adopt the plugin on an existing suite "
        "(ini: torchperf_report_only)",
    )
    group.addoption(
        "--torchperf-threads",
        metavar="N",
        type=_threads_arg,
        default=None,
        help="torch CPU threads per process: 'auto' (under xdist: cores / workers, unless OMP_NUM_THREADS "
        "or MKL_NUM_THREADS is set), 'off' or a number (ini: torchperf_threads; default auto)",
    )
    group.addoption(
        "--torchperf-overhead-inconclusive",
        metavar="ACTION",
        type=_inconclusive_arg,
        default=None,
        help="what a max_overhead verdict that stays inconclusive (its interval includes the threshold after "
        "overhead_rounds) does to the test: fail (default), skip, or warn (pass with a warning); a marker's own "
        "overhead_inconclusive= wins (ini: torchperf_overhead_inconclusive)",
    )
    group.addoption(
        "--torchperf-max-sync-rate",
        metavar="RATE",
        type=_rate_arg,
        default=None,
        help="default max_sync_rate of no_host_sync: a site that syncs in at most this share of the steps "
        "(0.1: every 10th step or rarer) or once per epoch is a note; 0 fails on every sync "
        "(a marker's own max_sync_rate= wins; ini: torchperf_max_sync_rate)",
    )
    group.addoption(
        "--torchperf-user-packages",
        metavar="NAMES",
        type=_packages_arg,
        default=None,
        help="comma-separated import packages that are your code even when installed in site-packages "
        "(the rootdir project's own packages always are; ini: torchperf_user_packages)",
    )
    group.addoption(
        "--torchperf-full-stacks",
        action="store_true",
        default=None,
        help="show every frame of a report's stacks, pytest's and pluggy's included (by default, and under -v, "
        "only your code, the frameworks' and libraries' frames are shown; ini: torchperf_full_stacks)",
    )
    adoption.add_options(group, _annotations_arg)
    parser.addini("torchperf_json", "write the torchperf JSON report to this path", type="string", default="")
    parser.addini(
        "torchperf_scope", f"default scope of the step checks: {', '.join(SCOPES)}", type="string", default=""
    )
    parser.addini("torchperf_report_only", "report broken invariants without failing tests", type="bool", default=False)
    parser.addini(
        "torchperf_threads", "torch CPU threads per process: auto, off or a number", type="string", default=""
    )
    parser.addini(
        "torchperf_overhead_inconclusive",
        f"what an inconclusive max_overhead verdict does: {', '.join(OVERHEAD_INCONCLUSIVE)}",
        type="string",
        default="",
    )
    parser.addini(
        "torchperf_max_sync_rate", "default max_sync_rate of no_host_sync (0 to 1)", type="string", default=""
    )
    parser.addini(
        "torchperf_user_packages", "import packages that are your code even when installed", type="args", default=[]
    )
    adoption.add_ini(parser)
    parser.addini(
        "torchperf_full_stacks", "show every frame of a report's stacks: true or false", type="string", default=""
    )


def resolve_settings(config: pytest.Config) -> Settings:
    """Command line > ini > default, with ini values validated like command-line ones."""

    def ini(name: str, check: Callable[[str], Any]) -> Any:
        value = str(config.getini(name) or "").strip()
        if not value:
            return None
        try:
            return check(value)
        except argparse.ArgumentTypeError as exc:
            raise pytest.UsageError(f"pytest-torchperf: ini option {name} {exc}") from None

    scope = config.getoption("torchperf_scope") or ini("torchperf_scope", _scope_arg)
    report_only = config.getoption("torchperf_report_only")
    if report_only is None:
        report_only = bool(config.getini("torchperf_report_only"))
    json_path = config.getoption("torchperf_json") or ini("torchperf_json", str)
    if json_path:
        json_path = os.path.join(str(config.invocation_params.dir), os.path.expanduser(json_path))
    threads = config.getoption("torchperf_threads") or ini("torchperf_threads", _threads_arg) or "auto"
    inconclusive = config.getoption("torchperf_overhead_inconclusive") or ini(
        "torchperf_overhead_inconclusive", _inconclusive_arg
    )
    max_sync_rate = config.getoption("torchperf_max_sync_rate")
    if max_sync_rate is None:
        max_sync_rate = ini("torchperf_max_sync_rate", _rate_arg)
    named = config.getoption("torchperf_user_packages")
    where = "--torchperf-user-packages"
    if named is None:
        named, where = tuple(config.getini("torchperf_user_packages") or ()), "ini option torchperf_user_packages"
    try:
        user_packages = project.check_names(named, where)
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None
    invocation = str(config.invocation_params.dir)
    inidir = str(config.inipath.parent) if config.inipath else str(config.rootpath)
    baseline_path = config.getoption("torchperf_baseline")
    if baseline_path:
        baseline_path = os.path.join(invocation, os.path.expanduser(baseline_path))
    elif ini("torchperf_baseline", str):
        baseline_path = os.path.join(inidir, os.path.expanduser(ini("torchperf_baseline", str) or ""))
    baseline_update = bool(config.getoption("torchperf_baseline_update"))
    if baseline_update and not baseline_path:
        raise pytest.UsageError(
            "pytest-torchperf: --torchperf-baseline-update needs the file: --torchperf-baseline=PATH "
            "or the ini option torchperf_baseline"
        )
    annotate = config.getoption("torchperf_annotations") or ini("torchperf_annotations", _annotations_arg) or "auto"
    trace_dir = config.getoption("torchperf_trace") or ini("torchperf_trace", str)
    if trace_dir:
        trace_dir = os.path.join(invocation, os.path.expanduser(trace_dir))
    full_stacks = config.getoption("torchperf_full_stacks")
    if full_stacks is None:
        full_stacks = bool(ini("torchperf_full_stacks", _flag_arg))
    return Settings(
        full_stacks=full_stacks, scope=scope, report_only=report_only, json_path=json_path, threads=threads,
        max_sync_rate=max_sync_rate, user_packages=user_packages, overhead_inconclusive=inconclusive,
        baseline_path=baseline_path, baseline_update=baseline_update, annotations=annotate, trace_dir=trace_dir,
    )


def apply_threads(config: pytest.Config, settings: Settings) -> Optional[int]:
    """The torch CPU thread count watched tests run with (None: leave it): under xdist, "auto" keeps the
    workers from oversubscribing the cores; a number pins it. Nothing is set here: :class:`Threads` applies it
    around each watched test only, so an unmarked test sees what it would see without the plugin."""
    workerinput = getattr(config, "workerinput", None)
    if settings.threads == "off":
        return None
    if settings.threads == "auto":
        if workerinput is None or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
            return None
        workers = int(workerinput.get("workercount", 1) or 1)
        return max(1, (os.cpu_count() or 1) // workers)
    return int(settings.threads)


class Threads:
    """The thread setting of one watched test: applied before it, put back after it."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._torch: Optional[int] = None
        self._env: Optional[str] = None
        self._applied = False

    def apply(self) -> None:
        import torch  # a watched test needs torch anyway

        self._env = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # for the processes the test starts
        self._torch = torch.get_num_threads()
        if self._torch != self.threads:
            torch.set_num_threads(self.threads)
        self._applied = True

    def restore(self) -> None:
        if not self._applied:
            return
        self._applied = False
        if self._env is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = self._env
        torch = sys.modules.get("torch")
        if torch is not None and self._torch is not None and torch.get_num_threads() != self._torch:
            torch.set_num_threads(self._torch)


def session_defaults(settings: Settings) -> dict[str, Any]:
    """The arguments every marker and ``watch()`` gets unless it sets its own."""
    defaults: dict[str, Any] = {}
    if settings.scope:
        defaults["scope"] = settings.scope
    if settings.overhead_inconclusive:
        defaults["overhead_inconclusive"] = settings.overhead_inconclusive
    if settings.max_sync_rate is not None:
        defaults["max_sync_rate"] = settings.max_sync_rate
    return defaults
