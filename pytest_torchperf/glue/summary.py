"""The "torchperf summary" at the end of a session: sized by what matters, not by the suite.

pytest-free: the plugin hands it the session's test entries (those of
:func:`pytest_torchperf.glue.results.test_entry`, on the xdist controller from the
reports its workers send) and writes the lines it returns.

At default verbosity (and ``-q``) it is a session-level block:

- the headline: how many tests were watched, the broken and inconclusive
  invariants with the number of tests each, the tests that trained but had a
  default invariant not checked;
- one line of the invariants that held, each with the number of tests that
  trained and kept it;
- "N marked tests ran no training (nothing to watch)": a configuration or
  tokenizer test under a suite-wide marker is counted here, never warned about;
- one line per test that failed, or would fail, on a finding (or whose rank
  process raised or sent nothing, with that process's line);
- one line per site of the frameworks' noted events (the same site over many
  tests is one line).

Clean tests add nothing. ``detail`` (``-v`` or ``-rA``) adds every test's
verdicts first, where an invariant that did not apply (a conditional one:
nothing compiled, no DDP) is left out rather than listed as not checked. The
JSON report always has every test's every verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..text import plural

if TYPE_CHECKING:
    pass

__all__ = ["Line", "nothing_to_watch", "session_lines", "MAX_NOTES"]

FAILED, INCONCLUSIVE, NOT_CHECKED, PASSED = "failed", "inconclusive", "not checked", "passed"
#: Without detail, at most this many framework-note sites (the JSON has them all).
MAX_NOTES = 5


@dataclass
class Line:
    """One line of the summary and its colour (``"red"``, ``"yellow"``, ``"green"`` or none)."""

    text: str
    colour: Optional[str] = None

    @property
    def markup(self) -> dict[str, bool]:
        return {self.colour: True} if self.colour else {}


def _statuses(test: dict[str, Any], status: str) -> list[str]:
    return [name for name, check in test["checks"].items() if check["status"] == status]


def trained(test: dict[str, Any]) -> bool:
    """A run of the test saw a training step, watched the whole test (``scope="test"``: the body is the step),
    or compared two loops with ``parity()``."""
    return any(
        run.get("steps") or run.get("source") == "parity" or run.get("options", {}).get("scope") == "test"
        for run in test["runs"]
    )


def nothing_to_watch(test: dict[str, Any]) -> bool:
    """A passing test that ran no training: no step seen, no finding, a default invariant left unchecked."""
    if test["outcome"] != PASSED or trained(test):
        return False
    if _statuses(test, FAILED) or _statuses(test, INCONCLUSIVE):
        return False
    return bool(_unchecked(test))


def _unchecked(test: dict[str, Any]) -> list[str]:
    from . import unchecked
    return sorted({name for run in test["runs"] for name in unchecked.summary_parts(run["checks"])})


def _counts(tests: list[dict[str, Any]], status: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for test in tests:
        for name in _statuses(test, status):
            counts[name] = counts.get(name, 0) + 1
    return counts


@dataclass
class _Note:
    check: str
    site: str
    function: str
    count: int = 0
    tests: set[str] = field(default_factory=set)


def _framework_notes(tests: list[dict[str, Any]]) -> list[_Note]:
    """Every noted event outside the user's code, one entry per (invariant, site) over the session."""
    notes: dict[tuple[str, str], _Note] = {}
    for test in tests:
        for run in test["runs"]:
            for name, check in run["checks"].items():
                for finding in check.get("findings", ()):
                    sites = finding.get("sites") or ()
                    if not str(finding.get("title", "")).startswith("note: ") or not sites:
                        continue
                    first = sites[0]
                    if first.get("user_code") or not first.get("site"):
                        continue
                    key = (name, first["site"])
                    note = notes.setdefault(key, _Note(name, first["site"], first.get("function") or "?"))
                    note.count += int(first.get("count") or 1)
                    note.tests.add(test["nodeid"])
    return sorted(notes.values(), key=lambda n: (-len(n.tests), -n.count, n.check, n.site))


def headline(tests: list[dict[str, Any]]) -> str:
    """``torchperf: 60 watched tests, broken invariants: no_host_sync in 2; 1 test with default invariants
    not checked`` (a skipped test is counted as such; tests that ran no training are not 'not checked')."""
    line = f"torchperf: {plural(len(tests), 'watched test')}"
    skipped = sum(1 for t in tests if t["outcome"] == "skipped")
    if skipped:
        line += f" ({skipped} skipped)"
    broken, unsure = _counts(tests, FAILED), _counts(tests, INCONCLUSIVE)
    if broken:
        line += ", broken invariants: " + ", ".join(f"{name} in {n}" for name, n in broken.items())
    else:
        line += ", no broken invariant"
    if unsure:
        line += "; inconclusive: " + ", ".join(f"{name} in {n}" for name, n in unsure.items())
    missing = sum(1 for t in tests if t["outcome"] == PASSED and trained(t) and _unchecked(t))
    if missing:
        line += f"; {plural(missing, 'test')} with default invariants not checked"
    return line


