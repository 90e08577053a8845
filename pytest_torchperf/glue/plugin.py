"""pytest glue: the ``torchperf`` marker and fixture, options, failure reports, summary, JSON.

The checking itself lives in :mod:`pytest_torchperf.watching` and is plain Python;
this module decides when to watch, turns a broken invariant into a failed
test report, and records every watched test's verdicts for the terminal
summary, JUnit properties and the JSON report (on the xdist controller, from
the reports its workers send). An unmarked test that does not request the
fixture costs one marker lookup. The options and their precedence are in
:mod:`pytest_torchperf.glue.settings`; the baseline, annotations and traces in
:mod:`pytest_torchperf.glue.adoption`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import pytest

from .. import _rejoin_modules
from ..constants import OVERHEAD_ROUNDS
from ..errors import UsageError
from . import adoption, ci, project, unchecked
from .settings import Settings, Threads, add_options, apply_threads, resolve_settings, session_defaults

if TYPE_CHECKING:
    from ..core import Run
    from ..options import Options
    from ..report import Report
    from ..timing import ParityResult
    from . import baseline

MARKER = "torchperf"
#: Environment variable naming the file lock that serialises timed sections across xdist workers.
TIMING_LOCK_ENV = "PYTEST_TORCHPERF_TIMING_LOCK"

_OPTIONS = pytest.StashKey["Optional[Options]"]()
_RUNS = pytest.StashKey["list[tuple[str, Any]]"]()  # (source, a Run or a _Comparison)
_SETTINGS = pytest.StashKey["Settings"]()
_SKIPPED = pytest.StashKey[bool]()  # the test was skipped for an inconclusive verdict
_PROJECT = pytest.StashKey[bool]()  # the project's packages are known to the frame classifier
_THREADS = pytest.StashKey[Optional[int]]()  # the torch thread count of watched tests (None: left alone)
_APPLIED = pytest.StashKey[Threads]()  # the thread setting applied around this watched test


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)
    unchecked.add_options(parser)


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
    _rejoin_modules()  # after an earlier in-process session in this process (pytester)
    config.addinivalue_line("markers", _marker_help(config))
    settings = config.stash[_SETTINGS] = resolve_settings(config)
    config.stash[_PROJECT] = False  # read when the first test is watched (see _know_the_project)
    unchecked.resolve(config)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        lock = workerinput.get("torchperf_timing_lock")
        if lock and TIMING_LOCK_ENV not in os.environ:
            os.environ[TIMING_LOCK_ENV] = lock
    elif config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no":
        controller = _XdistController()
        config.pluginmanager.register(controller, "torchperf-xdist")
        config.add_cleanup(controller.close)
    config.stash[_THREADS] = apply_threads(config, settings)
    adoption.configure(config, settings, _is_watched)
    config.pluginmanager.register(_Recorder(config, settings), "torchperf-recorder")
    config.pluginmanager.register(ci.CiOutput(config, settings), "torchperf-ci")


def _marker_help(config: pytest.Config) -> str:
    """The marker's line: with every invariant's signature for ``pytest --markers``, else a short one.

    Building the signature loads every invariant (other packages' too: a broken one is named here), so
    only ``--markers`` pays for it; any other session loads them when its first test is watched.
    """
    signature = "**invariants"
    if getattr(config.option, "markers", False):
        from ..options import describe_options

        try:
            signature = describe_options()
        except UsageError as exc:
            raise pytest.UsageError(str(exc)) from None
    return (
        f"{MARKER}({signature}): watch the test body and fail the test when a "
        "PyTorch/Lightning performance invariant breaks (see the pytest-torchperf README)."
    )


def _judged_elsewhere() -> bool:
    """A rank process re-running the session (see :func:`pytest_torchperf.ranks.child.judged_elsewhere`)."""
    from ..ranks.child import judged_elsewhere

    return judged_elsewhere()


def _know_the_project(config: pytest.Config) -> None:
    """Before the first watch: the display root, and which installed packages are the user's.

    Deferred from configure (reading the project's metadata costs every session that never watches);
    restored when the session ends.
    """
    from .. import stacks
    if config.stash.get(_PROJECT, True):
        return
    config.stash[_PROJECT] = True
    stacks.set_display_root(str(config.rootpath))
    settings = config.stash[_SETTINGS]
    full_stacks = stacks.show_full_stacks(settings.full_stacks)
    named_by = "--torchperf-user-packages" if config.getoption("torchperf_user_packages") else "torchperf_user_packages"
    packages = project.user_packages(str(config.rootpath), settings.user_packages, named_by)
    previous = stacks.classify.set_user_packages(packages)

    def restore() -> None:
        stacks.classify.set_user_packages(previous)
        stacks.show_full_stacks(full_stacks)

    config.add_cleanup(restore)


# -- watching a test ------------------------------------------------------------------------


def _session_defaults(config: pytest.Config) -> dict[str, Any]:
    return session_defaults(config.stash[_SETTINGS])


def _marker_options(item: pytest.Item) -> Optional[Options]:
    marks = list(item.iter_markers(MARKER))
    if not marks:
        return None
    from .. import options as _options  # a marked test's: an unmarked session never loads the registry
    merged: dict[str, Any] = _session_defaults(item.config)
    # iter_markers yields the closest marker first: apply farthest first so closer ones win.
    for mark in reversed(marks):
        _options.parse_options(mark.kwargs, args=mark.args, where=f"@pytest.mark.{MARKER}")
        merged.update(mark.kwargs)
    return _options.parse_options(merged, where=f"@pytest.mark.{MARKER}")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash[_RUNS] = []
    item.stash[_OPTIONS] = None
    try:
        options = _marker_options(item)
    except UsageError as exc:  # a wrong argument, or a plug-in that fails to load (named)
        error = str(exc)
    else:
        item.stash[_OPTIONS] = options
        _apply_threads(item)
        return
    prefix = "" if error.startswith("pytest-torchperf: ") else "pytest-torchperf: "
    pytest.fail(f"{prefix}{error}", pytrace=False)


def _apply_threads(item: pytest.Item) -> None:
    """The thread setting, around watched tests only (restored in teardown): unmarked ones see the default."""
    threads = item.config.stash.get(_THREADS, None)
    if threads is None or not _is_watched(item) or not _torch_installed():
        return
    applied = item.stash[_APPLIED] = Threads(threads)
    applied.apply()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, Any]:
    try:
        return (yield)
    finally:
        applied = item.stash.get(_APPLIED, None)
        if applied is not None:
            applied.restore()


def _is_watched(item: pytest.Item) -> bool:
    """The test carries the marker or asks for the fixture."""
    return item.stash.get(_OPTIONS, None) is not None or MARKER in getattr(item, "fixturenames", ())


def _verdict(item: pytest.Item, report: Optional[Report]) -> None:
    """Fail the test on a broken invariant, unless the session only reports or the baseline knows it;
    skip it or warn for an inconclusive one, as ``overhead_inconclusive`` says."""
    from .. import report as _report
    from . import baseline
    assert report is not None
    if _judged_elsewhere():
        return  # a rank process re-running the session: its launcher judges
    settings = item.config.stash[_SETTINGS]
    fail = not (settings.report_only or settings.baseline_update)
    # A baseline holds findings, never a verdict that could not be reached: an inconclusive check that
    # fails the run fails it with a baseline too (and while one is written).
    unsure = not settings.report_only and any(c.inconclusive for c in report.failures)
    if fail and not report.passed:
        comparison = adoption.judge(item.config, item.nodeid, report)
        if comparison is not None:
            if comparison.failing:
                comparison.rank_findings(report)  # what changed first, not the most frequent
                raise baseline.KnownFindingsViolation(report, comparison)
            fail = False  # every finding is one the baseline knows
    try:
        _report.settle(report, fail=fail or unsure)
    except _report.Inconclusive as exc:
        item.stash[_SKIPPED] = True
        pytest.skip(str(exc))


@functools.cache
def _torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def _require_torch(config: pytest.Config) -> None:
    """Watching needs torch: without it, a clear failure rather than an ImportError from deep inside."""
    if not _torch_installed():
        pytest.fail("pytest-torchperf: watching a test needs torch, which is not installed", pytrace=False)
    _know_the_project(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    options = item.stash.get(_OPTIONS, None)
    if options is None:
        return (yield)
    from .. import watching as _watch
    _require_torch(item.config)
    with _watch.watching(options) as run:
        item.stash[_RUNS].append(("marker", run))
        result = yield
    assert run.report is not None
    _verdict(item, run.report)
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

    def __init__(
        self, report: Report, item: pytest.Item, verbose: bool, comparison: Optional[baseline.Comparison] = None
    ) -> None:
        self.report = report
        self.verbose = verbose
        self.comparison = comparison
        #: Lines shown after the report (the trace's path).
        self.notes: list[str] = []
        path, lineno, _ = item.location
        message = comparison.summary_line() if comparison is not None else report.summary_line()
        self.reprcrash = _Crash(path, (lineno or 0) + 1, message)

    def _blocks(self) -> list[Any]:
        from .. import report as _report
        blocks = self.report.blocks(self.verbose)
        if self.comparison is not None:
            lines = [self.comparison.summary_line()]
            baseline_block = _report.Block("torchperf: baseline", self.comparison.lines())
            blocks = [_report.Block(None, lines), baseline_block] + blocks
        if self.notes:
            blocks.append(_report.Block(None, list(self.notes)))
        return blocks

    def toterminal(self, tw: Any) -> None:
        for block in self._blocks():
            if block.title is not None:
                tw.sep("-", block.title, red=True)
            for line in block.lines:
                tw.line(line)

    def __str__(self) -> str:
        text = self.report.render(self.verbose)
        if self.comparison is not None:
            text = "\n".join([self.comparison.summary_line(), *self.comparison.lines(), text])
        return "\n".join([text, *self.notes])


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
        from . import results
        properties = results.junit_properties(results.merge_checks(runs))
        item.user_properties.extend(properties)  # JUnit XML writes the teardown report's properties
    exc = call.excinfo.value if call.excinfo is not None else None
    if report.skipped and item.stash.get(_SKIPPED, False) and isinstance(report.longrepr, tuple):
        path, lineno = item.reportinfo()[:2]  # the skip is the test's, not this plugin's line
        report.longrepr = (os.fspath(path), (lineno or 0) + 1, report.longrepr[2])
    if report.failed:
        from ..report import InvariantViolation

        if isinstance(exc, InvariantViolation):
            verbose = (item.config.getoption("verbose", 0) or 0) > 0
            report.longrepr = TorchperfFailure(exc.report, item, verbose, getattr(exc, "comparison", None))
    finished = [run.report for _, run in item.stash.get(_RUNS, []) if run.report is not None]
    if report.passed and finished and not _judged_elsewhere():
        # Judged on the outcome: a unittest.TestCase test that unittest recorded as skipped or failed returned
        # from its call normally, and only its report says so.
        settings = item.config.stash[_SETTINGS]
        failure = unchecked.act(item, finished, report_only=settings.report_only or settings.baseline_update)
        if failure is not None:
            report.outcome = "failed"
            report.longrepr = failure
    if finished or _is_watched(item):
        adoption.attach(item, report, exc, finished)
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
            from . import results

            report_only = bool(getattr(report, "torchperf_report_only", False))
            self.tests.append(results.test_entry(report.nodeid, report.outcome, report.duration, runs, report_only))

    @property
    def _is_worker(self) -> bool:
        return getattr(self.config, "workerinput", None) is not None

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self._is_worker or not self.settings.json_path or _judged_elsewhere():
            return  # a rank process re-running the session (Lightning's ddp) leaves the JSON to its launcher
        from . import results

        env: dict[str, Any] = results.environment(results.device_info())
        env["xdist_workers"] = getattr(self.config.option, "numprocesses", None) or 0
        env["report_only"] = self.settings.report_only
        results.write(self.settings.json_path, results.document(self.tests, env))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self._is_worker or not self.tests:
            return
        from . import summary

        tr = terminalreporter
        rank = os.environ.get("LOCAL_RANK", "?") if _judged_elsewhere() else None
        title = "torchperf summary"
        if rank is not None:
            title = f"torchperf summary of rank process {rank} (reported to its launcher, which judges)"
        tr.write_sep("=", title)
        verbose = (self.config.getoption("verbose", 0) or 0) > 0
        detail = verbose or "A" in (self.config.getoption("reportchars", "") or "")
        for line in summary.session_lines(self.tests, detail=detail):
            tr.write_line(line.text, **line.markup)
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
        from .. import options as _options
        from .. import watching as _watch
        _options.parse_options(kwargs, where="torchperf.watch()")  # the caller's own mistakes, named as theirs
        defaults = _session_defaults(self._item.config)
        options = _options.parse_options({**defaults, **kwargs}, where="torchperf.watch()")
        _require_torch(self._item.config)
        with _watch.watching(options) as run:
            self._open.append(run)
            self._item.stash.setdefault(_RUNS, []).append(("fixture", run))
            try:
                yield run
            finally:
                self._open.remove(run)
        assert run.report is not None
        _verdict(self._item, run.report)

    def parity(
        self,
        candidate: Callable[[], Any],
        baseline: Callable[[], Any],
        *,
        max_overhead: Optional[float] = None,
        rounds: int = OVERHEAD_ROUNDS,
        warmup: int = 1,
        names: tuple[str, str] = ("candidate", "baseline"),
        inconclusive: Optional[str] = None,
    ) -> ParityResult:
        """Time two callables that each run one epoch; fail when ``candidate`` exceeds ``max_overhead``.

        The statistics are those of the ``max_overhead`` invariant (interleaved
        rounds, warm-up dropped, paired ratios with a 95% interval, three
        verdicts; see :func:`pytest_torchperf.parity`). The comparison is
        recorded for the summary and the JSON report. A failed verdict fails
        the test with the same report as the marker (unless the session runs
        with ``--torchperf-report-only``); an inconclusive one does what
        ``inconclusive`` says ("fail", "skip" or "warn"; default: the session's
        ``--torchperf-overhead-inconclusive``, else "fail").
        """
        from .. import timing as _timing

        if inconclusive is None:
            inconclusive = self._item.config.stash[_SETTINGS].overhead_inconclusive or "fail"
        result = _timing.parity(
            candidate,
            baseline,
            max_overhead=max_overhead,
            rounds=rounds,
            warmup=warmup,
            names=names,
            check=False,
            inconclusive=inconclusive,
        )
        report = result.report()
        options = {
            "max_overhead": max_overhead,
            "rounds": rounds,
            "warmup": warmup,
            "names": list(names),
            "inconclusive": inconclusive,
        }
        self._item.stash.setdefault(_RUNS, []).append(("parity", _Comparison(report, options)))
        _verdict(self._item, report)
        return result

    def __repr__(self) -> str:
        return f"<torchperf fixture: {len(self._open)} watch(es) open>"

    def _close(self) -> None:
        """Stop runs the test left open (a watch entered by hand and never exited)."""
        from .. import watching as _watch
        while self._open:
            _watch.stop(self._open.pop())


@pytest.fixture
def torchperf(request: pytest.FixtureRequest) -> Iterator[TorchperfFixture]:
    """Watch your own training loop: ``with torchperf.watch() as run: ... with run.step(): ...``."""
    fixture = TorchperfFixture(request.node)
    try:
        yield fixture
    finally:
        fixture._close()
