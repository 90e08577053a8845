"""``mixed_precision``: on a GPU, training steps run under autocast or with 16-bit weights.

On a CPU-only machine the verdict is "not applicable"; the CUDA verdict itself
is exercised with the CPU standing in for the accelerator (CPU autocast in
bfloat16 is real), and for real under a CUDA skip.
"""

from __future__ import annotations

import pytest
import torch
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf.invariants import mixed_precision as precision
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture
def cpu_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(precision, "ACCELERATORS", ("cpu",))
    monkeypatch.setattr(precision, "cuda_available", lambda: True)


def _autocast_forward(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(x).float()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only verdict")
def test_not_applicable_on_a_cpu_machine(tmp_path) -> None:
    check = report_of(lambda run: trainer(tmp_path).fit(Regressor(), loader(), loader()), mixed_precision=True)[
        "mixed_precision"
    ]
    assert check.status == NOT_CHECKED
    assert check.summary == "not applicable: no CUDA device on this machine (float32 is the norm on a CPU)"
    assert check.figures["trainer_precision"] == "32-true"
    assert check.figures["steps_on_other_devices"] == 10


def test_float32_lightning_fit_fails_with_the_trainer_hint(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        from pytest_torchperf.invariants import mixed_precision as precision
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf(mixed_precision=True)
        def test_fit(tmp_path, monkeypatch):
            monkeypatch.setattr(precision, "ACCELERATORS", ("cpu",))  # the CPU stands in for CUDA
            monkeypatch.setattr(precision, "cuda_available", lambda: True)
            make_trainer(tmp_path, max_epochs=2).fit(TinyModule(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: mixed_precision (8 float32 optimizer steps on cpu)*",
            "*torchperf: mixed_precision*",
            "8 of 8 optimizer steps on cpu ran in float32 without autocast",
            "  weights: float32 on cpu; no autocast region was entered",
            "  Trainer precision: '32-true'",
            "  float32 optimizer step at pytorch_lightning/*optimizer_step [[]framework code[]]",
            "*",
            "  hint: train with Trainer(precision='bf16-mixed') (Ampere or newer GPUs) or "
            "Trainer(precision='16-mixed').",
        ],
        consecutive=False,
    )


def test_lightning_mixed_precision_passes(tmp_path, cpu_as_accelerator) -> None:
    def body(run) -> None:
        trainer(tmp_path, precision="bf16-mixed").fit(Regressor(), loader(), loader())

    check = report_of(body, mixed_precision=True)["mixed_precision"]
    assert check.status == PASSED, check.summary
    assert check.summary == "10 optimizer steps on cpu: 10 under autocast (bfloat16)"
    assert check.figures["trainer_precision"] == "bf16-mixed"
    assert check.figures["weight_dtypes"] == ["float32"]


def test_plain_loop_without_autocast_fails_at_the_step_with_the_autocast_hint(cpu_as_accelerator) -> None:
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader()), mixed_precision=True)[
        "mixed_precision"
    ]
    assert check.status == FAILED
    (finding,) = check.findings
    assert finding.title == "10 of 10 optimizer steps on cpu ran in float32 without autocast"
    assert finding.sites[0].frame.source == "optimizer.step()"
    assert "torch.autocast('cpu', dtype=torch.bfloat16)" in finding.hint
    assert check.figures["trainer_precision"] is None


def test_plain_loop_under_autocast_or_with_16_bit_weights_passes(cpu_as_accelerator) -> None:
    check = report_of(
        lambda run: train(run, torch.nn.Linear(8, 1), loader(), forward=_autocast_forward), mixed_precision=True
    )["mixed_precision"]
    assert check.status == PASSED
    assert check.figures["mixed_steps"] == 10 and check.figures["autocast_regions"] == 10

    model = torch.nn.Linear(8, 1).to(torch.bfloat16)
    check = report_of(
        lambda run: train(run, model, loader(), forward=lambda m, x: m(x.bfloat16()).float()), mixed_precision=True
    )["mixed_precision"]
    assert check.status == PASSED
    assert check.summary == "10 optimizer steps on cpu: 10 with 16-bit weights"


def test_some_steps_in_float32_fail(cpu_as_accelerator) -> None:
    calls = [0]

    def sometimes(model, x):
        calls[0] += 1
        return _autocast_forward(model, x) if calls[0] % 2 else model(x)

    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader(), forward=sometimes), mixed_precision=True)[
        "mixed_precision"
    ]
    assert check.status == FAILED
    assert check.figures["float32_steps"] == 5 and check.figures["mixed_steps"] == 5
    assert "5 other steps did run in 16 bits" in check.findings[0].facts


def test_autocast_inside_a_compiled_function_is_seen(cpu_as_accelerator) -> None:
    import torch._dynamo

    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(_autocast_forward, backend="eager")
    try:
        check = report_of(
            lambda run: train(run, model, loader(), forward=compiled), mixed_precision=True
        )["mixed_precision"]
    finally:
        torch._dynamo.reset()
    assert check.status == PASSED, check.summary


@needs_cuda
def test_cuda_float32_fails_and_autocast_passes() -> None:
    def body(autocast: bool):
        def run_body(run) -> None:
            model = torch.nn.Linear(8, 1).cuda()

            def forward(m, x):
                with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                    return m(x.cuda()).float()

            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for x, y in loader():
                with run.step():
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(forward(model, x), y.cuda()).backward()
                    optimizer.step()

        return run_body

    assert report_of(body(False), mixed_precision=True)["mixed_precision"].status == FAILED
    assert report_of(body(True), mixed_precision=True)["mixed_precision"].status == PASSED
