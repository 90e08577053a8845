"""``max_data_wait`` and ``target_step_time``: the time the training loop waits for batches, measured on real loaders.

Every loader here sleeps a known time per sample (``time.sleep`` holds no
core, so the times hold on a loaded machine); the assertions are on what that
set-up guarantees (a batch of 4 samples of 5 ms each cannot be made in under
20 ms), with orders of magnitude as margins, never on tight thresholds.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from pytest_torchperf import InvariantViolation, Report, UsageError, watch
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED

QUIET = {"no_host_sync": False, "on_device": False, "no_iterator_reset": False}

SLEEPY = """
import time

import torch
from torch.utils.data import DataLoader, Dataset


class SleepyDataset(Dataset):
    def __init__(self, n=32, seconds=0.005, width=4):
        self.n, self.seconds, self.width = n, seconds, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.seconds)
        return torch.full((self.width,), float(i)), torch.zeros(1)


def train(run, loader, step_s, epochs=2):
    for _ in range(epochs):
        for x, y in loader:
            with run.step():
                time.sleep(step_s)
"""


class SleepyDataset(Dataset):
    """``seconds`` per sample in ``__getitem__``."""

    def __init__(self, n: int = 32, seconds: float = 0.005) -> None:
        self.n, self.seconds = n, seconds

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        time.sleep(self.seconds)
        return torch.full((4,), float(i)), torch.zeros(1)


def slow_collate(samples: list[Any]) -> Any:
    time.sleep(0.005)
    return torch.utils.data.default_collate(samples)


def train(run: Any, loader: DataLoader, step_s: float, epochs: int = 2) -> None:
    for _ in range(epochs):
        for _x, _y in loader:
            with run.step():
                time.sleep(step_s)


def report_of(loader: DataLoader, step_s: float, **options: Any) -> Report:
    try:
        with watch(**{**QUIET, **options}) as run:
            train(run, loader, step_s)
    except InvariantViolation as exc:
        return exc.report
    assert run.report is not None
    return run.report


# -- num_workers=0: the loading is the wait ---------------------------------------------------------


def test_a_sleepy_getitem_without_workers_and_a_1ms_step_fails_naming_getitem(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(sleepy=SLEEPY)
    user_models.makepyfile(
        test_loop="""
        import pytest
        from torch.utils.data import DataLoader
        from sleepy import SleepyDataset, train

        def test_loop(torchperf):
            with torchperf.watch(max_data_wait=0.2, no_host_sync=False, on_device=False) as run:
                loader = DataLoader(SleepyDataset(), batch_size=4)
                train(run, loader, step_s=0.001)
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: max_data_wait (1 training DataLoader kept the loop waiting: *% > 20% "
            "against this run's step (* ms per batch, * batches/s))*",
            "*torchperf: max_data_wait*",
            "DataLoader(dataset=SleepyDataset, batch_size=4, num_workers=0) (built at test_loop.py:7) kept the "
            "training loop waiting *% of its time (max_data_wait=0.2): * ms per batch",
            "  measured over 14 batches in 2 passes; first batch of each pass: * ms (median), not counted",
            "  in the training process, per batch: * ms in SleepyDataset.__getitem__ (sleepy.py:14), * in collate_fn "
            "(torch's default_collate), * in the rest (sampler, pin_memory, hand-off)",
            "  judged against this run's own step (* per batch between batches, on this machine)*target_step_time*",
            "  created at test_loop.py:7 in test_loop [[]your code[]]",
            "*",
            "  hint: pass num_workers=* and persistent_workers=True, so workers run SleepyDataset.__getitem__ "
            "(sleepy.py:14) (* ms per sample) while the step runs; or move the transform it does off the hot path*",
        ],
        consecutive=False,
    )


