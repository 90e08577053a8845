"""``no_debug_modes``: anomaly detection, the profiler, CUDA_LAUNCH_BLOCKING, deterministic algorithms (CPU)."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from seed_tips_models import report_of

from pytest_torchperf.arguments import UsageError
from pytest_torchperf.options import parse_options
from pytest_torchperf.report import FAILED, PASSED


def _steps(before: Callable[[], Any] = lambda: None, steps: int = 3) -> Callable[[Any], None]:
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(run: Any) -> None:
        before()
        for _ in range(steps):
            with run.step():
                optimizer.zero_grad()
                model(torch.randn(4, 8)).sum().backward()
                optimizer.step()

    return body


@pytest.fixture(autouse=True)
def modes_back() -> Any:
    yield
    torch.autograd.set_detect_anomaly(False)
    torch.use_deterministic_algorithms(False)


def test_on_by_default() -> None:
    assert "no_debug_modes" in parse_options({}).enabled_checks


def test_anomaly_detection_turned_on_in_the_code_fails_at_its_line() -> None:
    def turn_on() -> None:
        torch.autograd.set_detect_anomaly(True)  # the line

    check = report_of(_steps(turn_on))["no_debug_modes"]
    assert check.status == FAILED
    assert check.summary == "anomaly detection on in 3 steps"
    (finding,) = check.findings
    assert finding.title == "anomaly detection was on in 3 of 3 training steps"
    assert finding.sites[0].frame.source == "torch.autograd.set_detect_anomaly(True)  # the line"
    assert "2-3x slower" in finding.facts[0]
    assert "not for training" in finding.hint


def test_anomaly_detection_off_passes_and_no_graph_retention_s_own_trace_is_not_counted() -> None:
    check = report_of(_steps(), no_graph_retention=True)
    assert check["no_graph_retention"].status == PASSED  # it traced creations with anomaly mode
    assert check["no_debug_modes"].status == PASSED
    assert check["no_debug_modes"].summary == "no debug mode on in 3 training steps"


def test_the_trainer_flag_is_named(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=1, detect_anomaly=True).fit(TinyModule(), make_loader(num_workers=0))

        @pytest.mark.torchperf
        def test_fit_off(tmp_path):
            make_trainer(tmp_path, max_epochs=1).fit(TinyModule(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_debug_modes (anomaly detection on in 4 steps)*",
            "anomaly detection was on in 4 of 4 training steps",
            "  turned on by the Trainer argument Trainer(detect_anomaly=True)",
        ],
        consecutive=False,
    )


def test_deterministic_algorithms_are_a_note_unless_not_allowed() -> None:
    def turn_on() -> None:
        torch.use_deterministic_algorithms(True)

    check = report_of(_steps(turn_on))["no_debug_modes"]
    assert check.status == PASSED
    assert check.summary == "no debug mode on in 3 training steps; deterministic algorithms on (noted)"
    assert check.findings[0].title.startswith("note: torch.use_deterministic_algorithms(True) was on in 3 of 3")
    check = report_of(_steps(turn_on), allow_deterministic=False)["no_debug_modes"]
    assert check.status == FAILED
    assert check.findings[0].sites[0].frame.source == "torch.use_deterministic_algorithms(True)"


def test_cuda_launch_blocking_in_the_environment_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")
    check = report_of(_steps())["no_debug_modes"]
    assert check.status == FAILED
    assert check.findings[0].facts[0] == "set in the environment (CUDA_LAUNCH_BLOCKING)"


def test_cuda_launch_blocking_set_inside_the_watched_block_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    check = report_of(_steps(lambda: monkeypatch.setenv("CUDA_LAUNCH_BLOCKING", "1")))["no_debug_modes"]
    assert check.status == FAILED
    assert check.findings[0].title == "CUDA_LAUNCH_BLOCKING=1 was on in 3 of 3 training steps"


def test_the_autograd_profiler_left_on_fails() -> None:
    profiler = torch.autograd.profiler.profile()

    def body(run: Any) -> None:
        with profiler:  # the profiler
            _steps()(run)

    check = report_of(body)["no_debug_modes"]
    assert check.status == FAILED
    assert check.findings[0].title == "the autograd profiler was on in 3 of 3 training steps"
    assert check.findings[0].sites[0].frame.source == "with profiler:  # the profiler"


def test_allow_deterministic_is_validated() -> None:
    with pytest.raises(UsageError, match="allow_deterministic must be True or False"):
        parse_options({"allow_deterministic": "yes"})


def test_anomaly_detection_turned_on_mid_loop_is_counted_from_the_next_automatic_step() -> None:
    # No run.step(): the steps are found at the optimizer steps, and the poll runs where one step turns
    # into the next (the scope never leaves between them).
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(run: Any) -> None:
        for i in range(6):
            optimizer.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            optimizer.step()
            if i == 2:
                torch.autograd.set_detect_anomaly(True)

    report = report_of(body)
    assert report.steps == 6
    assert report.steps_found == "found at optimizer.step()"
    check = report["no_debug_modes"]
    assert check.status == FAILED
    assert check.findings[0].title == "anomaly detection was on in 3 of 6 training steps"


def test_a_watch_that_saw_no_step_is_not_checked_even_with_anomaly_detection_on() -> None:
    from pytest_torchperf.report import NOT_CHECKED

    def body(run: Any) -> None:
        torch.autograd.set_detect_anomaly(True)
        torch.nn.Linear(8, 1)(torch.randn(4, 8)).sum()

    result = report_of(body, no_debug_modes=True).checks["no_debug_modes"]
    assert result.status == NOT_CHECKED, result.summary
    assert result.summary == "no training step was seen: no step to find a debug mode on in"


def test_step_based_invariants_that_judged_zero_steps_are_not_checked() -> None:
    def body(run: Any) -> None:
        torch.nn.Linear(8, 1)(torch.randn(4, 8)).sum()

    report = report_of(
        body, no_debug_modes=True, grads_set_to_none=True, no_host_sync=True, on_device=True,
        max_ops_per_step=100, no_graph_retention=True,
    )
    statuses = {name: report.checks[name].status for name in (
        "no_debug_modes", "grads_set_to_none", "no_host_sync", "on_device", "max_ops_per_step", "no_graph_retention"
    )}
    assert set(statuses.values()) == {"not checked"}, statuses


def test_scope_test_judges_the_whole_test_as_its_one_step(pytester: pytest.Pytester) -> None:
    """Under scope="test" no step is marked: the switches are read as the test starts and ends."""
    pytester.makepyfile(
        """
        import pytest
        import torch

        @pytest.fixture(autouse=True)
        def anomaly_off_after_the_watch():
            yield
            torch.autograd.set_detect_anomaly(False)

        @pytest.mark.torchperf(scope="test")
        def test_anomaly():
            torch.autograd.set_detect_anomaly(True)  # left on: the watch ends with it on
            torch.nn.Linear(4, 1)(torch.randn(2, 4)).sum().backward()

        @pytest.mark.torchperf(scope="test")
        def test_clean():
            torch.nn.Linear(4, 1)(torch.randn(2, 4)).sum().backward()
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "-v")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines([
        "*no_debug_modes (anomaly detection on in the whole test)*",
        "*anomaly detection was on in the whole test*",
    ])
    result.stdout.fnmatch_lines(
        ["PASSED  *::test_clean", "*no_debug_modes: passed (no debug mode on in the whole test)*"]
    )
    result.stdout.no_fnmatch_line("*ran no training*")
