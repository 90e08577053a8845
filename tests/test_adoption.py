"""Adopting the plugin on a suite, through pytest: the baseline ratchet, GitHub annotations, traces."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

SUITE = """
    import torch


    def train(run, steps=4, syncs=1):
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            with run.step():
                loss = model(torch.randn(8, 4)).pow(2).mean()
                for _ in range(syncs):
                    value = loss.item()  # a sync
                loss.backward()
                opt.step()
                opt.zero_grad()


    def test_sync(torchperf):
        with torchperf.watch() as run:
            train(run)


    def test_clean(torchperf):
        with torchperf.watch() as run:
            train(run, syncs=0)


    def test_own_error(torchperf):
        with torchperf.watch(no_host_sync=False) as run:
            train(run)
        raise ValueError("the test's own failure")
"""
SYNC_LINE = 11  # `value = loss.item()` in SUITE


def _suite(pytester: pytest.Pytester, source: str = SUITE, name: str = "test_suite") -> None:
    pytester.makepyfile(**{name: source})


def _entries(path: Path) -> dict:
    return json.loads(path.read_text())["tests"]


def test_update_writes_the_findings_then_known_ones_pass_with_their_report(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    update = pytester.runpytest("--torchperf-baseline=baseline.json", "--torchperf-baseline-update")
    update.assert_outcomes(passed=2, failed=1)  # findings do not fail; the test's own error still does
    update.stdout.fnmatch_lines(["*torchperf baseline: wrote *baseline.json (1 entry in 1 test)"])
    assert _entries(pytester.path / "baseline.json") == {
        "test_suite.py::test_sync": [
            {
                "invariant": "no_host_sync", "file": "test_suite.py", "function": "train",
                "source": "value = loss.item()  # a sync", "line": SYNC_LINE, "label": "`.item()`",
                "count": 4, "per_step": 1.0,
            }
        ]
    }
    ratchet = pytester.runpytest("--torchperf-baseline=baseline.json", "-rfP")
    ratchet.assert_outcomes(passed=2, failed=1)
    ratchet.stdout.fnmatch_lines(
        [
            "*- torchperf baseline -*",
            "torchperf baseline *baseline.json: 1 known finding, 0 new or higher, 0 stale",
        ]
    )
    # The known finding's report is still at hand: in the summary and as a section of the passed test.
    ratchet.stdout.fnmatch_lines(
        ["PASSED  test_suite.py::test_sync: no_host_sync failed (4 syncs at test_suite.py:11: 1 per step*"]
    )
    ratchet.stdout.fnmatch_lines(
        ["*torchperf: broken invariants that did not fail the test*", "*`.item()` (4x) at test_suite.py:11 in train*"]
    )
    ratchet.stdout.fnmatch_lines(["FAILED test_suite.py::test_own_error - ValueError: the test's own failure"])


def test_a_higher_rate_and_a_new_site_fail_naming_what_is_new(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update").assert_outcomes(passed=2, failed=1)
    _suite(pytester, SUITE.replace("train(run)\n", "train(run, syncs=2)\n", 1))
    higher = pytester.runpytest("--torchperf-baseline=b.json", "-k", "test_sync")
    higher.assert_outcomes(failed=1)
    higher.stdout.fnmatch_lines(
        [
            "torchperf: 1 finding not in the baseline: no_host_sync at test_suite.py:11 in train "
            "(2 per step, baseline 1 per step)",
            "*- torchperf: baseline -*",
            "higher: no_host_sync: `.item()` at test_suite.py:11 in train, 2 per step (baseline: 1 per step)",
            "torchperf: 1 invariant broken: no_host_sync (8 syncs at test_suite.py:11: 2 per step over 4 steps)*",
        ]
    )
    # A sync the clean test did not have: a new site, in a test with no entry.
    _suite(pytester, SUITE.replace("train(run, syncs=0)", "train(run, syncs=1)"))
    new = pytester.runpytest("--torchperf-baseline=b.json", "-k", "test_clean")
    new.assert_outcomes(failed=1)
    new.stdout.fnmatch_lines(
        ["new: no_host_sync: `.item()` at test_suite.py:11 in train, 1 per step (not in the baseline)"]
    )


@pytest.mark.slow
def test_moved_lines_stay_known_and_a_renamed_test_is_stale_plus_new(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update")
    before = (pytester.path / "b.json").read_text()
    moved = "# three lines\n# added above\n# everything\n" + textwrap.dedent(SUITE)
    pytester.path.joinpath("test_suite.py").write_text(moved.replace("def test_sync(", "def test_sync_renamed("))
    result = pytester.runpytest("--torchperf-baseline=b.json")
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "torchperf baseline *b.json: 0 known findings, 1 new or higher, 1 stale",
            "  test_suite.py::test_sync_renamed: new: no_host_sync: `.item()` at test_suite.py:15 in train*",
            "  stale: test_suite.py::test_sync: the test no longer exists",
            "torchperf baseline: refresh it with --torchperf-baseline-update to drop the stale entries",
        ]
    )
    # Back to its name, three lines lower: known, the line is only a hint.
    pytester.path.joinpath("test_suite.py").write_text(moved)
    pytester.runpytest("--torchperf-baseline=b.json").assert_outcomes(passed=2, failed=1)
    assert (pytester.path / "b.json").read_text() == before


def test_stale_entries_drop_on_update_and_unselected_tests_keep_theirs(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    _suite(pytester, SUITE.replace("def test_", "def test_other_"), name="test_other")
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update")
    assert sorted(_entries(pytester.path / "b.json")) == ["test_other.py::test_other_sync", "test_suite.py::test_sync"]
    _suite(pytester, SUITE.replace("train(run)\n", "train(run, syncs=0)\n", 1))  # the sync is fixed
    fixed = pytester.runpytest("--torchperf-baseline=b.json", "test_suite.py")
    fixed.stdout.fnmatch_lines(
        ["  stale: test_suite.py::test_sync: no_host_sync: `.item()` at test_suite.py:11 in train, "
         "1 per step: no longer found"]
    )
    # A -k that deselects the other file's test, and a run of one file: the other entries are kept.
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update", "test_suite.py", "-k", "sync")
    assert sorted(_entries(pytester.path / "b.json")) == ["test_other.py::test_other_sync"]


@pytest.mark.slow
def test_xdist_judges_and_writes_like_a_serial_run_and_traces_the_failed_test(pytester: pytest.Pytester) -> None:
    # The traces' run under xdist is the ratchet's (an xdist session is three processes that import torch).
    _suite(pytester)
    _suite(pytester, SUITE.replace("def test_", "def test_other_"), name="test_other")
    pytester.runpytest("--torchperf-baseline=serial.json", "--torchperf-baseline-update")
    parallel = pytester.runpytest_subprocess(
        "-n", "2", "--torchperf-baseline=parallel.json", "--torchperf-baseline-update"
    )
    parallel.assert_outcomes(passed=4, failed=2)
    assert (pytester.path / "parallel.json").read_text() == (pytester.path / "serial.json").read_text()
    _suite(pytester, SUITE.replace("def test_sync(", "def test_sync_renamed("))
    ratchet = pytester.runpytest_subprocess("-n", "2", "--torchperf-baseline=parallel.json", "--torchperf-trace=traces")
    ratchet.assert_outcomes(passed=3, failed=3)
    ratchet.stdout.fnmatch_lines_random(
        [
            "torchperf baseline *parallel.json: 1 known finding, 1 new or higher, 1 stale",
            "  stale: test_suite.py::test_sync: the test no longer exists",
        ]
    )
    assert ratchet.stdout.str().count("- torchperf baseline -") == 1
    # One trace, of the test failed by the new finding: none for the known one or the tests failing on
    # their own errors.
    traces = [f.name for f in (pytester.path / "traces").iterdir()]
    assert len(traces) == 1 and "test_sync_renamed" in traces[0], traces
    assert "torchperf trace: " in ratchet.stdout.str()
    plain = pytester.runpytest("-p", "no:cacheprovider")
    assert "torchperf trace" not in plain.stdout.str()


def test_options_are_checked_and_the_ini_path_is_relative_to_the_ini_file(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    no_path = pytester.runpytest("--torchperf-baseline-update")
    assert no_path.ret == pytest.ExitCode.USAGE_ERROR
    no_path.stderr.fnmatch_lines(["*--torchperf-baseline-update needs the file: --torchperf-baseline=PATH*"])
    missing = pytester.runpytest("--torchperf-baseline=nowhere.json")
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*no baseline file at *nowhere.json (write one with --torchperf-baseline-update)"])
    (pytester.path / "broken.json").write_text("[1, 2")
    broken = pytester.runpytest("--torchperf-baseline=broken.json")
    assert broken.ret == pytest.ExitCode.USAGE_ERROR
    broken.stderr.fnmatch_lines(["*cannot read the baseline file *broken.json*"])
    bad = pytester.runpytest("--torchperf-annotations=sometimes")
    bad.stderr.fnmatch_lines(["*--torchperf-annotations: must be one of auto, on, off, got 'sometimes'*"])
    assert "INTERNALERROR" not in no_path.stderr.str() + missing.stderr.str() + broken.stderr.str()

    pytester.makeini("[pytest]\ntorchperf_baseline = ci/torchperf.json\n")
    sub = pytester.mkdir("sub")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(sub)
        pytester.runpytest(str(pytester.path), "--torchperf-baseline-update").assert_outcomes(passed=2, failed=1)
    assert _entries(pytester.path / "ci" / "torchperf.json")


def test_help_lists_the_adoption_options(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*--torchperf-baseline=PATH*",
            "*--torchperf-baseline-update*",
            "*--torchperf-annotations=WHEN*",
            "*--torchperf-trace=DIR*",
            "*torchperf_baseline (string)*",
            "*torchperf_annotations (string)*",
            "*torchperf_trace (string)*",
        ]
    )


# -- GitHub annotations -------------------------------------------------------------------------------

FRAMEWORK_SITE = """
    from torchperf_models import make_loader

    def epochs(loader, n):
        for _ in range(n):
            for batch in loader:
                pass

    def test_respawns(torchperf):
        with torchperf.watch():
            epochs(make_loader(persistent_workers=False), 3)
