"""pytest glue: the ``torchperf`` marker and fixture, options, failure reports, summary, JSON.

The checking itself lives in :mod:`pytest_torchperf.watch` and is plain Python;
this module decides when to watch, turns a broken invariant into a failed
test report, and records every watched test's verdicts for the terminal
summary, JUnit properties and the JSON report (on the xdist controller, from
the reports its workers send). An unmarked test that does not request the
fixture costs one marker lookup.

Precedence of every setting: marker (or ``torchperf.watch()`` argument) >
command line > ini file > default. Command-line defaults are None so they
never shadow an ini value.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional

import pytest

from . import ranks, results, stacks
from .arguments import UsageError, suggest
from .options import OVERHEAD_ROUNDS, SCOPES, Options, describe_options, parse_options
from .report import FAILED, NOT_CHECKED, InvariantViolation, Report
from .timing import ParityResult, parity
from .core import Run
from .watch import stop as _stop_run
from .watch import watching

MARKER = "torchperf"
#: Environment variable naming the file lock that serialises timed sections across xdist workers.
TIMING_LOCK_ENV = "PYTEST_TORCHPERF_TIMING_LOCK"

_OPTIONS = pytest.StashKey[Optional[Options]]()
_RUNS = pytest.StashKey["list[tuple[str, Any]]"]()  # (source, a Run or a _Comparison)
_SETTINGS = pytest.StashKey["Settings"]()


# -- settings ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Session-wide settings, resolved once from the command line, the ini file and defaults."""

    scope: Optional[str] = None  # None: each marker's own default
    report_only: bool = False
    json_path: Optional[str] = None
    threads: str = "auto"  # "auto", "off" or a positive integer


def _scope_arg(value: str) -> str:
    if value not in SCOPES:
        raise argparse.ArgumentTypeError(
            f"must be one of {', '.join(SCOPES)}, got {value!r}{suggest(value, SCOPES)}"
        )
    return value


def _threads_arg(value: str) -> str:
    if value in ("auto", "off") or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError(f"must be 'auto', 'off' or a positive integer, got {value!r}")


def pytest_addoption(parser: pytest.Parser) -> None:
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
    parser.addini("torchperf_json", "write the torchperf JSON report to this path", type="string", default="")
    parser.addini("torchperf_scope", f"default scope of the step checks: {', '.join(SCOPES)}", type="string", default="")
    parser.addini("torchperf_report_only", "report broken invariants without failing tests", type="bool", default=False)
    parser.addini("torchperf_threads", "torch CPU threads per process: auto, off or a number", type="string", default="")


def resolve_settings(config: pytest.Config) -> Settings:
    """Command line > ini > default, with ini values validated like command-line ones."""

    def ini(name: str, check: Any) -> Optional[str]:
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
    return Settings(scope=scope, report_only=report_only, json_path=json_path, threads=threads)


def _apply_threads(config: pytest.Config, settings: Settings) -> None:
    """Keep xdist workers from oversubscribing the cores (or pin the count the user asked for)."""
    workerinput = getattr(config, "workerinput", None)
    if settings.threads == "off":
        return
    if settings.threads == "auto":
        if workerinput is None or os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
            return
        workers = int(workerinput.get("workercount", 1) or 1)
        threads = max(1, (os.cpu_count() or 1) // workers)
    else:
        threads = int(settings.threads)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    else:  # read by torch when it is imported; never import it here
        os.environ["OMP_NUM_THREADS"] = str(threads)


class _XdistController:
    """Registered on the xdist controller only: hands each worker the session's timing lock."""

    def __init__(self) -> None:
        self.directory = tempfile.mkdtemp(prefix="torchperf-")
        self.lock_path = os.path.join(self.directory, "timing.lock")

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["torchperf_timing_lock"] = self.lock_path

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}({describe_options()}): watch the test body and fail the test when a "
        "PyTorch/Lightning performance invariant breaks (see the pytest-torchperf README).",
    )
    settings = config.stash[_SETTINGS] = resolve_settings(config)
    stacks.set_display_root(str(config.rootpath))
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        lock = workerinput.get("torchperf_timing_lock")
        if lock and TIMING_LOCK_ENV not in os.environ:
            os.environ[TIMING_LOCK_ENV] = lock
    elif config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no":
        controller = _XdistController()
        config.pluginmanager.register(controller, "torchperf-xdist")
        config.add_cleanup(controller.close)
    _apply_threads(config, settings)
    config.pluginmanager.register(_Recorder(config, settings), "torchperf-recorder")


# -- watching a test ------------------------------------------------------------------------


def _session_defaults(config: pytest.Config) -> dict[str, Any]:
    settings = config.stash[_SETTINGS]
    return {"scope": settings.scope} if settings.scope else {}