def test_the_wait_and_the_getitem_time_are_what_the_dataset_sleeps() -> None:
    check = report_of(DataLoader(SleepyDataset(), batch_size=4), step_s=0.001, max_data_wait=0.2)["max_data_wait"]
    assert check.status == FAILED
    loader = check.figures["loaders"][0]
    # 4 samples of 5 ms: at least 20 ms per batch, in __getitem__; a loaded machine may add, never remove.
    assert 0.019 <= loader["dataset_s_per_batch"] < 0.2
    assert loader["dataset_s_per_batch"] <= loader["wait_per_batch_s"] < 0.2
    assert loader["collate_s_per_batch"] < loader["dataset_s_per_batch"] / 4
    assert loader["batches_per_s"] <= 1 / 0.019
    assert loader["batches_per_s_from"] == "main process"
    assert check.figures["data_wait"] > 0.5  # 20 ms of loading against a 1 ms step
    assert check.figures["first_batch_s"] >= 0.019
    assert len(loader["first_batch_s_each"]) == 2 and loader["batches"] == 14  # 8 batches a pass, the first apart


def test_a_slow_collate_gets_the_cheaper_collate_hint() -> None:
    loader = DataLoader(SleepyDataset(seconds=0.0), batch_size=4, collate_fn=slow_collate)
    check = report_of(loader, step_s=0.001, max_data_wait=0.2)["max_data_wait"]
    assert check.status == FAILED
    (finding,) = check.findings
    assert "ms in collate_fn (slow_collate (tests/test_data_wait.py:" in finding.facts[1]
    assert finding.hint.startswith("collate_fn takes most of each batch's time: make it cheaper")
    assert check.figures["loaders"][0]["collate_s_per_batch"] >= 0.0049


def test_a_step_much_longer_than_the_loading_passes() -> None:
    # Loading 4 samples takes well under a millisecond on a quiet machine (a few on a loaded one); the step 50 ms.
    loader = DataLoader(SleepyDataset(n=16, seconds=0.0), batch_size=4)
    check = report_of(loader, step_s=0.05, max_data_wait=0.2)["max_data_wait"]
    assert check.status == PASSED, check.summary
    assert check.summary.startswith("data wait ")
    assert "of the loop against this run's step (max 20%)" in check.summary


# -- workers: the wait is the hand-off ------------------------------------------------------------


def test_two_persistent_workers_and_a_step_longer_than_a_batch_pass() -> None:
    # 2 samples of 5 ms: 10 ms a batch in each worker, two workers, a 60 ms step: the workers stay ahead, and
    # the hand-off (well under a millisecond on a quiet machine) would have to take 15 ms to break 20%.
    loader = DataLoader(
        SleepyDataset(n=12), batch_size=2, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
    )
    check = report_of(loader, step_s=0.06, max_data_wait=0.2)["max_data_wait"]
    assert check.status == PASSED, check.summary
    figures = check.figures["loaders"][0]
    assert figures["batches_per_s_from"] == "workers"
    assert 0.0095 <= figures["worker_s_per_batch"] < 0.1  # measured in the workers themselves
    assert figures["step_s"] >= 0.059
    assert figures["data_wait"] < 0.2
    assert figures["passes"] == 2 and figures["batches"] == 10


def test_target_step_time_turns_a_cpu_pass_into_an_input_bound_failure() -> None:
    def loader() -> DataLoader:
        return DataLoader(
            SleepyDataset(n=12), batch_size=2, num_workers=2, persistent_workers=True, multiprocessing_context="fork"
        )

    cpu = report_of(loader(), step_s=0.06, max_data_wait=0.2)["max_data_wait"]
    assert cpu.status == PASSED, cpu.summary
    fast = report_of(loader(), step_s=0.06, max_data_wait=0.2, target_step_time="1ms")["max_data_wait"]
    assert fast.status == FAILED, fast.summary
    (finding,) = fast.findings
    # Two workers of 10 ms a batch cannot deliver more than 200 batches/s; a 1 ms step needs 1000.
    assert "cannot feed a 1 ms step (target_step_time='1ms'): it delivers " in finding.title
    assert "batches/s, the step needs 1000/s" in finding.title
    line = next(f for f in finding.facts if f.startswith("this loader delivers "))
    assert line.endswith("ms per batch)") and "a 1 ms step needs 1000/s: input-bound" in line
    rate = fast.figures["batches_per_s"]
    assert 10 < rate <= 210
    assert fast.figures["loaders"][0]["needed_batches_per_s"] == 1000.0
    assert fast.figures["loaders"][0]["predicted_data_wait"] > 0.5


