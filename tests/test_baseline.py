"""The baseline ratchet's rules, on hand-made reports: keys, matching, rates, stale entries, the file.

Torch-free: runs in the compatibility environments too (Python 3.9 and 3.13 without torch).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_torchperf import stacks
from pytest_torchperf.glue.baseline import (
    SCHEMA,
    Baseline,
    BaselineError,
    KnownFindingsViolation,
    Observation,
    Session,
    compare,
    merge_observations,
    normalise_source,
    observe,
)
from pytest_torchperf.report import FAILED, PASSED, CheckResult, Finding, InvariantViolation, Report, Site
from pytest_torchperf.stacks import Frame

MODEL = """\
def helper():
    pass


def training_step(batch):
    loss = batch.sum()
    if loss.item() > 100:  # a sync
        pass
    value = loss.item()
    value = loss.item()
    return loss
"""


@pytest.fixture
def model(tmp_path: Path) -> Path:
    stacks.set_display_root(str(tmp_path))
    path = tmp_path / "pkg" / "model.py"
    path.parent.mkdir()
    path.write_text(MODEL)
    return path


def _report(path: Path, sites: list[tuple[int, int]], steps: int = 8, invariant: str = "no_host_sync") -> Report:
    """A failed check with one finding per ``(line, count)`` at ``path``, called from a test function."""
    test = Frame(str(path.parent.parent / "test_it.py"), 3, "test_it")
    findings = [
        Finding(f"`.item()` in training_step: {count} over {steps} steps", [],
                [Site("`.item()`", (test, Frame(str(path), line, "training_step")), count)])
        for line, count in sites
    ]
    figures = {"steps": steps} if invariant == "no_host_sync" else {}
    check = CheckResult(invariant, FAILED, "syncs", sum(c for _, c in sites), findings, figures)
    return Report(checks={invariant: check}, steps=steps)


def test_source_is_matched_without_its_comment_and_extra_spaces() -> None:
    assert normalise_source("if loss.item() > 100:  # a sync") == "if loss.item() > 100:"
    assert normalise_source("x  =  f('#not a comment')   # but this is") == "x = f('#not a comment')"
    assert normalise_source("call(a,  # an open bracket") == "call(a,"
    assert normalise_source('text = """# an open string') == 'text = """# an open string'


def test_a_site_is_its_file_relative_to_rootdir_function_and_source_with_a_per_step_rate(model: Path) -> None:
    (obs,) = observe(_report(model, [(7, 8)], steps=8))
    assert (obs.invariant, obs.file, obs.function, obs.line) == ("no_host_sync", "pkg/model.py", "training_step", 7)
    assert obs.source == "if loss.item() > 100:  # a sync"
    assert obs.count == 8 and obs.per_step == 1.0
    assert obs.user_frame == (str(model), 7, "training_step")  # the finding's own frame is your code


def test_notes_and_passed_checks_are_not_findings(model: Path) -> None:
    report = _report(model, [(7, 8)])
    report.checks["no_host_sync"].findings.append(
        Finding("note: `.item()` in lightning", [], [Site("x", (Frame(str(model), 9, "training_step"),), 3)])
    )
    report.checks["on_device"] = CheckResult("on_device", PASSED, "fine")
    assert [o.line for o in observe(report)] == [7]


def test_a_failed_check_without_sites_is_keyed_by_its_invariant() -> None:
    check = CheckResult("max_overhead", FAILED, "+40% over the plain loop", 1, [Finding("slower", [], [])])
    (obs,) = observe(Report(checks={"max_overhead": check}))
    assert (obs.invariant, obs.file, obs.count, obs.per_step) == ("max_overhead", "", 1, None)
    assert compare([obs], [Observation("max_overhead", count=1)]).matches[0].status == "known"


def test_a_moved_line_is_still_known(model: Path) -> None:
    baseline = observe(_report(model, [(7, 8)]))
    baseline[0].line = 40  # the line moved: unrelated lines were added above it
    comparison = compare(observe(_report(model, [(7, 8)])), baseline)
    assert [m.status for m in comparison.matches] == ["known"] and not comparison.stale
    assert "was line 40" in comparison.matches[0].describe()


