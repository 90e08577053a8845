"""pytest glue: the ``torchperf`` marker and fixture, failure reports, the summary.

The checking itself lives in :mod:`pytest_torchperf.watch` and is plain Python;
this module only decides when to watch, turns a broken invariant into a failed
test report and prints the terminal summary. An unmarked test that does not
request the fixture costs one marker lookup.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Generator, Iterator, Optional

import pytest

from . import stacks
from .options import Options, UsageError, describe_options, parse_options
from .report import NOT_CHECKED, InvariantViolation, Report
from .watch import Run, _watching

MARKER = "torchperf"

_OPTIONS = pytest.StashKey[Optional[Options]]()
_RUNS = pytest.StashKey["list[Run]"]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}({describe_options()}): watch the test body and fail the test when a "
        "PyTorch/Lightning performance invariant breaks (see the pytest-torchperf README).",
    )
    config.pluginmanager.register(_Summary(), "torchperf-summary")
    stacks.set_display_root(str(config.rootpath))


def _marker_options(item: pytest.Item) -> Optional[Options]:
    marks = list(item.iter_markers(MARKER))
    if not marks:
        return None
    merged: dict[str, Any] = {}
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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
    options = item.stash.get(_OPTIONS, None)
    if options is None:
        return (yield)
    with _watching(options) as run:
        item.stash[_RUNS].append(run)
        result = yield
    if not run.report.passed:  # type: ignore[union-attr]
        raise InvariantViolation(run.report)  # type: ignore[arg-type]
    return result


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


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if call.when != "call":
        return report
    reports = [run.report for run in item.stash.get(_RUNS, []) if run.report is not None]
    if reports:
        # Plain data, so it travels from xdist workers to the controller with the report.
        report.torchperf = [
            {name: {"status": c.status, "summary": c.summary, "count": c.count} for name, c in r.checks.items()}
            for r in reports
        ]
    exc = call.excinfo.value if call.excinfo is not None else None
    if isinstance(exc, InvariantViolation) and report.failed:
        verbose = (item.config.getoption("verbose", 0) or 0) > 0
        report.longrepr = TorchperfFailure(exc.report, item, verbose)
    return report


class _Summary:
    """Collects the torchperf figures of every test report (on the xdist controller too)."""

    def __init__(self) -> None:
        self.entries: list[tuple[str, str, list[dict[str, Any]]]] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        runs = getattr(report, "torchperf", None)
        if report.when == "call" and runs:
            self.entries.append((report.nodeid, report.outcome, runs))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.entries:
            return
        tr = terminalreporter
        tr.write_sep("=", "torchperf summary")
        for nodeid, outcome, runs in self.entries:
            markup = {"red": True} if outcome == "failed" else {"green": True}
            tr.write_line(f"{outcome.upper():7} {nodeid}", **markup)
            for checks in runs:
                parts = []
                for name, check in checks.items():
                    if check["status"] == NOT_CHECKED:
                        parts.append(f"{name}: not checked")
                    else:
                        parts.append(f"{name}: {check['status']} ({check['summary']})")
                tr.write_line("        " + " | ".join(parts))


class TorchperfFixture:
    """The ``torchperf`` fixture: ``torchperf.watch(**options)`` around a user's own loop."""

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        self._open: list[Run] = []

    @contextlib.contextmanager
    def watch(self, **kwargs: Any) -> Iterator[Run]:
        """Watch the block like ``@pytest.mark.torchperf(**kwargs)`` watches a test body.

        Yields the :class:`~pytest_torchperf.Run`; mark each training step of a
        plain loop with ``with run.step():``. On a clean exit a broken invariant
        fails the test with the torchperf report; ``run.report`` holds the verdicts.
        """
        options = parse_options(kwargs, where="torchperf.watch()")
        with _watching(options) as run:
            self._open.append(run)
            self._item.stash.setdefault(_RUNS, []).append(run)
            try:
                yield run
            finally:
                self._open.remove(run)
        if not run.report.passed:  # type: ignore[union-attr]
            raise InvariantViolation(run.report)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"<torchperf fixture: {len(self._open)} watch(es) open>"

    def _close(self) -> None:
        """Stop runs the test left open (a watch entered by hand and never exited)."""
        while self._open:
            self._open.pop()._stop()


@pytest.fixture
def torchperf(request: pytest.FixtureRequest) -> Iterator[TorchperfFixture]:
    """Watch your own training loop: ``with torchperf.watch() as run: ... with run.step(): ...``."""
    fixture = TorchperfFixture(request.node)
    try:
        yield fixture
    finally:
        fixture._close()