def test_target_step_time_judges_a_loader_without_workers_by_its_own_time() -> None:
    loader = DataLoader(SleepyDataset(seconds=0.001), batch_size=4)  # >= 4 ms a batch: at most 250 batches/s
    check = report_of(loader, step_s=0.02, max_data_wait=0.2, target_step_time="2ms")["max_data_wait"]
    assert check.status == FAILED
    assert "cannot feed a 2 ms step" in check.findings[0].title
    assert check.figures["target_step_s"] == 0.002


def test_spawned_workers_are_not_measured_and_the_target_verdict_says_so() -> None:
    pytest.importorskip("multiprocessing")
    loader = DataLoader(SleepyDataset(n=8, seconds=0.0), batch_size=2, num_workers=1, persistent_workers=True)
    # Workers forked while no run timed every batch run unpatched, like spawned ones: the same verdict.
    with watch(**QUIET):
        next(iter(loader))
    check = report_of(loader, step_s=0.02, max_data_wait=0.2, target_step_time="1us")["max_data_wait"]
    assert check.status in (NOT_CHECKED, FAILED), check.summary
    assert check.figures["loaders"][0]["batches_per_s_from"] in ("at least", "delivered")
    if check.status == NOT_CHECKED:
        assert check.summary.startswith("its worker pool was started before the run, when its workers were not timed")


# -- what is counted ------------------------------------------------------------------------------


