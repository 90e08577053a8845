"""pytest glue of the adoption features: the baseline ratchet, GitHub annotations, failure traces.

The logic is pytest-free (:mod:`.baseline`, :mod:`.github`, :mod:`.trace`); this module
wires it into a session. :mod:`.plugin` calls :func:`add_options`, :func:`configure`,
:func:`judge` (at a watched run's verdict) and :func:`attach` (when a test's report is
made), and passes in what it knows about a test; nothing here imports the plugin.

- Every process (each xdist worker) loads the baseline and judges its own tests.
- Each test report carries its findings as plain data (``torchperf_findings``), so the
  xdist controller (or the only process) lists known, new and stale findings, writes the
  refreshed baseline once, and prints the GitHub annotations once.
- ``--torchperf-trace`` registers a ``pytest_runtest_call`` wrapper that runs innermost:
  it records the test body only, not torchperf's verdict or a ``max_overhead`` replay.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

import pytest

from ..constants import TRACE_STEPS
from ..text import plural

if TYPE_CHECKING:
    from ..report import Report
    from . import baseline, trace  # noqa: F401 - trace: named in a stash key's type (a string)

__all__ = ["ANNOTATIONS", "add_options", "add_ini", "configure", "judge", "attach"]

#: ``--torchperf-annotations`` values.
ANNOTATIONS = ("auto", "on", "off")

_BASELINE = pytest.StashKey["Optional[baseline.Baseline]"]()
_TRACE = pytest.StashKey["Optional[trace.StepTrace]"]()
_TRACE_DIR = pytest.StashKey[str]()


def add_options(group: Any, annotations_type: Callable[[str], str]) -> None:
    """The command-line options (their ini twins: :func:`add_ini`)."""
    group.addoption(
        "--torchperf-baseline",
        metavar="PATH",
        default=None,
        help="compare findings with this baseline file: known ones are reported and do not fail, new sites "
        "and higher rates do (ini: torchperf_baseline, relative to the ini file)",
    )
    group.addoption(
        "--torchperf-baseline-update",
        action="store_true",
        default=False,
        help="write the baseline file from this run (findings do not fail; entries of tests that did not run "
        "are kept, those of removed tests dropped)",
    )
    group.addoption(
        "--torchperf-annotations",
        metavar="WHEN",
        type=annotations_type,
        default=None,
        help="print GitHub workflow commands (::error/::warning) at the line of each finding: 'auto' (when "
        "GITHUB_ACTIONS=true), 'on' or 'off' (ini: torchperf_annotations; default auto)",
    )
    group.addoption(
        "--torchperf-trace",
        metavar="DIR",
        default=None,
        help=f"write a torch.profiler Chrome trace of the first {TRACE_STEPS} optimizer steps of each test failing "
        "on a finding, findings marked, into DIR (ini: torchperf_trace)",
    )


def add_ini(parser: pytest.Parser) -> None:
    parser.addini(
        "torchperf_baseline", "the torchperf baseline file (relative to the ini file)", type="string", default=""
    )
    parser.addini("torchperf_annotations", "GitHub annotations: auto, on or off", type="string", default="")
    parser.addini(
        "torchperf_trace", "write Chrome traces of tests failing on a finding here", type="string", default=""
    )


def judge(config: pytest.Config, nodeid: str, report: Report) -> Optional[baseline.Comparison]:
    """The test's findings against the baseline; None when the session has no baseline."""
    known = config.stash.get(_BASELINE, None)
    return known.judge(nodeid, report) if known is not None else None



def configure(config: pytest.Config, settings: Any, is_watched: Callable[[pytest.Item], bool]) -> None:
    """Load the baseline and register what the options ask for.

    ``settings`` has ``baseline_path``, ``baseline_update``, ``annotations``, ``trace_dir`` and
    ``report_only`` (the plugin's resolved session settings).
    """
    known = None
    if settings.baseline_path:
        from . import baseline

        try:
            known = baseline.Baseline.load(settings.baseline_path, missing_ok=settings.baseline_update)
        except baseline.BaselineError as exc:
            raise pytest.UsageError(f"pytest-torchperf: {exc}") from None
    config.stash[_BASELINE] = known
    config.stash[_TRACE_DIR] = settings.trace_dir or ""
    if settings.trace_dir:
        config.pluginmanager.register(_Tracer(is_watched), "torchperf-trace")
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        if known is not None:
            config.pluginmanager.register(_WorkerCollection(config), "torchperf-collection")
        return
    adoption = _Adoption(config, settings, known)
    config.pluginmanager.register(adoption, "torchperf-adoption")
    if known is not None and config.pluginmanager.hasplugin("xdist") and config.getoption("dist", "no") != "no":
        config.pluginmanager.register(_XdistCollection(adoption), "torchperf-xdist-collection")


