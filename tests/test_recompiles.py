"""``no_recompiles``: torch.compile'd code is not compiled again after warm-up (eager backend, on CPU)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch._dynamo
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf.invariants.no_recompiles import parse_reason
from pytest_torchperf.report import FAILED, PASSED


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from scratch and leaves no compiled code behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Scaled(torch.nn.Module):
    """Reads a Python int attribute: dynamo specialises on its value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)
        self.level = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (self.level + 1)


@pytest.mark.slow
def test_an_int_attribute_changed_each_epoch_fails_a_lightning_fit(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Scaled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.linear = torch.nn.Linear(8, 1)
                self.level = 0

            def forward(self, x):
                return self.linear(x) * (self.level + 1)

        class Curriculum(TinyModule):
            def __init__(self):
                super().__init__()
                self.scaled = Scaled()
                self.layer = torch.compile(self.scaled, backend="eager")

            def on_train_epoch_start(self):
                self.scaled.level = self.current_epoch

        @pytest.mark.torchperf(no_recompiles=True)
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=3).fit(
                Curriculum(), make_loader(num_workers=0), make_loader(num_workers=0)
            )
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_recompiles (4 recompiles after warm-up)*",
            "*torchperf: no_recompiles*",
            "forward (test_fit.py:11) was compiled again 4 times after warm-up",
            "  recompiled in: epoch 1 (train), epoch 1 (validate), epoch 2 (train), epoch 2 (validate)",
            "  guard that failed: * == 1*(return self.linear(x) * (self.level + 1))",
            "*",
            "  compiled function called (2x) at torchperf_models.py:* in training_step [[]your code[]]",
            "      loss = torch.nn.functional.mse_loss(self.layer(x), y)",
            "*",
            "  hint: dynamo says: torch.compile considers integer attributes of the nn.Module to be static*",
        ],
        consecutive=False,
    )