def _test_line(test: dict[str, Any], verdicts: bool) -> Line:
    """``FAILED  test_a.py::test_b: no_host_sync failed (3 syncs at ...)``; ``verdicts`` False: the test only."""
    failed, doubtful = _statuses(test, FAILED), _statuses(test, INCONCLUSIVE)
    note = " (report only: broken invariants did not fail it)" if failed and test["report_only"] else ""
    if nothing_to_watch(test):
        note += " (ran no training: nothing to watch)"
    elif not failed and test["outcome"] == PASSED:
        missing = _unchecked(test)
        if missing:
            note += f" (not checked: {', '.join(missing)})"
    text = f"{test['outcome'].upper():7} {test['nodeid']}{note}"
    if verdicts and (failed or doubtful):
        text += ": " + "; ".join(
            f"{name} {test['checks'][name]['status']} ({test['checks'][name]['summary']})" for name in failed + doubtful
        )
    if test["outcome"] == "failed" or failed:
        colour = "red"
    elif doubtful or test["outcome"] == "skipped" or "not checked" in note:
        colour = "yellow"
    else:
        colour = "green"
    return Line(text, colour)


def _shown(name: str, check: dict[str, Any]) -> bool:
    """A verdict worth a word in the detail: anything but a conditional invariant that did not apply."""
    from . import unchecked
    return check["status"] != NOT_CHECKED or unchecked.is_default(name)


def _detail(test: dict[str, Any]) -> list[Line]:
    """Every run's verdicts, one line each, and what went wrong in its processes."""
    lines = [_test_line(test, verdicts=False)]
    if nothing_to_watch(test) or (test["outcome"] == "skipped" and not trained(test)):
        return lines  # no verdict to read
    for run in test["runs"]:
        parts = [
            f"{name}: {check['status']} ({check['summary']})"
            for name, check in run["checks"].items()
            if _shown(name, check)
        ]
        found = f" (steps: {run['steps']}, {run['steps_found']})" if run.get("steps_found") else ""
        lines.append(Line(f"        {run['source']}{found}: " + " | ".join(parts)))
        lines.extend(_processes(run))
    return lines


def _processes(run: dict[str, Any]) -> list[Line]:
    """A rank that raised or sent nothing says so."""
    lines = []
    for process in run.get("ranks", ()):
        error, missing = process.get("error"), process.get("missing")
        if error:
            where = f" at {error['where']}" if error.get("where") else ""
            text = f"{process['process']} (pid {process['pid']}) raised {error['type']}: {error['message']}{where}"
            lines.append(Line(f"        {text}", "red"))
        elif missing:
            lines.append(Line(f"        {process['process']}: {missing}", "red"))
    return lines


def session_lines(tests: list[dict[str, Any]], *, detail: bool = False) -> list[Line]:
    """The summary's lines (without its title): every test's verdicts when ``detail``, then the session block."""
    lines: list[Line] = []
    if detail:
        for test in tests:
            lines.extend(_detail(test))
    lines.append(Line(headline(tests)))
    held = _counts([t for t in tests if t["outcome"] != "skipped" and trained(t)], PASSED)
    if held:
        lines.append(Line("torchperf: held: " + ", ".join(f"{name} in {n}" for name, n in held.items())))
    idle = sum(1 for t in tests if nothing_to_watch(t))
    if idle:
        lines.append(Line(f"torchperf: {plural(idle, 'marked test')} ran no training (nothing to watch)"))
    if not detail:
        for test in tests:
            processes = [line for run in test["runs"] for line in _processes(run)]
            if _statuses(test, FAILED) or _statuses(test, INCONCLUSIVE) or processes:
                lines.append(_test_line(test, verdicts=True))
                lines.extend(processes)
    notes = _framework_notes(tests)
    shown = notes if detail else notes[:MAX_NOTES]
    for note in shown:
        lines.append(Line(
            f"torchperf: noted in {plural(len(note.tests), 'test')}: {note.check} at {note.site} in {note.function} "
            f"({note.count}x), not your code"
        ))
    if len(shown) < len(notes):
        more = len(notes) - len(shown)
        lines.append(Line(f"torchperf: ... {more} more noted sites (-v or the JSON report shows them)"))
    return lines