def attach(item: pytest.Item, report: pytest.TestReport, exc: Optional[BaseException], runs: Sequence[Report]) -> None:
    """On a test's call report: its findings as plain data, and its trace when findings failed it.

    ``runs`` are the reports of the test's finished watched runs; ``exc`` what the call raised.
    """
    from . import baseline
    observations = [obs for run in runs for obs in baseline.observe(run)]
    _attach_findings(report, exc, runs, observations)
    _attach_trace(item, report, exc, observations)


def _attach_findings(
    report: pytest.TestReport, exc: Optional[BaseException], runs: Sequence[Report], observations: list[Any]
) -> None:
    """What the controller needs for the baseline and annotations, as plain data on the report."""
    from .. import report as _report
    if not observations:
        return
    report.torchperf_findings = [obs.to_dict() for obs in observations]  # type: ignore[attr-defined]
    report.torchperf_failed_on_findings = isinstance(exc, _report.InvariantViolation)  # type: ignore[attr-defined]
    if report.passed:  # known, report-only or baseline update: the report stays at hand (-rP, JUnit)
        text = "\n\n".join(run.render() for run in runs if not run.passed)
        report.sections.append(("torchperf: broken invariants that did not fail the test", text))


def _attach_trace(
    item: pytest.Item, report: pytest.TestReport, exc: Optional[BaseException], observations: list[Any]
) -> None:
    from .. import report as _report
    from . import trace
    recorder = item.stash.get(_TRACE, None)
    if recorder is None:
        return
    item.stash[_TRACE] = None
    if not (isinstance(exc, _report.InvariantViolation) and report.failed):
        recorder.discard()
        return
    directory = item.config.stash[_TRACE_DIR]
    path = recorder.save(directory, item.nodeid, observations)
    if path is not None:
        steps = min(recorder.recorded_steps, trace.STEPS)
        span = f"the test body through optimizer step {steps}" if steps else "the whole test body (no optimizer step)"
        note = (
            f"torchperf trace: {path} (torch.profiler, {span}; findings marked as torchperf user annotations; "
            "open in Perfetto or TensorBoard)"
        )
    else:
        note = f"torchperf trace: not written: {recorder.error}"
    report.torchperf_trace = path  # type: ignore[attr-defined]
    notes = getattr(report.longrepr, "notes", None)  # the plugin's failure report has a list of notes
    if isinstance(notes, list):
        notes.append(note)


class _Tracer:
    """Registered with ``--torchperf-trace``: records each watched test body's first optimizer steps."""

    def __init__(self, is_watched: Callable[[pytest.Item], bool]) -> None:
        self.is_watched = is_watched

    @pytest.hookimpl(wrapper=True, trylast=True)  # innermost: the body only, not the verdict or a replay
    def pytest_runtest_call(self, item: pytest.Item) -> Generator[None, Any, Any]:
        if not self.is_watched(item):
            return (yield)
        from . import trace

        recorder = item.stash[_TRACE] = trace.StepTrace()
        recorder.start()
        try:
            return (yield)
        finally:
            recorder.stop()


