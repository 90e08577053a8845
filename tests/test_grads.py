"""``grads_set_to_none``: gradients cleared by setting them to None, not by zeroing them in place."""

from __future__ import annotations

import pytest
import torch
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED


def test_lightning_optimizer_zero_grad_override_fails_at_its_line(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        class KeepsGrads(TinyModule):
            def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
                optimizer.zero_grad(set_to_none=False)

        @pytest.mark.torchperf(grads_set_to_none=True)
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(KeepsGrads(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: grads_set_to_none (8 zero_grad(set_to_none=False))*",
            "*torchperf: grads_set_to_none*",
            "zero_grad(set_to_none=False) called 8 times",
            "  gradients were reused (zeroed in place, not freed) in * of 8 optimizer steps, up to 2 parameters per "
            "step",
            "  SGD.zero_grad(set_to_none=False) (8x) at test_fit.py:6 in optimizer_zero_grad [[]your code[]]",
            "      optimizer.zero_grad(set_to_none=False)",
            "*",
            "  hint: call zero_grad() with the default set_to_none=True*",
        ],
        consecutive=False,
    )


def _manual_zero(model, optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.zero_()


def _data_zero(model, optimizer) -> None:
    for p in model.parameters():
        if p.grad is not None:
            p.grad.data.zero_()


def _module_zero_grad(model, optimizer) -> None:
    model.zero_grad(set_to_none=False)


@pytest.mark.parametrize(
    "zero, source",
    [
        (_manual_zero, "p.grad.zero_()"),
        (_data_zero, "p.grad.data.zero_()"),
    ],
)
def test_manual_zeroing_is_caught_at_its_line(zero, source: str) -> None:
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader(), zero=zero), grads_set_to_none=True)[
        "grads_set_to_none"
    ]
    assert check.status == FAILED
    # Two parameters, zeroed before each of the 9 steps that follow the first one.
    assert check.figures["grads_zeroed_in_place"] == 18
    assert check.figures["steps_reusing_grads"] == 9
    assert check.summary == "18 .grad.zero_()"
    (finding,) = check.findings
    assert finding.title == ".grad.zero_() called 18 times on parameter gradients"
    assert finding.facts[0] == "gradient shapes: 1, 1x8"
    (site,) = finding.sites
    assert site.frame is not None and site.frame.source == source and site.count == 18


def test_module_zero_grad_keeping_the_tensors_is_caught() -> None:
    check = report_of(
        lambda run: train(run, torch.nn.Linear(8, 1), loader(), zero=_module_zero_grad), grads_set_to_none=True
    )["grads_set_to_none"]
    assert check.status == FAILED
    assert check.findings[0].sites[0].label == "Linear.zero_grad(set_to_none=False)"
    assert check.figures["grads_zeroed_in_place"] == 0  # zero_grad's own zeroing is not counted twice


def test_zeroing_no_probe_sees_is_caught_by_the_reused_gradients() -> None:
    def scale_to_zero(model, optimizer) -> None:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(0)

    check = report_of(
        lambda run: train(run, torch.nn.Linear(8, 1), loader(), zero=scale_to_zero), grads_set_to_none=True
    )["grads_set_to_none"]
    assert check.status == FAILED
    assert check.summary == "gradients reused in 9 optimizer steps"
    (finding,) = check.findings
    assert finding.title == "the same gradient tensors were consumed by 9 of 10 optimizer steps"
    assert finding.sites[0].frame.source == "optimizer.step()"


def test_set_to_none_passes_in_a_loop_and_in_a_lightning_fit(tmp_path) -> None:
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader()), grads_set_to_none=True)[
        "grads_set_to_none"
    ]
    assert check.status == PASSED
    assert check.summary == "10 optimizer steps, gradients set to None between them"
    check = report_of(lambda run: trainer(tmp_path).fit(Regressor(), loader(), loader()), grads_set_to_none=True)[
        "grads_set_to_none"
    ]
    assert check.status == PASSED, check.summary
    assert check.figures["steps_reusing_grads"] == 0


def test_zeroing_other_tensors_is_not_a_gradient() -> None:
    class WithBuffer(torch.nn.Linear):
        def __init__(self) -> None:
            super().__init__(8, 1)
            self.register_buffer("scratch", torch.ones(8))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.scratch.zero_()
            return super().forward(x + self.scratch)

    check = report_of(lambda run: train(run, WithBuffer(), loader()), grads_set_to_none=True)["grads_set_to_none"]
    assert check.status == PASSED
    assert check.figures["grads_zeroed_in_place"] == 0


def test_compiled_code_calling_zero_is_not_recompiled_by_the_probe() -> None:
    """The Tensor.zero_ wrapper must stay invisible to dynamo (no guard on torchperf's state)."""
    import torch._dynamo

    buffer = torch.ones(4)

    @torch.compile(backend="eager")
    def reset(x: torch.Tensor) -> torch.Tensor:
        buffer.zero_()
        return x + buffer

    try:
        reset(torch.ones(4))  # compiled outside any run
        report = report_of(
            lambda run: [reset(torch.ones(4)) for _ in range(3)], grads_set_to_none=True, no_recompiles=True
        )
        assert report["no_recompiles"].figures["recompiles"] == 0
        # No optimizer step in the run: nothing to judge, and no probe error either.
        assert report["grads_set_to_none"].status == NOT_CHECKED
        assert report["grads_set_to_none"].summary.startswith("no optimizer step in the run")
        reset(torch.ones(4))
    finally:
        torch._dynamo.reset()


def test_gradient_accumulation_is_not_reuse(tmp_path) -> None:
    """Accumulating over batches adds into the same gradients between steps, then clears them: correct."""
    check = report_of(
        lambda run: trainer(tmp_path, accumulate_grad_batches=2).fit(Regressor(), loader(n=64), loader()),
        grads_set_to_none=True,
    )["grads_set_to_none"]
    assert check.status == PASSED, check.summary
    assert check.figures["optimizer_steps"] == 8  # 2 epochs x 8 batches / 2
    assert check.figures["steps_reusing_grads"] == 0
