"""Count budgets for the step checks: code that syncs or copies on purpose passes up to N per step."""

from __future__ import annotations

import json

import pytest
import torch

from pytest_torchperf import InvariantViolation, UsageError, watch


def _loop(syncs_per_step: int, copies_per_step: int, steps: int = 4, **options):
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    with watch(**options) as run:
        for _ in range(steps):
            with run.step():
                loss = model(x).pow(2).mean()
                for _ in range(syncs_per_step):
                    loss.item()  # a sync on an accelerator
                for _ in range(copies_per_step):
                    noise = torch.randn(8, 4).to(x.device)  # built on the host, then copied
                    x = x + 0 * noise
                loss.backward()
    return run


def test_syncs_within_the_budget_pass_with_the_figures() -> None:
    run = _loop(1, 0, max_syncs_per_step=1)
    check = run.report["no_host_sync"]
    assert check.status == "passed"
    assert check.summary == "4 syncs in your code, at most 1 in a step: within max_syncs_per_step=1"
    assert check.figures["worst_step_syncs"] == 1 and check.figures["max_syncs_per_step"] == 1
    assert check.figures["syncs"] == 4


def test_syncs_over_the_budget_fail_naming_it() -> None:
    with pytest.raises(InvariantViolation) as excinfo:
        _loop(2, 0, max_syncs_per_step=1)
    check = excinfo.value.report["no_host_sync"]
    assert check.status == "failed" and check.count == 8
    assert check.summary.endswith("2 in one step, max_syncs_per_step=1")
    assert check.figures["worst_step_syncs"] == 2


def test_a_zero_budget_is_the_plain_check() -> None:
    with pytest.raises(InvariantViolation):
        _loop(1, 0, max_syncs_per_step=0)
    with pytest.raises(InvariantViolation):
        _loop(1, 0)


def test_copies_budget() -> None:
    run = _loop(0, 1, max_copies_per_step=1)
    check = run.report["on_device"]
    assert check.status == "passed", check.summary
    assert check.summary.endswith("at most 1 in a step: within max_copies_per_step=1")
    assert check.figures["worst_step_copies"] == 1
    with pytest.raises(InvariantViolation) as excinfo:
        _loop(0, 2, max_copies_per_step=1)
    assert excinfo.value.report["on_device"].summary.endswith("2 in one step, max_copies_per_step=1")


def test_syncs_outside_steps_are_never_covered_by_a_budget() -> None:
    model = torch.nn.Linear(4, 1)
    with pytest.raises(InvariantViolation) as excinfo:
        with watch(scope="test", max_syncs_per_step=5):
            for _ in range(2):  # a single sync in the whole run would be a one-off note
                model(torch.randn(2, 4)).sum().item()
    assert excinfo.value.report["no_host_sync"].status == "failed"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_syncs_per_step": -1}, "max_syncs_per_step must be an integer >= 0"),
        ({"max_syncs_per_step": "2"}, "max_syncs_per_step must be an integer >= 0"),
        ({"max_copies_per_step": 1.5}, "max_copies_per_step must be an integer >= 0"),
        ({"max_sync_per_step": 1}, "(did you mean 'max_syncs_per_step'?)"),
    ],
)
def test_budgets_are_validated(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        with watch(**kwargs):
            pass


def test_budget_figures_reach_the_json_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import torch

        def test_loop(torchperf):
            model = torch.nn.Linear(4, 1)
            with torchperf.watch(max_syncs_per_step=1) as run:
                for _ in range(3):
                    with run.step():
                        model(torch.randn(2, 4)).sum().item()
        """
    )
    result = pytester.runpytest("--torchperf-json=out.json", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        ["*no_host_sync: passed (3 syncs in your code, at most 1 in a step: within max_syncs_per_step=1)*"]
    )
    doc = json.loads((pytester.path / "out.json").read_text())
    figures = doc["tests"][0]["checks"]["no_host_sync"]["figures"]
    assert figures["worst_step_syncs"] == 1 and figures["max_syncs_per_step"] == 1