def _marker_options(item: pytest.Item) -> Optional[Options]:
    marks = list(item.iter_markers(MARKER))
    if not marks:
        return None
    merged: dict[str, Any] = _session_defaults(item.config)
    # iter_markers yields the closest marker first: apply farthest first so closer ones win.
    for mark in reversed(marks):
        parse_options(mark.kwargs, args=mark.args, where=f"@pytest.mark.{MARKER}")
        merged.update(mark.kwargs)
    return parse_options(merged, where=f"@pytest.mark.{MARKER}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_RUNS] = []
    item.stash[_OPTIONS] = None
    try:
        options = _marker_options(item)
    except UsageError as exc:
        error = str(exc)
    else:
        item.stash[_OPTIONS] = options
        return
    pytest.fail(f"pytest-torchperf: {error}", pytrace=False)


def _verdict(config: pytest.Config, run: Run) -> None:
    """Fail the test on a broken invariant, unless the session only reports (or is a rank: its launcher judges)."""
    assert run.report is not None
    if not run.report.passed and not config.stash[_SETTINGS].report_only and not ranks.judged_elsewhere():
        raise InvariantViolation(run.report)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    options = item.stash.get(_OPTIONS, None)
    if options is None:
        return (yield)
    with watching(options) as run:
        item.stash[_RUNS].append(("marker", run))
        result = yield
    _verdict(item.config, run)
    return result


# -- failure reports ------------------------------------------------------------------------


@dataclass
class _Crash:
    """The one-line message pytest shows in ``-r`` summaries and JUnit ``message``."""

    path: str
    lineno: int
    message: str


class TorchperfFailure:
    """A failed test's ``longrepr``: the summary line, then one section per broken invariant."""

    def __init__(self, report: Report, item: pytest.Item, verbose: bool) -> None:
        self.report = report
        self.verbose = verbose
        path, lineno, _ = item.location
        self.reprcrash = _Crash(path, (lineno or 0) + 1, report.summary_line())

    def toterminal(self, tw: Any) -> None:
        for block in self.report.blocks(self.verbose):
            if block.title is not None:
                tw.sep("-", block.title, red=True)
            for line in block.lines:
                tw.line(line)

    def __str__(self) -> str:
        return self.report.render(self.verbose)


def _run_data(source: str, run: Any) -> dict[str, Any]:
    """A finished run (a :class:`Run`, or a fixture comparison) as plain data."""
    options = run.options if isinstance(run.options, dict) else run.options.to_dict()
    data = {"source": source, "options": options}
    data.update(run.report.to_dict())
    return data


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if call.when != "call":
        return report
    runs = [_run_data(source, run) for source, run in item.stash.get(_RUNS, []) if run.report is not None]
    if runs:
        # Plain data, so it travels from xdist workers to the controller with the report.
        report.torchperf = runs
        report.torchperf_report_only = item.config.stash[_SETTINGS].report_only
        properties = results.junit_properties(results.merge_checks(runs))
        item.user_properties.extend(properties)  # JUnit XML writes the teardown report's properties
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, InvariantViolation) and report.failed:
        verbose = (item.config.getoption("verbose", 0) or 0) > 0
        report.longrepr = TorchperfFailure(exc.report, item, verbose)
    return report


# -- the session's record: summary table and JSON ----------------------------------------------