def test_a_higher_rate_fails_a_lower_or_equal_one_is_known(model: Path) -> None:
    baseline = observe(_report(model, [(7, 8)], steps=8))  # 1 per step
    higher = compare(observe(_report(model, [(7, 16)], steps=8)), baseline)
    assert [m.status for m in higher.matches] == ["higher"]
    assert "no_host_sync at pkg/model.py:7 in training_step (2 per step, baseline 1 per step)" in higher.summary_line()
    # More steps, the same rate (a longer fit): known.
    longer = compare(observe(_report(model, [(7, 24)], steps=24)), baseline)
    assert [m.status for m in longer.matches] == ["known"]
    lower = compare(observe(_report(model, [(7, 2)], steps=8)), baseline)
    assert [m.status for m in lower.matches] == ["known"]


def test_counts_are_compared_where_the_figure_is_not_a_rate(model: Path) -> None:
    baseline = observe(_report(model, [(7, 2)], invariant="no_iterator_reset"))
    assert baseline[0].per_step is None
    assert compare(observe(_report(model, [(7, 2)], invariant="no_iterator_reset")), baseline).failing == []
    (match,) = compare(observe(_report(model, [(7, 3)], invariant="no_iterator_reset")), baseline).failing
    assert match.status == "higher" and "3x" in match.describe() and "baseline: 2x" in match.describe()


def test_a_new_site_and_a_new_invariant_fail_and_name_what_is_new(model: Path) -> None:
    baseline = observe(_report(model, [(7, 8)]))
    comparison = compare(observe(_report(model, [(7, 8), (9, 8)])), baseline)
    assert [(m.observation.line, m.status) for m in comparison.matches] == [(7, "known"), (9, "new")]
    assert comparison.summary_line() == (
        "torchperf: 1 finding not in the baseline: no_host_sync at pkg/model.py:9 in training_step (1 known)"
    )
    other = compare(observe(_report(model, [(7, 8)], invariant="on_device")), baseline)
    assert [m.status for m in other.matches] == ["new"] and len(other.stale) == 1


def test_identical_lines_in_one_function_match_the_nearest_entry(model: Path) -> None:
    baseline = observe(_report(model, [(9, 8), (10, 16)]))  # two `value = loss.item()` lines
    for entry in baseline:
        entry.line += 5  # both moved down
    comparison = compare(observe(_report(model, [(9, 8), (10, 16)])), baseline)
    assert [(m.observation.line, m.entry.line, m.status) for m in comparison.matches] == [
        (9, 14, "known"),
        (10, 15, "known"),
    ]


def test_an_edited_source_line_is_a_new_site_and_the_old_entry_is_stale(model: Path) -> None:
    baseline = observe(_report(model, [(7, 8)]))
    baseline[0].source = "if loss.item() > 10:"
    comparison = compare(observe(_report(model, [(7, 8)])), baseline)
    assert [m.status for m in comparison.matches] == ["new"] and comparison.stale == baseline


def test_runs_of_one_test_merge_to_their_highest_figure(model: Path) -> None:
    merged = merge_observations(observe(_report(model, [(7, 8)])) + observe(_report(model, [(7, 16)])))
    assert len(merged) == 1 and merged[0].count == 16 and merged[0].per_step == 2.0


def test_findings_at_one_site_add_up(model: Path) -> None:
    (obs,) = observe(_report(model, [(7, 2), (7, 3)], invariant="min_workers"))
    assert obs.count == 5