def test_a_lightning_fit_judges_its_training_loader_only(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(sleepy=SLEEPY)
    user_models.makepyfile(
        test_fit="""
        import pytest
        from torch.utils.data import DataLoader
        from sleepy import SleepyDataset
        from torchperf_models import RandomDataset, TinyModule, make_trainer

        @pytest.mark.torchperf(max_data_wait=0.9, no_host_sync=False, on_device=False)
        def test_fit(tmp_path):
            train = DataLoader(RandomDataset(), batch_size=8)
            val = DataLoader(SleepyDataset(width=8), batch_size=4)  # slow (~100% wait), not the training loop
            make_trainer(tmp_path, max_epochs=2).fit(TinyModule(), train, val)
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "--torchperf-json=out.json")
    result.assert_outcomes(passed=1)
    check = json.loads((user_models.path / "out.json").read_text())["tests"][0]["runs"][0]["checks"]["max_data_wait"]
    assert check["status"] == PASSED
    (loader,) = check["figures"]["loaders"]
    assert loader["loader"].startswith("DataLoader(dataset=RandomDataset, batch_size=8, num_workers=0) (built at ")
    assert loader["passes"] == 2 and loader["batches"] == 6
    for name in ("data_wait", "first_batch_s", "batches_per_s"):
        assert check["figures"][name] is not None


def test_the_clock_is_bound_at_import_so_a_mocked_perf_counter_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(time, "perf_counter", lambda: 0.0)
    check = report_of(DataLoader(SleepyDataset(), batch_size=4), step_s=0.001, max_data_wait=0.2)["max_data_wait"]
    assert check.status == FAILED
    assert check.figures["loaders"][0]["wait_per_batch_s"] >= 0.019


def test_a_loop_without_marked_steps_judges_every_loader() -> None:
    with pytest.raises(InvariantViolation) as caught:
        with watch(**QUIET, max_data_wait=0.2):
            for _ in DataLoader(SleepyDataset(n=16), batch_size=4):
                time.sleep(0.001)
    check = caught.value.report["max_data_wait"]
    assert check.figures["judged"] == "every loader iterated (no training step was marked)"


def test_no_batch_after_the_first_is_not_checked() -> None:
    check = report_of(DataLoader(SleepyDataset(n=4, seconds=0.0), batch_size=4), step_s=0.0, max_data_wait=0.2)[
        "max_data_wait"
    ]
    assert check.status == NOT_CHECKED
    assert check.summary == "no DataLoader fed a training step with more than one batch in a pass"


# -- arguments --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_data_wait": 20}, "max_data_wait must be a number from 0 to 1 (a share of the training loop's time: "
                                "0.2 means 20%) or None, got 20 (did you mean 0.2?)"),
        ({"max_data_wait": -0.1}, "max_data_wait must be a number from 0 to 1"),
        ({"max_data_wait": 0.2, "target_step_time": 5}, "a bare number has no unit (did you mean '5ms' or '5s'?)"),
        ({"max_data_wait": 0.2, "target_step_time": "5msec"}, "unknown unit 'msec' (did you mean '5ms'?)"),
        ({"max_data_wait": 0.2, "target_step_time": "fast"}, "target_step_time must be a duration string with a unit"),
        ({"max_data_wait": 0.2, "target_step_time": "0ms"}, "target_step_time must be a duration above zero"),
    ],
)
def test_arguments_are_validated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError) as caught:
        with watch(**options):
            pass
    assert message in str(caught.value)


@pytest.mark.parametrize(("text", "seconds"), [("5ms", 0.005), ("250us", 250e-6), ("0.02 s", 0.02), ("1.5s", 1.5)])
def test_durations_read_as_seconds(text: str, seconds: float) -> None:
    from pytest_torchperf.durations import seconds as read

    assert read(text) == pytest.approx(seconds)


@pytest.mark.slow
def test_spawned_workers_run_unpatched_and_the_target_verdict_says_what_it_could_not_measure() -> None:
    loader = DataLoader(
        SleepyDataset(n=12, seconds=0.0), batch_size=2, num_workers=1, persistent_workers=True,
        multiprocessing_context="spawn",
    )
    check = report_of(loader, step_s=0.01, max_data_wait=0.2, target_step_time="1us")["max_data_wait"]
    assert check.status == NOT_CHECKED, check.summary
    assert "workers started with 'spawn' run unpatched: their time per batch was not measured" in check.summary
    assert check.figures["loaders"][0]["batches_per_s_from"] == "at least"


@pytest.mark.slow
def test_the_figures_hold_under_xdist_with_two_workers(user_models: pytest.Pytester) -> None:
    """Two tests at once, each loader sleeping 20 ms a batch: both measure 20 ms, plus what load adds (a loaded
    machine delays a sleeping process's wake-up: up to 4x was seen with the whole suite running beside it)."""
    user_models.makepyfile(sleepy=SLEEPY)
    user_models.makepyfile(
        test_pair="""
        import pytest
        from torch.utils.data import DataLoader
        from sleepy import SleepyDataset, train

        @pytest.mark.parametrize("workers", [0, 2])
        def test_loop(torchperf, workers):
            options = dict(num_workers=workers, persistent_workers=True, multiprocessing_context="fork")
            limit = 0.2 if workers == 0 else 1.0  # the figures are under test, not the verdict of the second
            with torchperf.watch(max_data_wait=limit, no_host_sync=False, on_device=False) as run:
                loader = DataLoader(SleepyDataset(n=16), batch_size=4, **(options if workers else {}))
                train(run, loader, step_s=0.001 if workers == 0 else 0.06)
        """
    )
    result = user_models.runpytest_subprocess("-n", "2", "-p", "no:warnings", "--torchperf-json=out.json", timeout=300)
    result.assert_outcomes(passed=1, failed=1)
    tests = json.loads((user_models.path / "out.json").read_text())["tests"]
    by_id = {t["nodeid"]: t["runs"][0]["checks"]["max_data_wait"]["figures"]["loaders"][0] for t in tests}
    alone = by_id["test_pair.py::test_loop[0]"]
    assert 0.019 <= alone["dataset_s_per_batch"] <= 0.2  # 4 x 5 ms, whatever the other process does
    assert alone["dataset_s_per_batch"] <= alone["wait_per_batch_s"] <= 0.2
    pooled = by_id["test_pair.py::test_loop[2]"]
    assert 0.019 <= pooled["worker_s_per_batch"] <= 0.2  # measured in the workers of the other xdist process
    assert pooled["batches_per_s_from"] == "workers" and pooled["batches"] == 6