class _Recorder:
    """Collects every watched test's verdicts (from worker reports too) for the summary and JSON."""

    def __init__(self, config: pytest.Config, settings: Settings) -> None:
        self.config = config
        self.settings = settings
        self.tests: list[dict[str, Any]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        runs = getattr(report, "torchperf", None)
        if report.when == "call" and runs:
            report_only = bool(getattr(report, "torchperf_report_only", False))
            self.tests.append(results.test_entry(report.nodeid, report.outcome, report.duration, runs, report_only))

    @property
    def _is_worker(self) -> bool:
        return getattr(self.config, "workerinput", None) is not None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._is_worker or not self.settings.json_path or ranks.judged_elsewhere():
            return  # a rank process re-running the session (Lightning's ddp) leaves the JSON to its launcher
        env: dict[str, Any] = results.environment(results.device_info())
        env["xdist_workers"] = getattr(self.config.option, "numprocesses", None) or 0
        env["report_only"] = self.settings.report_only
        results.write(self.settings.json_path, results.document(self.tests, env))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self._is_worker or not self.tests:
            return
        tr = terminalreporter
        verbose = (self.config.getoption("verbose", 0) or 0) > 0
        rank = os.environ.get("LOCAL_RANK", "?") if ranks.judged_elsewhere() else None
        tr.write_sep("=", "torchperf summary" if rank is None else f"torchperf summary of rank process {rank} (reported to its launcher, which judges)")
        broken: dict[str, int] = {}
        for test in self.tests:
            failed = [name for name, c in test["checks"].items() if c["status"] == FAILED]
            for name in failed:
                broken[name] = broken.get(name, 0) + 1
            note = " (report only: broken invariants did not fail it)" if failed and test["report_only"] else ""
            markup = {"red": True} if test["outcome"] == "failed" or failed else {"green": True}
            tr.write_line(f"{test['outcome'].upper():7} {test['nodeid']}{note}", **markup)
            for run in test["runs"]:
                parts = []
                for name, check in run["checks"].items():
                    if check["status"] == NOT_CHECKED:
                        parts.append(f"{name}: not checked" + (f" ({check['summary']})" if verbose else ""))
                    else:
                        parts.append(f"{name}: {check['status']} ({check['summary']})")
                tr.write_line(f"        {run['source']}: " + " | ".join(parts))
                for process in run.get("ranks", ()):  # a rank that raised or sent nothing says so here
                    error, missing = process.get("error"), process.get("missing")
                    if error:
                        where = f" at {error['where']}" if error.get("where") else ""
                        tr.write_line(
                            f"        {process['process']} (pid {process['pid']}) raised {error['type']}: "
                            f"{error['message']}{where}", red=True,
                        )
                    elif missing:
                        tr.write_line(f"        {process['process']}: {missing}", red=True)
        watched = len(self.tests)
        line = f"torchperf: {watched} watched test{'s' if watched != 1 else ''}"
        if broken:
            line += ", broken invariants: " + ", ".join(f"{name} in {n}" for name, n in broken.items())
        else:
            line += ", no broken invariant"
        tr.write_line(line)
        if self.settings.json_path:
            tr.write_line(f"torchperf: JSON report written to {self.settings.json_path}")


# -- the fixture ----------------------------------------------------------------------------


@dataclass
class _Comparison:
    """A ``torchperf.parity()`` result, recorded like a run for the summary, JUnit and JSON."""

    report: Report
    options: dict[str, Any]


class TorchperfFixture:
    """The ``torchperf`` fixture: ``watch()`` around a user's own loop, ``parity()`` of two loops."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        self._open: list[Run] = []

    @contextlib.contextmanager
    def watch(self, **kwargs: Any) -> Iterator[Run]:
        """Watch the block like ``@pytest.mark.torchperf(**kwargs)`` watches a test body.

        Yields the :class:`~pytest_torchperf.Run`; mark each training step of a
        plain loop with ``with run.step():``. On a clean exit a broken invariant
        fails the test with the torchperf report (unless the session runs with
        ``--torchperf-report-only``); ``run.report`` holds the verdicts.
        """
        parse_options(kwargs, where="torchperf.watch()")  # the caller's own mistakes, named as theirs
        options = parse_options({**_session_defaults(self._item.config), **kwargs}, where="torchperf.watch()")
        with watching(options) as run:
            self._open.append(run)
            self._item.stash.setdefault(_RUNS, []).append(("fixture", run))
            try:
                yield run
            finally:
                self._open.remove(run)
        _verdict(self._item.config, run)

    def parity(
        self,
        candidate: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        max_overhead: Optional[float] = None,
        rounds: int = OVERHEAD_ROUNDS,
        warmup: int = 1,
        names: tuple[str, str] = ("candidate", "baseline"),
    ) -> ParityResult:
        """Time two callables that each run one epoch; fail when ``candidate`` exceeds ``max_overhead``.

        The statistics are those of the ``max_overhead`` invariant (interleaved
        rounds, warm-up dropped, median paired ratio with a 95% bootstrap
        interval; see :func:`pytest_torchperf.parity`). The comparison is
        recorded for the summary and the JSON report, and a ``max_overhead``
        exceeded fails the test with the same report as the marker (unless the
        session runs with ``--torchperf-report-only``).
        """
        result = parity(
            candidate, baseline, max_overhead=max_overhead, rounds=rounds, warmup=warmup, names=names, check=False
        )
        report = result.report()
        options = {"max_overhead": max_overhead, "rounds": rounds, "warmup": warmup, "names": list(names)}
        self._item.stash.setdefault(_RUNS, []).append(("parity", _Comparison(report, options)))
        if result.exceeded and not self._item.config.stash[_SETTINGS].report_only:
            raise InvariantViolation(report)
        return result

    def __repr__(self) -> str:
        return f"<torchperf fixture: {len(self._open)} watch(es) open>"

    def _close(self) -> None:
        """Stop runs the test left open (a watch entered by hand and never exited)."""
        while self._open:
            _stop_run(self._open.pop())


@pytest.fixture
def torchperf(request: pytest.FixtureRequest) -> Iterator[TorchperfFixture]:
    """Watch your own training loop: ``with torchperf.watch() as run: ... with run.step(): ...``."""
    fixture = TorchperfFixture(request.node)
    try:
        yield fixture
    finally:
        fixture._close()
