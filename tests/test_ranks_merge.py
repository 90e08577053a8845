"""One report over many processes: the wire format, the merge rules, ``step()`` (pure Python, no process started)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_torchperf import step, watch
from pytest_torchperf.glue.results import junit_properties
from pytest_torchperf.ranks import merge as merging
from pytest_torchperf.ranks.merge import Part, merge
from pytest_torchperf.ranks.wire import report_from_data, report_to_data
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Report, Site
from pytest_torchperf.stacks import Frame

HERE = os.path.abspath(__file__)


def syncs(count: int, status: str = FAILED, steps: int = 4) -> Report:
    stack = (Frame(HERE, 12, "training_step"),)
    finding = Finding(
        f"`.item()` in training_step: 1 per step over {steps} steps",
        ["on this CPU-only run: would synchronise on an accelerator"],
        [Site("`.item()`", stack, count)],
        "keep the value on the device",
    )
    check = CheckResult(
        "no_host_sync", status, f"{count} syncs at model.py:12: 1 per step over {steps} steps", count,
        [finding] if status == FAILED else [], {"syncs": count, "steps": steps},
    )
    passed = CheckResult("no_data_parallel", PASSED, "no DataParallel in the run", 0, [], {"data_parallel_modules": 0})
    return Report(checks={"no_host_sync": check, "no_data_parallel": passed}, steps=steps)


def test_a_report_survives_the_wire_unchanged() -> None:
    report = syncs(4)
    report.internal_errors["probe x"] = "KeyError: 'y'"
    back = report_from_data(report_to_data(report))
    assert back == report
    assert back["no_host_sync"].findings[0].sites[0].frame == Frame(HERE, 12, "training_step")


def test_identical_findings_of_several_ranks_are_told_once_with_their_ranks() -> None:
    merged = merge([Part(None, syncs(0, PASSED, steps=0)), Part(0, syncs(4)), Part(1, syncs(4))])
    check = merged["no_host_sync"]
    assert check.status == FAILED
    assert check.summary == "rank 0, 1: 4 syncs at model.py:12: 1 per step over 4 steps"
    assert [f.title for f in check.findings] == ["rank 0, 1: `.item()` in training_step: 1 per step over 4 steps"]
    assert check.count == 8
    assert check.processes["rank1"] == {
        "status": FAILED, "summary": check.summary.split(": ", 1)[1], "figures": {"syncs": 4, "steps": 4}
    }
    assert "ranks" not in check.figures  # the merge has its own field: no figure name is the engine's
    assert merged.summary_line() == (
        "torchperf: 1 invariant broken: no_host_sync (rank 0, 1: 4 syncs at model.py:12: 1 per step over 4 steps)"
    )
    assert merged.steps == 8 and [r["process"] for r in merged.ranks] == ["main process", "rank 0", "rank 1"]


def test_different_findings_keep_their_own_rank() -> None:
    check = merge([Part(0, syncs(4)), Part(1, syncs(3))])["no_host_sync"]
    assert (
        check.summary
        == "rank 0: 4 syncs at model.py:12: 1 per step over 4 steps; rank 1: 3 syncs at model.py:12: 1 per step over 4 "
           "steps"
    )
    assert [f.title.split(":")[0] for f in check.findings] == ["rank 0", "rank 1"]


def test_a_rank_that_saw_nothing_is_not_checked_never_passed() -> None:
    quiet = syncs(0, PASSED)
    quiet.checks["no_host_sync"] = CheckResult("no_host_sync", NOT_CHECKED, "no training step observed")
    check = merge([Part(None, syncs(0, PASSED)), Part(0, syncs(0, PASSED)), Part(1, quiet)])["no_host_sync"]
    assert check.status == NOT_CHECKED
    assert check.summary == (
        "main process and rank 0: passed (0 syncs at model.py:12: 1 per step over 4 steps); "
        "rank 1: not checked (no training step observed)"
    )


def test_the_main_process_that_trained_nothing_is_left_out_of_the_verdict() -> None:
    idle = syncs(0, PASSED, steps=0)
    idle.checks["no_host_sync"] = CheckResult("no_host_sync", NOT_CHECKED, "no training step observed")
    merged = merge([Part(None, idle), Part(0, syncs(0, PASSED)), Part(1, syncs(0, PASSED))])
    assert merged["no_host_sync"].status == PASSED
    assert merged["no_host_sync"].summary.startswith("rank 0, 1: ")
    assert merged["no_data_parallel"].summary == "main process and rank 0, 1: no DataParallel in the run"


def test_a_missing_or_raising_rank_shows_why_and_vouches_for_nothing() -> None:
    error = {
        "type": "RuntimeError",
        "message": "boom",
        "where": "train.py:9 in train",
        "traceback": ["train.py:9 in train", "RuntimeError: boom"],
    }
    merged = merge([
        Part(0, syncs(0, PASSED)),
        Part(1, syncs(0, PASSED), pid=42, error=error),
        Part(2, None, missing="no report: the process was killed by SIGKILL before its watch ended"),
    ])
    check = merged["no_data_parallel"]
    assert check.status == NOT_CHECKED
    assert "rank 1: not checked (raised RuntimeError: boom at train.py:9 in train)" in check.summary
    assert "rank 2: not checked (no report: the process was killed by SIGKILL before its watch ended)" in check.summary
    text = merged.render()
    assert "torchperf: rank 1 (pid 42) raised RuntimeError: boom at train.py:9 in train" in text
    assert "  RuntimeError: boom" in text
    assert "torchperf: rank 2: no report: the process was killed by SIGKILL before its watch ended" in text
    assert merged.to_dict()["ranks"][1]["error"] == error


def test_per_rank_figures_become_junit_properties() -> None:
    merged = merge([Part(0, syncs(4)), Part(1, syncs(3))])
    props = dict(junit_properties({n: c.to_dict() for n, c in merged.checks.items()}))
    assert props["torchperf.no_host_sync.status"] == FAILED
    assert props["torchperf.no_host_sync.rank0.syncs"] == 4 and props["torchperf.no_host_sync.rank1.syncs"] == 3
    assert props["torchperf.no_host_sync.rank1.status"] == FAILED


def test_labels_read_as_words() -> None:
    assert merging.label_of([Part(None), Part(1), Part(0)]) == "main process and rank 0, 1"


def test_step_marks_every_active_run_and_does_nothing_outside() -> None:
    with step():  # no run: nothing to mark, nothing raised
        pass
    with watch(scope="training_step") as outer:
        with watch() as inner:
            for _ in range(3):
                with step():
                    assert outer.in_step and inner.in_step
        with step():
            pass
    assert (outer.steps, inner.steps) == (4, 3)


def test_a_run_without_launches_keeps_its_own_report() -> None:
    with watch() as run:
        pass
    assert type(run.report) is Report


@pytest.mark.parametrize("value", ["", "not json", '{"version": 0, "dir": "/x"}'])
def test_a_bad_rank_variable_is_no_rank_context(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from pytest_torchperf.ranks import child

    monkeypatch.setenv(child.ENV, value)
    assert child.context() is None and not child.judged_elsewhere()


@pytest.mark.parametrize("mode, raises", [("rerun", False), ("boot", True)])
def test_only_a_rank_that_reruns_its_launcher_leaves_the_verdict_to_it(
    monkeypatch: pytest.MonkeyPatch, mode: str, raises: bool
) -> None:
    import json

    import torch

    from pytest_torchperf import InvariantViolation
    from pytest_torchperf.ranks import child

    monkeypatch.setenv(child.ENV, json.dumps({"version": 1, "mode": mode, "dir": "/nonexistent", "runs": []}))
    assert child.judged_elsewhere() is not raises

    def body() -> Report:
        with watch() as run:
            with run.step():
                torch.nn.Linear(2, 1)(torch.ones(1, 2)).sum().item()  # a device value (host math does not sync)
        assert run.report is not None
        return run.report

    if raises:  # a user's own watch() in a rank started with a function or a script: judged there
        with pytest.raises(InvariantViolation):
            body()
    else:  # a Lightning ddp rank re-running the test: its launcher judges the same watch
        assert body()["no_host_sync"].status == FAILED


def test_every_launcher_patch_is_undone_when_the_watch_ends() -> None:
    import importlib
    import sys

    import torch.distributed.elastic.multiprocessing.api  # noqa: F401
    import torch.multiprocessing
    from torch._C._distributed_c10d import Reducer
    from torch.nn.parallel import DistributedDataParallel

    owners: list = [
        torch.multiprocessing, sys.modules["torch.multiprocessing.spawn"], sys.modules["torch.distributed"],
        sys.modules["torch.distributed.distributed_c10d"], sys.modules["torch.distributed.elastic.multiprocessing.api"],
        DistributedDataParallel, Reducer,
    ]
    for name in ("pytorch_lightning", "lightning_fabric"):
        module = importlib.import_module(f"{name}.strategies.launchers.subprocess_script")
        owners.append(module._SubprocessScriptLauncher)
    before = [dict(vars(owner)) for owner in owners]
    with watch(no_unused_parameters_search=True, no_sync_accumulation=True):
        patched = [name for owner, old in zip(owners, before) for name in old if vars(owner).get(name) is not old[name]]
    assert sorted(set(patched)) == [
        "__init__", "_call_children_scripts", "forward", "get_subprocess_handler", "init_process_group", "launch",
        "prepare_for_backward", "start_processes",
    ]
    after = [dict(vars(owner)) for owner in owners]
    assert after == before


@pytest.mark.parametrize(
    "args, booted",
    [
        (("-u", "train.py", "--sync"), ("-u", "-m", "pytest_torchperf.ranks.boot", "train.py", "--sync")),
        (
            ("-u", "-m", "pkg.train", "--lr", "1"),
            ("-u", "-m", "pytest_torchperf.ranks.boot", "-m", "pkg.train", "--lr", "1"),
        ),
        (("-X", "dev", "train.py"), ("-X", "dev", "-m", "pytest_torchperf.ranks.boot", "train.py")),
        (("-u", "-c", "print(1)"), None),  # code on the command line: nothing to run through the boot module
    ],
)
def test_a_torchrun_rank_command_runs_its_script_through_the_boot_module(args: tuple, booted: object) -> None:
    from pytest_torchperf.ranks.launches import _boot_args

    assert _boot_args(args) == booted


def test_report_directories_of_dead_processes_are_swept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess
    import sys

    from pytest_torchperf.ranks import launches

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f"torchperf-ranks-{dead.stdout.strip()}-abc"
    (stale / "key").mkdir(parents=True)
    alive = tmp_path / f"torchperf-ranks-{os.getppid()}-def"
    alive.mkdir()
    mine = tmp_path / f"torchperf-ranks-{os.getpid()}-ghi"
    mine.mkdir()
    monkeypatch.setattr(launches, "_swept", [False])
    monkeypatch.setattr(launches.tempfile, "tempdir", str(tmp_path))
    made = Path(launches.make_directory())
    assert made.parent == tmp_path and made.name.startswith(f"torchperf-ranks-{os.getpid()}-")
    assert not stale.exists() and alive.exists() and mine.exists()
