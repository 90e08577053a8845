"""What people look at in CI: the header line, the progress letter, the GitHub Actions job summary.

- ``pytest_report_header``: one line, ``torchperf 0.1.0: 15 invariants (+1 from acme-torchperf);
  baseline torchperf-baseline.json``, counted from the registry's built-in names and the
  entry points' names without loading any invariant module.
- ``pytest_report_teststatus``: a test failed by torchperf (a broken invariant, or a finding not in the
  baseline) shows as ``T`` in the progress line; it still counts as failed and reads ``FAILED`` under ``-v``
  and in the short summary, so what people grep for stays the same.
- On GitHub Actions (``GITHUB_STEP_SUMMARY`` set, annotations on: ``--torchperf-annotations`` ``auto``
  with ``GITHUB_ACTIONS=true``, or ``on``), a Markdown job summary: every watched test's verdicts and the
  worst findings, each linking the line its annotation is on. Written once, by the xdist controller (or
  the only process), never by a rank process.

The rendering functions are pytest-free; :class:`CiOutput` is the pytest glue (registered by the plugin).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any, Optional

import pytest

from .._version import __version__
from ..constants import BUILTIN_INVARIANTS, INVARIANTS_ENTRY_POINT_GROUP

if TYPE_CHECKING:
    from . import github

__all__ = ["CiOutput", "entry_point_names", "header_line", "step_summary", "STATUS_LETTER"]

#: The progress-line letter of a test failed by torchperf (its word stays pytest's own ``FAILED``).
STATUS_LETTER = "T"
#: At most this many findings in the job summary's "worst findings" list.
WORST = 10

#: The statuses as the JSON and the recorded checks spell them (:class:`pytest_torchperf.status.Status` values).
FAILED, INCONCLUSIVE, NOT_CHECKED, PASSED = "failed", "inconclusive", "not checked", "passed"
_ICONS = {FAILED: "❌", INCONCLUSIVE: "⚠️", PASSED: "✅", NOT_CHECKED: "➖"}


def entry_point_names() -> list[tuple[str, str]]:
    """``(entry point name, distribution name)`` of the invariants other packages declare; nothing is loaded."""
    from importlib import metadata

    try:
        selected: Any = metadata.entry_points(group=INVARIANTS_ENTRY_POINT_GROUP)
    except TypeError:  # Python 3.9: a dict of groups
        groups: Any = metadata.entry_points()
        selected = groups.get(INVARIANTS_ENTRY_POINT_GROUP, [])
    out = []
    for ep in selected:
        dist = getattr(getattr(ep, "dist", None), "name", None) or "an entry point"
        out.append((ep.name, dist))
    return sorted(set(out))


def header_line(
    entry_points: Iterable[tuple[str, str]],
    registered: int = 0,
    baseline_path: Optional[str] = None,
    baseline_update: bool = False,
    report_only: bool = False,
) -> str:
    """``torchperf 0.1.0: 15 invariants (+1 from acme-torchperf); baseline torchperf-baseline.json``."""
    by_dist: dict[str, int] = {}
    for _, dist in entry_points:
        by_dist[dist] = by_dist.get(dist, 0) + 1
    extra = [f"+{n} from {dist}" for dist, n in sorted(by_dist.items())]
    if registered:
        extra.append(f"+{registered} registered in conftest")
    builtin = len(BUILTIN_INVARIANTS)
    line = f"torchperf {__version__}: {builtin} invariant{'s' if builtin != 1 else ''}"
    if extra:
        line += f" ({', '.join(extra)})"
    if baseline_path:
        line += f"; baseline {baseline_path}" + (" (updating it)" if baseline_update else "")
    if report_only:
        line += "; report only"
    return line


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _link(annotation: github.Annotation, environ: dict[str, str]) -> str:
    """``[file:line](https://github.com/owner/repo/blob/sha/file#Lline)`` when the run's commit is known."""
    where = f"{annotation.file}:{annotation.line}"
    server = environ.get("GITHUB_SERVER_URL", "https://github.com")
    repo, sha = environ.get("GITHUB_REPOSITORY"), environ.get("GITHUB_SHA")
    if not repo or not sha:
        return f"`{where}`"
    return f"[`{where}`]({server}/{repo}/blob/{sha}/{annotation.file}#L{annotation.line})"


def _verdicts(checks: dict[str, dict[str, Any]]) -> str:
    parts = []
    for name, check in checks.items():
        status = check["status"]
        text = f"{_ICONS.get(status, '')} `{name}`"
        if status in (FAILED, INCONCLUSIVE):
            text += f" **{status}**: {_cell(check['summary'])}"
        elif status == NOT_CHECKED:
            text += " not checked"
        parts.append(text)
    return "<br>".join(parts)


def step_summary(
    tests: list[dict[str, Any]], annotations: list[github.Annotation], environ: Optional[dict[str, str]] = None
) -> str:
    """The job summary's Markdown: a headline, the worst findings with links, each watched test's verdicts."""
    from . import github
    env = dict(os.environ) if environ is None else environ
    broken: dict[str, int] = {}
    for test in tests:
        for name, check in test["checks"].items():
            if check["status"] == FAILED:
                broken[name] = broken.get(name, 0) + 1
    failed = sum(1 for t in tests if t["outcome"] == "failed")
    head = f"### torchperf: {len(tests)} watched test{'s' if len(tests) != 1 else ''}, {failed} failed"
    if broken:
        head += "; broken invariants: " + ", ".join(f"`{name}` in {n}" for name, n in broken.items())
    lines = [head, ""]
    worst = sorted(annotations, key=lambda a: (a.level != github.ERROR, -len(a.tests), a.file, a.line))[:WORST]
    if worst:
        lines += ["#### Worst findings", ""]
        for a in worst:
            level = "error" if a.level == github.ERROR else "warning"
            tests_text = a.tests[0] if len(a.tests) == 1 else f"{a.tests[0]} and {len(a.tests) - 1} more"
            lines.append(f"- **{a.invariant}** ({level}) at {_link(a, env)}: {_cell(a.message)} (`{tests_text}`)")
        if len(annotations) > WORST:
            lines.append(f"- ... {len(annotations) - WORST} more (see the annotations)")
        lines.append("")
    lines += ["| test | outcome | verdicts |", "|---|---|---|"]
    for test in tests:
        note = " (report only)" if test.get("report_only") else ""
        lines.append(f"| `{_cell(test['nodeid'])}` | {test['outcome']}{note} | {_verdicts(test['checks'])} |")
    return "\n".join(lines) + "\n"


class CiOutput:
    """Registered by the plugin in every process: header, status letter, and (controller) the job summary."""

    def __init__(self, config: pytest.Config, settings: Any) -> None:
        self.config = config
        self.settings = settings

    def pytest_report_header(self, config: pytest.Config) -> str:
        baseline = self.settings.baseline_path
        if baseline:
            try:
                baseline = os.path.relpath(baseline, str(config.invocation_params.dir))
            except ValueError:  # another drive (Windows)
                pass
        loaded = sys.modules.get("pytest_torchperf.registry")  # not loaded: nothing was register()ed
        extra = getattr(loaded, "_REGISTRY", None)
        registered = len(getattr(extra, "_extra", {}) or {})
        return header_line(
            entry_point_names(), registered, baseline, self.settings.baseline_update, self.settings.report_only
        )

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
        report = yield
        if call.when == "call" and report.failed:
            from ..report import InvariantViolation

            if call.excinfo is not None and isinstance(call.excinfo.value, InvariantViolation):
                report.torchperf_failed = True  # plain data: travels from xdist workers with the report
        return report

    def pytest_report_teststatus(
        self, report: pytest.TestReport, config: pytest.Config
    ) -> Optional[tuple[str, str, str]]:
        if report.when == "call" and report.failed and getattr(report, "torchperf_failed", False):
            # A plain word: pytest colours it by the category, and pytest 7.0 prints a (word, markup) tuple as is.
            return "failed", STATUS_LETTER, "FAILED"
        return None

    @pytest.hookimpl(trylast=True)  # after the recorder and the adoption plugin saw the session end
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        path = os.environ.get("GITHUB_STEP_SUMMARY")
        if not path or getattr(self.config, "workerinput", None) is not None:
            return
        from ..ranks.child import judged_elsewhere
        from . import github

        if judged_elsewhere():
            return
        if not github.enabled(self.settings.annotations):
            return
        recorder = self.config.pluginmanager.get_plugin("torchperf-recorder")
        tests = list(getattr(recorder, "tests", None) or [])
        if not tests:
            return
        adoption = self.config.pluginmanager.get_plugin("torchperf-adoption")
        found = adoption._levels() if adoption is not None else []
        workspace = os.environ.get("GITHUB_WORKSPACE") or None
        root = str(self.config.rootpath)
        notes = github.annotations(found, rootdir=root, workspace=workspace)  # type: ignore[operator]
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(step_summary(tests, notes) + "\n")