class _WorkerCollection:
    """On an xdist worker: hands the controller the test ids it collected, for the baseline's stale entries."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    @pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect drop any
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.config.workeroutput["torchperf_collected"] = [i.nodeid for i in items]  # type: ignore[attr-defined]


class _XdistCollection:
    def __init__(self, adoption: _Adoption) -> None:
        self.adoption = adoption

    def pytest_testnodedown(self, node: Any, error: Any) -> None:
        collected = getattr(node, "workeroutput", {}).get("torchperf_collected")
        if collected and self.adoption.session is not None:
            self.adoption.session.collected.update(collected)


class _Adoption:
    """On the xdist controller (or the only process): known / new / stale findings, the baseline update, annotations."""

    def __init__(self, config: pytest.Config, settings: Any, known: Optional[baseline.Baseline]) -> None:
        from . import github

        self.config = config
        self.settings = settings
        self.session: Optional[baseline.Session] = None
        if known is not None:
            from . import baseline

            self.session = baseline.Session(known)
        self.annotate = github.enabled(settings.annotations)
        #: (test id, its observations, whether findings failed it, the test's own (file, line)).
        self.tests: list[tuple[str, list[baseline.Observation], bool, tuple[str, int]]] = []
        self.stale: list[baseline.Stale] = []
        self.written: Optional[str] = None
        if self.session is not None:
            self.session.narrowed_files = self._narrowed_files()

    def _narrowed_files(self) -> set[str]:
        """Files the command line named with ``::`` selectors: their other tests were not collected."""
        files = set()
        for arg in self.config.args:
            if "::" in arg:
                path = os.path.join(str(self.config.invocation_params.dir), arg.split("::", 1)[0])
                files.add(os.path.relpath(path, str(self.config.rootpath)).replace(os.sep, "/"))
        return files

    def _exists(self, path: str) -> bool:
        return os.path.exists(os.path.join(str(self.config.rootpath), path))

    @pytest.hookimpl(tryfirst=True)  # before -k, -m and --deselect drop any
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        if self.session is not None:
            self.session.collected.update(i.nodeid for i in items)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":
            return
        data = getattr(report, "torchperf_findings", None) or []
        observations = _observations(data)
        on_findings = bool(getattr(report, "torchperf_failed_on_findings", False)) and report.failed
        if self.session is not None and (report.passed or on_findings):
            self.session.record(report.nodeid, observations)
        if observations:
            path, lineno, _ = report.location
            fallback = (os.path.join(str(self.config.rootpath), path), (lineno or 0) + 1)
            self.tests.append((report.nodeid, observations, on_findings, fallback))

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.session is None:
            return
        self.stale = self.session.stale(self._exists)
        if self.settings.baseline_update and self.settings.baseline_path:
            refreshed = self.session.refreshed(self._exists)
            refreshed.write(self.settings.baseline_path)
            self.written = self.settings.baseline_path

    def _levels(self) -> list[tuple[str, baseline.Observation, str, str, tuple[str, int]]]:
        """Each finding with its verdict: (test, observation, error|warning, note, fallback location)."""
        from . import baseline, github
        out = []
        for nodeid, observations, on_findings, fallback in self.tests:
            entries = self.session.baseline.entries(nodeid) if self.session is not None else []
            statuses = {id(m.observation): m.status for m in baseline.compare(observations, entries).matches}
            for obs in observations:
                status = statuses[id(obs)] if self.session is not None else "new"
                if status == "known":
                    level, note = github.WARNING, "known in the baseline"
                elif on_findings:
                    level, note = github.ERROR, ""
                elif self.settings.baseline_update:
                    level, note = github.WARNING, "accepted into the baseline"
                else:
                    level, note = github.WARNING, "report only"
                out.append((nodeid, obs, level, note, fallback))
        return out

    @pytest.hookimpl(trylast=True)  # after the torchperf summary
    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from . import github
        tr = terminalreporter
        if self.session is not None:
            self._baseline_summary(tr)
        if self.annotate:
            found = [(n, o, level, note, fb) for n, o, level, note, fb in self._levels()]
            workspace = os.environ.get("GITHUB_WORKSPACE") or None
            for annotation in github.annotations(  # type: ignore[operator]  # (mypy sees __future__.annotations)
                found, rootdir=str(self.config.rootpath), workspace=workspace
            ):
                tr.write_line(annotation.text())

    def _baseline_summary(self, tr: Any) -> None:
        from . import baseline
        assert self.session is not None
        verbose = (self.config.getoption("verbose", 0) or 0) > 0
        comparisons = self.session.comparisons()
        failing = [(n, m) for n, c in comparisons.items() for m in c.failing]
        known = [(n, m) for n, c in comparisons.items() for m in c.known]
        tr.write_sep("-", "torchperf baseline")
        head = f"torchperf baseline {self.settings.baseline_path}: {len(known)} known finding"
        head += "s" if len(known) != 1 else ""
        if self.settings.baseline_update:
            head += f", {len(failing)} new or higher (accepted), {len(self.stale)} stale (dropped)"
        else:
            head += f", {len(failing)} new or higher, {len(self.stale)} stale"
        tr.write_line(head)
        for nodeid, match in failing:
            tr.write_line(f"  {nodeid}: {match.describe()}", red=not self.settings.baseline_update)
        for nodeid, match in known:
            if verbose or match.lower:  # a count that shrank: the update lowers it
                tr.write_line(f"  {nodeid}: {match.describe()}")
        for stale in self.stale:
            tr.write_line(f"  {stale.describe()}", yellow=True)
        if self.written:
            tests = self.session.refreshed(self._exists).tests
            entries = sum(len(baseline.merge_observations(e)) for e in tests.values())
            counts = f"{plural(entries, 'entry', 'entries')} in {plural(len(tests), 'test')}"
            tr.write_line(f"torchperf baseline: wrote {self.written} ({counts})")
        elif self.stale:
            tr.write_line("torchperf baseline: refresh it with --torchperf-baseline-update to drop the stale entries")


def _observations(data: list[dict[str, Any]]) -> list[baseline.Observation]:
    """A report's findings as observations (the baseline module loads only when there are some)."""
    if not data:
        return []
    from . import baseline

    return [baseline.Observation.from_dict(d) for d in data]
