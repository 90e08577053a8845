"""``gpu_settings`` (opt-in): TF32 and cudnn.benchmark, judged for a named GPU on CPU, and on CUDA when there is one."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from seed_tips_models import report_of

from pytest_torchperf.arguments import UsageError
from pytest_torchperf.options import parse_options
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED


def _convnet_steps(batches: Any, steps: int = 4) -> Any:
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 1),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(run: Any) -> None:
        for i in range(steps):
            with run.step():
                optimizer.zero_grad()
                model(batches(i)).sum().backward()
                optimizer.step()

    return body


@pytest.fixture(autouse=True)
def settings_back() -> Any:
    precision, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    yield
    torch.set_float32_matmul_precision(precision)
    torch.backends.cudnn.benchmark = benchmark


def test_off_by_default_and_validated() -> None:
    assert "gpu_settings" not in parse_options({}).enabled_checks
    assert parse_options({"gpu_settings": "Ampere"}).gpu_settings == "ampere"
    with pytest.raises(UsageError, match=r"gpu_settings must be True .* got 'ampre' \(did you mean 'ampere'\?\)"):
        parse_options({"gpu_settings": "ampre"})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU verdict")
def test_on_cpu_without_a_target_it_is_not_applicable() -> None:
    check = report_of(_convnet_steps(lambda i: torch.randn(8, 3, 8, 8)), gpu_settings=True)["gpu_settings"]
    assert check.status == NOT_CHECKED
    assert check.summary.startswith("not applicable: no CUDA device in this run")


def test_ampere_defaults_and_fixed_shapes_fail_on_cpu() -> None:
    check = report_of(_convnet_steps(lambda i: torch.randn(8, 3, 8, 8)), gpu_settings="ampere")["gpu_settings"]
    assert check.status == FAILED
    tf32, benchmark = check.findings
    assert tf32.title == "TF32 is off for float32 matmuls"
    assert tf32.facts[0] == "on an Ampere GPU (gpu_settings='ampere'), which has TF32 tensor cores"
    assert "PyTorch's default" in tf32.facts[1]
    assert "set_float32_matmul_precision('high')" in tf32.hint
    assert benchmark.title == "cudnn.benchmark is False while every step's convolution shapes were identical"
    assert benchmark.facts[0] == (
        "every one of the 4 steps ran its convolutions on the same 1 input shape: [8, 3, 8, 8] float32"
    )
    assert check.figures["steps_with_convolutions"] == 4


def test_the_right_settings_or_changing_shapes_pass() -> None:
    def tuned(run: Any) -> None:
        torch.set_float32_matmul_precision("high")
        torch.backends.cudnn.benchmark = True
        _convnet_steps(lambda i: torch.randn(8, 3, 8, 8))(run)

    check = report_of(tuned, gpu_settings="ampere")["gpu_settings"]
    assert check.status == PASSED, check.summary
    # Volta has no TF32, and shapes that change every step gain nothing from benchmark mode.
    check = report_of(_convnet_steps(lambda i: torch.randn(8, 3, 8 + 4 * i, 8)), gpu_settings="volta")["gpu_settings"]
    assert check.status == PASSED, check.summary


def test_who_set_the_matmul_precision_is_named() -> None:
    def highest(run: Any) -> None:
        torch.set_float32_matmul_precision("highest")  # here
        _convnet_steps(lambda i: torch.randn(8, 3, 8 + i, 8))(run)

    check = report_of(highest, gpu_settings="hopper")["gpu_settings"]
    assert check.status == FAILED
    (finding,) = check.findings
    assert finding.facts[1] == "torch.set_float32_matmul_precision('highest') was called during the run"
    assert finding.sites[0].frame.source == 'torch.set_float32_matmul_precision("highest")  # here'


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_device_is_judged() -> None:
    capability = torch.cuda.get_device_capability()

    def on_gpu(run: Any) -> None:
        torch.set_float32_matmul_precision("highest")
        model = torch.nn.Linear(8, 1).cuda()
        for _ in range(3):
            with run.step():
                model(torch.randn(4, 8, device="cuda")).sum().backward()

    check = report_of(on_gpu, gpu_settings=True)["gpu_settings"]
    assert check.figures["compute_capability"] == list(capability)
    assert check.status == (FAILED if capability >= (8, 0) else PASSED)
