"""Automatic steps: a watched loop without ``run.step()`` has its steps found at its optimizer steps."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from step_check_helpers import batches, report_of, write_module

from pytest_torchperf import watch

LOOP = """
import torch

def train(watch, batches, accumulate=1, every=1, optimizer=True, mark=False, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(**options) as run:
        for i, (x, y) in enumerate(batches):
            step = run.step() if mark else None
            if step is not None:
                step.__enter__()
            loss = torch.nn.functional.mse_loss(model(x), y) / accumulate
            loss.backward()
            if optimizer and (i + 1) % accumulate == 0:
                opt.step()
                opt.zero_grad()
            elif not optimizer:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.01 * p.grad
                        p.grad = None
            if i % every == 0:
                value = loss.item()  # HERE
            if step is not None:
                step.__exit__(None, None, None)
    return run
"""


def _loop(tmp_path: Path) -> tuple[object, int]:
    return write_module(tmp_path, "autoloop", LOOP)


def test_a_per_step_item_fails_at_its_line_with_steps_found_at_the_optimizer(tmp_path: Path) -> None:
    module, line = _loop(tmp_path)
    report = report_of(module.train, watch, batches(6))  # type: ignore[attr-defined]
    check = report["no_host_sync"]
    assert check.status == "failed"
    assert f"autoloop.py:{line}" in check.summary
    assert "1 per step over 6 steps" in check.summary
    assert report.steps == 6
    assert report.steps_found == "found at optimizer.step()"
    assert "steps: 6, found at optimizer.step()" in report.summary_line()


def test_periodic_logging_is_a_note_under_automatic_steps(tmp_path: Path) -> None:
    module, _ = _loop(tmp_path)
    report = report_of(module.train, watch, batches(30), every=10)  # type: ignore[attr-defined]
    check = report["no_host_sync"]
    assert check.status == "passed", check.summary
    assert report.steps == 30
    assert any(f.title.startswith("note: ") and "periodic" in f.title for f in check.findings)


def test_gradient_accumulation_is_one_step_per_optimizer_step(tmp_path: Path) -> None:
    module, _ = _loop(tmp_path)
    report = report_of(module.train, watch, batches(24), accumulate=4, every=4)  # type: ignore[attr-defined]
    assert report.steps == 6
    assert report["no_host_sync"].status == "failed"  # read once per optimizer step: every step


def test_without_an_optimizer_each_backward_pass_is_a_step(tmp_path: Path) -> None:
    module, _ = _loop(tmp_path)
    report = report_of(module.train, watch, batches(5), optimizer=False)  # type: ignore[attr-defined]
    assert report.steps == 5
    assert report.steps_found == "found at backward()"
    assert report["no_host_sync"].status == "failed"


def test_marked_steps_win(tmp_path: Path) -> None:
    module, _ = _loop(tmp_path)
    report = report_of(module.train, watch, batches(4), mark=True)  # type: ignore[attr-defined]
    assert report.steps == 4
    assert report.steps_found == "marked with run.step()"  # the headline says how the steps were found
    assert report["no_host_sync"].status == "failed"


def test_scope_test_is_not_split_into_automatic_steps(tmp_path: Path) -> None:
    module, _ = _loop(tmp_path)
    report = report_of(module.train, watch, batches(4), scope="test")  # type: ignore[attr-defined]
    assert report.steps_found == ""
    assert report.steps == 0


def test_inference_only_stays_not_checked() -> None:
    model = torch.nn.Linear(8, 1)
    with watch() as run:
        with torch.no_grad():
            for x, _ in batches(3):
                model(x)
    assert run.report is not None
    assert run.report["no_host_sync"].status == "not checked"
    assert run.report.steps == 0


def test_graph_retention_and_budgets_apply_to_automatic_steps(tmp_path: Path) -> None:
    module, line = write_module(
        tmp_path,
        "retain",
        """
        import torch

        def train(watch, batches):
            model = torch.nn.Linear(8, 1)
            opt = torch.optim.SGD(model.parameters(), lr=0.01)
            kept = []
            with watch(no_graph_retention=True, max_syncs_per_step=2) as run:
                for x, y in batches:
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    kept.append(loss)  # HERE
                    loss.backward(retain_graph=True)
                    opt.step()
                    opt.zero_grad()
                    loss.item()
            return run
        """,
    )
    report = report_of(module.train, watch, batches(300))  # the backward passes are sampled: enough of them
    assert report.steps == 300
    assert report["no_host_sync"].status == "passed"  # one sync a step, within the budget of 2
    assert report["no_graph_retention"].status == "failed", report["no_graph_retention"].summary


def test_the_hooks_are_gone_after_the_watch(tmp_path: Path) -> None:
    from pytest_torchperf import autosteps

    module, _ = _loop(tmp_path)
    report_of(module.train, watch, batches(2))  # type: ignore[attr-defined]
    assert autosteps.ARMED.count == 0 and autosteps.ARMED.backward == 0
    assert not getattr(torch.autograd._engine_run_backward, "__wrapped__", None)


def _post_hooks() -> list[str]:
    from torch.optim.optimizer import _global_optimizer_post_hooks

    return [getattr(hook, "__qualname__", "") for hook in _global_optimizer_post_hooks.values()]


def _ours(names: list[str]) -> int:
    return sum("on_optimizer_step" in name for name in names)


def test_the_optimizer_post_hook_is_registered_only_while_a_run_is_armed() -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def train(run: object, mark: bool) -> None:
        for x, y in batches(3):
            with run.step() if mark else contextlib.nullcontext():  # type: ignore[attr-defined]
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            seen.append(_ours(_post_hooks()))

    with watch() as run:
        assert _ours(_post_hooks()) == 1
        train(run, mark=False)
    assert run.report.steps == 3 and seen == [1, 1, 1]
    assert _ours(_post_hooks()) == 0
    seen.clear()
    with watch() as run:
        assert _ours(_post_hooks()) == 1  # armed again
        train(run, mark=True)  # the first marked step's backward pass disarms the run
    assert run.report.steps == 3 and seen == [0, 0, 0]
    assert _ours(_post_hooks()) == 0


def _backward_wrapped() -> bool:
    return getattr(torch.autograd._engine_run_backward, "__wrapped__", None) is not None


def test_the_backward_wrapper_is_in_only_while_a_run_looks_at_backward_passes() -> None:
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []

    def train(run: object, mark: bool, optimizer: bool = True) -> None:
        for x, y in batches(3):
            with run.step() if mark else contextlib.nullcontext():  # type: ignore[attr-defined]
                torch.nn.functional.mse_loss(model(x), y).backward()
                if optimizer:
                    opt.step()
                opt.zero_grad()
            seen.append(_backward_wrapped())

    with watch() as run:
        assert _backward_wrapped()  # armed: the first backward pass may begin the first step
        train(run, mark=True)  # the first marked step's backward pass disarms the run: the wrapper goes
    assert run.report.steps == 3 and seen == [False, False, False]
    assert not _backward_wrapped()
    seen.clear()
    with watch() as run:
        assert _backward_wrapped()  # armed again
        train(run, mark=False)  # steps found at optimizer steps: backward passes no longer matter
    assert run.report.steps == 3 and run.report.steps_found == "found at optimizer.step()"
    assert seen == [False, False, False]
    seen.clear()
    with watch() as run:
        train(run, mark=False, optimizer=False)  # no optimizer: every backward pass begins a step
    assert run.report.steps == 3 and run.report.steps_found == "found at backward()"
    assert seen == [True, True, True]
    assert not _backward_wrapped()


def test_a_backward_wrapper_patched_over_stays_until_the_watch_ends() -> None:
    from pytest_torchperf.patching import Patcher

    model = torch.nn.Linear(8, 1)
    calls = []
    other = Patcher()
    with watch() as run:
        # Something patched over torchperf's wrapper: taking it out now would leave it inside the other.
        def counting(original: Any) -> Any:
            return lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)

        other.wrap(torch.autograd, "_engine_run_backward", counting)
        try:
            for x, y in batches(3):
                with run.step():
                    torch.nn.functional.mse_loss(model(x), y).backward()
        finally:
            other.undo()
        assert _backward_wrapped()  # still in, returning at once: the run is disarmed
    assert calls == [1, 1, 1] and run.report.steps == 3
    assert not _backward_wrapped()


def test_a_run_disarmed_while_torch_calls_the_post_hooks_keeps_the_hook_until_the_watch_ends() -> None:
    from torch.optim.optimizer import register_optimizer_step_post_hook

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    calls = []
    with watch() as run:
        # Registered after torchperf's: torch's loop over the post-hooks goes on after torchperf's hook,
        # where a removal would make the loop raise (OrderedDict mutated during iteration).
        handle = register_optimizer_step_post_hook(lambda *args: calls.append(1))
        try:
            for i, (x, y) in enumerate(batches(4)):
                marked = run.step() if i >= 2 else contextlib.nullcontext()
                with marked:  # steps 3 and 4 marked: the run, in optimizer mode, is disarmed in the post-hook
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            assert _ours(_post_hooks()) == 1
        finally:
            handle.remove()
    assert calls == [1, 1, 1, 1]
    assert run.report.steps == 3  # two found, the second lasting into the first marked one: as before
    assert run._auto.disarmed_by == "marked steps"  # type: ignore[attr-defined]
    assert _ours(_post_hooks()) == 0


@pytest.mark.parametrize("mode", ["warn", "fail", "pass"])
def test_a_watch_that_ran_no_training_is_one_summary_line_and_no_warning(pytester: pytest.Pytester, mode: str) -> None:
    pytester.makepyfile(
        test_inference="""
        import torch

        def test_inference(torchperf):
            model = torch.nn.Linear(4, 1)
            with torchperf.watch():
                with torch.no_grad():
                    model(torch.randn(2, 4))
        """
    )
    result = pytester.runpytest(f"--torchperf-not-checked={mode}", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=0)  # nothing to watch: whatever the mode, nothing to act on
    result.stdout.fnmatch_lines(["torchperf: 1 marked test ran no training (nothing to watch)"])
    result.stdout.no_fnmatch_line("*NotCheckedWarning*")
    result.stdout.no_fnmatch_line("*with default invariants not checked*")
    verbose = pytester.runpytest(f"--torchperf-not-checked={mode}", "-p", "no:cacheprovider", "-v")
    verbose.stdout.fnmatch_lines(["PASSED  test_inference.py::test_inference (ran no training: nothing to watch)"])


#: A conftest that breaks on_device's verdict (a torchperf bug, as an internal error would be): the test trains,
#: and a default invariant could not be checked.
BROKEN_ON_DEVICE = """
    import pytest
    from pytest_torchperf.invariants.on_device import DevicePlacementCheck

    @pytest.fixture(autouse=True)
    def broken_on_device(monkeypatch):
        def result(self):
            raise RuntimeError("simulated torchperf bug")
        monkeypatch.setattr(DevicePlacementCheck, "result", result)
"""

TRAINS = """
    import pytest
    import torch

    @pytest.mark.torchperf
    def test_trains():
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.ones(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
"""


@pytest.mark.parametrize("mode", ["warn", "fail", "pass"])
def test_a_test_that_trained_but_could_not_be_checked_warns_fails_or_passes(
    pytester: pytest.Pytester, mode: str
) -> None:
    pytester.makeconftest(BROKEN_ON_DEVICE)
    pytester.makepyfile(test_trains=TRAINS)
    result = pytester.runpytest(f"--torchperf-not-checked={mode}", "-p", "no:cacheprovider")
    if mode == "fail":
        result.assert_outcomes(failed=1)
        result.stdout.fnmatch_lines(["*on_device not checked (torchperf internal error in check on_device*"])
    else:
        result.assert_outcomes(passed=1, warnings=1 if mode == "warn" else 0)
        result.stdout.fnmatch_lines(["*1 test with default invariants not checked*"])
    result.stdout.no_fnmatch_line("*ran no training*")
    if mode == "warn":
        result.stdout.fnmatch_lines(["*NotCheckedWarning: torchperf: *test_trains*simulated torchperf bug*"])
    if mode != "fail":
        verbose = pytester.runpytest(f"--torchperf-not-checked={mode}", "-p", "no:cacheprovider", "-v")
        verbose.stdout.fnmatch_lines([
            "*test_trains (not checked: on_device)*",
            "*on_device: not checked (torchperf internal error in check on_device: RuntimeError: simulated*",
        ])


def test_under_report_only_fail_warns_and_under_w_error_the_warning_fails_the_test(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(BROKEN_ON_DEVICE)
    pytester.makepyfile(test_trains=TRAINS)
    reported = pytester.runpytest("--torchperf-not-checked=fail", "--torchperf-report-only", "-p", "no:cacheprovider")
    reported.assert_outcomes(passed=1, warnings=1)
    strict = pytester.runpytest("-W", "error::pytest_torchperf.NotCheckedWarning", "-p", "no:cacheprovider")
    strict.assert_outcomes(failed=1)
    strict.stdout.fnmatch_lines(["*NotCheckedWarning: torchperf: test_trains.py::test_trains: on_device not checked*"])
    strict.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_the_not_checked_option_and_its_ini_twin_are_validated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    result = pytester.runpytest("--torchperf-not-checked=warns")
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*--torchperf-not-checked*must be one of warn, fail, pass, got 'warns'*did you mean*"])
    pytester.makeini("[pytest]\ntorchperf_not_checked = fial\n")
    result = pytester.runpytest()
    assert result.ret != 0
    result.stderr.fnmatch_lines(["*ini option torchperf_not_checked must be one of warn, fail, pass, got 'fial'*"])


def test_the_ini_twin_sets_the_action(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\ntorchperf_not_checked = fail\n")
    pytester.makeconftest(BROKEN_ON_DEVICE)
    pytester.makepyfile(test_trains=TRAINS)
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    # A clean message: no traceback of the plugin, no chained exception.
    result.stdout.no_fnmatch_line("*During handling of the above exception*")
    result.stdout.no_fnmatch_line("*pytest_torchperf/*.py*")