def test_warm_up_recompiles_of_a_correct_fit_pass(tmp_path) -> None:
    class Compiled(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.compile(self.net, backend="eager")

    check = report_of(
        lambda run: trainer(tmp_path, max_epochs=3).fit(Compiled(), loader(drop_last=True), loader(drop_last=True)),
        no_recompiles=True,
    )["no_recompiles"]
    assert check.status == PASSED, check.summary
    # Sanity check in eval mode, then training (grad mode): the first compile of each mode.
    assert check.figures["recompiles_in_warmup"] >= 1
    assert check.figures["recompiles_after_warmup"] == 0
    assert check.summary.startswith(f"{check.figures['compiles']} compiles, no recompile after warm-up (")


@pytest.mark.slow
def test_recompile_limit_hit_fails_even_in_the_first_epoch() -> None:
    scaled = Scaled()
    compiled = torch.compile(scaled, backend="eager")

    def body(run) -> None:
        optimizer = torch.optim.SGD(scaled.parameters(), lr=0.01)
        for x, y in loader(n=96):  # one epoch of 12 steps: all of it is warm-up
            with run.step():
                scaled.level += 1
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(compiled(x), y).backward()
                optimizer.step()

    check = report_of(body, no_recompiles=True)["no_recompiles"]
    limit = torch._dynamo.config.recompile_limit
    assert check.status == FAILED
    # The first epoch is no warm-up: each change of the attribute is a recompile.
    assert check.summary == f"{limit - 1} recompiles after warm-up, 1 recompile limit hit"
    assert check.figures["recompile_limit_hits"] == 1
    assert check.figures["recompiles_after_warmup"] == limit - 1
    (finding,) = check.findings
    assert finding.title == (
        f"forward (tests/test_recompiles.py:{Scaled.forward.__code__.co_firstlineno}) was compiled again "
        f"{limit - 1} times after warm-up, then hit "
        f"torch._dynamo.config.recompile_limit ({limit}) after {limit - 1} recompiles: "
        "it runs uncompiled from then on"
    )
    assert check.figures["recompiles"] == limit - 1
    assert finding.facts[0].startswith("recompiled in: epoch 0 (step ")
    assert "level" in finding.facts[1]
    assert finding.sites[0].frame.source == "torch.nn.functional.mse_loss(compiled(x), y).backward()"


@pytest.mark.slow
def test_a_plain_loop_s_ragged_last_batch_fails_in_the_first_epoch_and_drop_last_passes() -> None:
    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(model, backend="eager")
    check = report_of(
        lambda run: train(run, model, loader(), epochs=3, forward=lambda m, x: compiled(x)), no_recompiles=True
    )["no_recompiles"]
    assert check.status == FAILED, check.summary
    assert check.summary == "1 recompile after warm-up"
    assert check.figures["ragged_batch_recompiles"] == 1  # the last batch of 4, once: then dynamic
    (finding,) = check.findings
    assert finding.facts[0] == "recompiled in: epoch 0 (step 5)"
    assert finding.facts[1].startswith("a smaller batch: 4 rows where the compiled code expected 8")
    assert "size mismatch at index 0. expected 8, actual 4" in finding.facts[2]
    assert finding.hint.startswith("drop the ragged last batch (DataLoader(..., drop_last=True))")
    assert "dynamic=True" in finding.hint and "mark_dynamic" in finding.hint

    torch._dynamo.reset()
    check = report_of(
        lambda run: train(run, model, loader(drop_last=True), epochs=3, forward=lambda m, x: compiled(x)),
        no_recompiles=True,
    )["no_recompiles"]
    assert check.status == PASSED, check.summary
    assert check.figures["warmup"] == "the first compile of each mode (grad mode, autocast, train/eval)"


def test_recompile_warmup_steps_narrows_the_warm_up() -> None:
    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(model, backend="eager")
    check = report_of(
        lambda run: train(run, model, loader(), epochs=2, forward=lambda m, x: compiled(x)),
        no_recompiles=True,
        recompile_warmup_steps=2,
    )["no_recompiles"]
    assert check.status == FAILED
    assert check.summary == "1 recompile after warm-up"
    (finding,) = check.findings
    assert finding.facts[0] == "recompiled in: step 5"  # the last, smaller batch
    assert finding.facts[2].startswith("guard that failed: tensor ") and "size mismatch" in finding.facts[2]
    assert check.figures["warmup"] == "the first 2 training steps"


def test_nothing_compiled_passes_and_says_so() -> None:
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader()), no_recompiles=True)["no_recompiles"]
    assert check.status == PASSED
    assert check.summary == "no torch.compile compilation during the run"


@pytest.mark.parametrize(
    "reason, expected",
    [
        (
            "0/7: s.counter == 5                    # return x * s.counter  # m.py:26 in forward "
            "(HINT: make it a tensor.)\nUser stack trace:\n  File ...",
            ("s.counter == 5", "return x * s.counter", "make it a tensor."),
        ),
        (
            "0/0: tensor 'x' size mismatch at index 0. expected 8, actual 4",
            ("tensor 'x' size mismatch at index 0. expected 8, actual 4", "", ""),
        ),
        ("GLOBAL_STATE changed: grad_mode ", ("GLOBAL_STATE changed: grad_mode", "", "")),
        ("", ("", "", "")),
    ],
)
def test_guard_failure_reasons_are_parsed(reason: str, expected: tuple) -> None:
    assert parse_reason(reason) == expected


@pytest.mark.slow
def test_dynamo_imported_for_the_first_time_during_the_run_is_watched(pytester: pytest.Pytester) -> None:
    """In a fresh interpreter torch._dynamo is imported by the first torch.compile, inside the watched test."""
    pytester.makepyfile(
        """
        import sys
        import pytest
        import torch

        class Scaled(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.level = 0

            def forward(self, x):
                return x * (self.level + 1)

        def test_compile_inside(torchperf):
            assert "torch._dynamo" not in sys.modules
            module = Scaled()
            with torchperf.watch(no_recompiles=True, recompile_warmup_steps=0) as run:
                compiled = torch.compile(module, backend="eager")
                for level in range(3):
                    with run.step():
                        module.level = level
                        compiled(torch.ones(2))
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*no_recompiles (2 recompiles after warm-up)*", "*guard that failed: *level*"])