def test_the_file_is_sorted_has_no_timestamp_and_round_trips(model: Path, tmp_path: Path) -> None:
    observations = observe(_report(model, [(9, 8), (7, 8)]))
    base = Baseline({"test_b.py::test_b": observations, "test_a.py::test_a": observations[:1], "gone": []})
    path = tmp_path / "baseline.json"
    assert base.write(str(path)) is True
    assert base.write(str(path)) is False  # nothing changed: not rewritten
    doc = json.loads(path.read_text())
    assert doc["schema"] == SCHEMA and doc["schema_version"] == 1 and set(doc) == {"schema", "schema_version", "tests"}
    assert list(doc["tests"]) == ["test_a.py::test_a", "test_b.py::test_b"]
    assert [e["line"] for e in doc["tests"]["test_b.py::test_b"]] == [7, 9]
    assert doc["tests"]["test_b.py::test_b"][0] == {
        "invariant": "no_host_sync", "file": "pkg/model.py", "function": "training_step",
        "source": "if loss.item() > 100:  # a sync", "line": 7, "label": "`.item()`", "count": 8, "per_step": 1.0,
    }
    again = Baseline.load(str(path))
    assert again.dumps() == base.dumps()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no baseline file at *missing.json (write one with --torchperf-baseline-update)"),
        ("{not json", "cannot read the baseline file *"),
        ('{"tests": {}}', "* is not a pytest-torchperf baseline*"),
        (json.dumps({"schema": SCHEMA, "schema_version": 99, "tests": {}}), "*schema_version 99*refresh it*"),
        (
            json.dumps({"schema": SCHEMA, "schema_version": 1, "tests": {"t": [{"line": 3}]}}),
            "*a malformed entry of t*",
        ),
    ],
)
def test_an_unreadable_file_is_an_error_naming_it(tmp_path: Path, content: str | None, message: str) -> None:
    path = tmp_path / "missing.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(BaselineError) as info:
        Baseline.load(str(path))
    import fnmatch

    assert fnmatch.fnmatch(str(info.value), message), str(info.value)
    if content is None:
        assert Baseline.load(str(path), missing_ok=True).tests == {}


def test_the_violation_names_the_new_findings_first(model: Path) -> None:
    report = _report(model, [(7, 8), (9, 8)])
    comparison = compare(observe(report), observe(_report(model, [(7, 8)])))
    exc = KnownFindingsViolation(report, comparison)
    assert isinstance(exc, InvariantViolation) and isinstance(exc, AssertionError)
    text = str(exc).splitlines()
    assert text[0].startswith("torchperf: 1 finding not in the baseline")
    assert text[1].startswith("new: no_host_sync: `.item()` at pkg/model.py:9")
    assert text[2].startswith("known: no_host_sync: `.item()` at pkg/model.py:7")


def _session(model: Path, collected: set, narrowed: set = frozenset()) -> Session:
    entries = observe(_report(model, [(7, 8)]))
    base = Baseline({
        "test_a.py::test_ran": entries,
        "test_a.py::test_renamed": entries,
        "test_a.py::test_deselected": entries,
        "test_gone.py::test_x": entries,
        "test_other.py::test_not_selected": entries,
    })
    session = Session(base)
    session.collected = set(collected)
    session.narrowed_files = set(narrowed)
    return session


def test_stale_entries_are_findings_gone_from_tests_that_ran_and_tests_that_no_longer_exist(model: Path) -> None:
    files = {"test_a.py", "test_other.py"}
    session = _session(model, {"test_a.py::test_ran", "test_a.py::test_deselected", "test_a.py::test_new_name"})
    session.record("test_a.py::test_ran", [])  # ran, and the finding went away
    session.record("test_a.py::test_new_name", observe(_report(model, [(7, 8)])))
    stale = session.stale(lambda path: path in files)
    assert [s.describe() for s in stale] == [
        "stale: test_a.py::test_ran: no_host_sync: `.item()` at pkg/model.py:7 in training_step, 1 per step: "
        "no longer found",
        "stale: test_a.py::test_renamed: the test no longer exists",
        "stale: test_gone.py::test_x: test_gone.py no longer exists",
    ]
    # The renamed test's findings are new under its new name.
    assert [m.status for m in session.comparisons()["test_a.py::test_new_name"].matches] == ["new"]
    refreshed = session.refreshed(lambda path: path in files)
    assert sorted(refreshed.tests) == [
        "test_a.py::test_deselected",  # collected, not run: kept
        "test_a.py::test_new_name",
        "test_other.py::test_not_selected",  # its file was not part of the run: kept
    ]


def test_a_file_narrowed_with_a_selector_does_not_make_its_other_tests_stale(model: Path) -> None:
    session = _session(model, {"test_a.py::test_ran"}, narrowed={"test_a.py"})
    session.record("test_a.py::test_ran", observe(_report(model, [(7, 8)])))
    assert session.stale(lambda path: True) == []