"""


@pytest.mark.slow
def test_annotations_on_github_actions_once_per_site_known_ones_as_warnings(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(pytester.path))
    _suite(pytester)
    _suite(pytester, SUITE.replace("def test_", "def test_other_"), name="test_other")
    result = pytester.runpytest()
    result.assert_outcomes(passed=2, failed=4)
    lines = [line for line in result.stdout.lines if line.startswith("::")]
    assert lines == [
        "::error file=test_other.py,line=11,title=torchperf no_host_sync::`.item()` in train: 1 per step over 4 steps"
        " [test: test_other.py::test_other_sync]",
        "::error file=test_suite.py,line=11,title=torchperf no_host_sync::`.item()` in train: 1 per step over 4 steps"
        " [test: test_suite.py::test_sync]",
    ]
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update", "test_suite.py")
    known = pytester.runpytest("--torchperf-baseline=b.json")
    assert [line for line in known.stdout.lines if line.startswith("::")] == [
        lines[0],
        "::warning file=test_suite.py,line=11,title=torchperf no_host_sync::`.item()` in train: 1 per step over "
        "4 steps (known in the baseline) [test: test_suite.py::test_sync]",
    ]
    off = pytester.runpytest("--torchperf-annotations=off")
    assert not [line for line in off.stdout.lines if line.startswith("::")]
    pytester.makeini("[pytest]\ntorchperf_annotations = off\n")
    assert not [line for line in pytester.runpytest().stdout.lines if line.startswith("::")]


@pytest.mark.slow
def test_annotations_point_at_your_line_under_xdist_from_the_controller_only(
    user_models: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    user_models.makepyfile(test_loaders=FRAMEWORK_SITE)
    user_models.makepyfile(test_loaders_too=FRAMEWORK_SITE)
    result = user_models.runpytest_subprocess("-n", "2", "--torchperf-annotations=on")
    result.assert_outcomes(failed=2)
    lines = [line for line in result.stdout.lines if line.startswith("::")]
    # The pool is rebuilt inside torch's DataLoader; the annotation is at the user's line that iterated it.
    assert [line.split("::")[1] for line in lines] == [
        "error file=test_loaders.py,line=5,title=torchperf no_iterator_reset",
        "error file=test_loaders_too.py,line=5,title=torchperf no_iterator_reset",
    ], lines
    assert "started a new worker pool in each of its 3 passes over it" in lines[0]
    assert result.stdout.str().count("::error ") == 2  # not once more per worker


# -- traces ----------------------------------------------------------------------------------------


def test_trace_of_a_failing_test_has_its_steps_and_findings_marked(pytester: pytest.Pytester) -> None:
    _suite(pytester)
    result = pytester.runpytest("--torchperf-trace=traces", "-k", "sync or clean")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        ["torchperf trace: *traces*test_suite.py_test_sync-*.pt.trace.json (torch.profiler, the test body through "
         "optimizer step 4; findings marked as torchperf user annotations; open in Perfetto or TensorBoard)"]
    )
    files = list((pytester.path / "traces").iterdir())
    assert [f.name for f in files] == [f.name for f in files if "test_sync" in f.name] and len(files) == 1
    doc = json.loads(files[0].read_text())
    events = doc["traceEvents"]
    steps = sorted(e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#"))
    assert steps == ["ProfilerStep#0", "ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#3"]
    marks = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("torchperf ")]
    name = f"torchperf no_host_sync: `.item()` at test_suite.py:{SYNC_LINE} in train"
    assert {e["name"] for e in marks} == {name}
    ranges = [e for e in marks if e["ph"] == "X"]
    assert len(ranges) == 1 and ranges[0]["dur"] > 0  # the one recorded call of train()
    assert [e["ph"] for e in marks if e["ph"] == "i"] == ["i"]
    assert doc["torchperf"]["test"] == "test_suite.py::test_sync"


@pytest.mark.slow
def test_trace_marks_a_lightning_training_step(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Syncing(TinyModule):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                print(float(loss))
                return loss

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(Syncing(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("--torchperf-trace=traces")
    result.assert_outcomes(failed=1)
    (path,) = (user_models.path / "traces").iterdir()
    events = json.loads(path.read_text())["traceEvents"]
    ranges = [
        e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("torchperf ") and e["ph"] == "X"
    ]
    assert len(ranges) == 4  # training_step in each of the 4 recorded steps
    assert {r["name"] for r in ranges} == {"torchperf no_host_sync: `float(tensor)` at test_fit.py:7 in training_step"}


def test_a_test_running_its_own_profiler_is_left_alone(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_prof="""
        import pytest
        import torch
        from torch.profiler import profile

        LAYER = torch.nn.Linear(2, 1)

        def sync_steps(run):
            for _ in range(2):
                with run.step():
                    LAYER(torch.ones(1, 2)).sum().item()  # a device tensor's value (host math would not sync)

        def test_profiles_inside(torchperf):
            with torchperf.watch() as run:
                with profile() as prof:
                    sync_steps(run)
            assert any(e.name == "aten::sum" for e in prof.events())  # its own profiler saw everything

        @pytest.fixture
        def profiled():
            with profile() as prof:
                yield prof

        def test_profiled_by_a_fixture(torchperf, profiled):
            with torchperf.watch() as run:
                sync_steps(run)
        """
    )
    result = pytester.runpytest("--torchperf-trace=traces")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*_ test_profiles_inside _*",
            "torchperf: 2 invariants broken: no_host_sync*; no_debug_modes (the autograd profiler on in 2 steps)*",
            "torchperf trace: not written: the test started a profiler of its own",
            "*_ test_profiled_by_a_fixture _*",
            "torchperf trace: not written: a profiler was already running",
        ]
    )
    assert not (pytester.path / "traces").exists()
