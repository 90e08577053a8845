"""``max_memory_growth``: allocated CUDA memory read at step boundaries; steady growth over the budget fails.

The verdict needs a CUDA device (tests under a skip); the growth arithmetic and
the validation are tested everywhere.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from seed_tips_models import QUIET

from pytest_torchperf import InvariantViolation, UsageError, watch
from pytest_torchperf.invariants._memory import MemoryTrace, format_bytes
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED

NAME = "max_memory_growth"
CUDA = torch.cuda.is_available()


def trace(samples: list[tuple[int, int]]) -> MemoryTrace:
    memory = MemoryTrace()
    memory.samples = list(samples)
    return memory


def test_growth_every_step_is_steady() -> None:
    growth = trace([(step, 1000 + 512 * step) for step in range(1, 13)]).growth()
    assert growth is not None
    assert growth.per_step == 512 and growth.steady
    assert growth.grew_in == list(range(4, 13)) and growth.intervals == 9  # steps 1-2 are the warm-up
    assert growth.describe() == (
        "512 B per step on average, from 2.5 KiB at the end of step 3 to 7.0 KiB at the end of step 12; "
        "it grew in 9 of 9 steps"
    )


def test_a_one_off_allocation_is_no_steady_growth() -> None:
    samples = [(step, 4096 if step < 6 else 4096 + 2**20) for step in range(1, 13)]
    growth = trace(samples).growth()
    assert growth is not None and growth.per_step > 0
    assert growth.grew_in == [6] and not growth.steady


def test_the_warm_up_steps_are_not_judged() -> None:
    assert trace([(1, 0), (2, 10**9), (3, 10**9), (4, 10**9)]).growth() is None  # two boundaries after the warm-up
    growth = trace([(1, 0), (2, 10**9), (3, 10**9), (4, 10**9), (5, 10**9)]).growth()
    assert growth is not None and growth.per_step == 0 and not growth.steady


def test_format_bytes() -> None:
    assert [format_bytes(n) for n in (0, 512, 1536, 3 * 2**20, -2048)] == [
        "0 B",
        "512 B",
        "1.5 KiB",
        "3.0 MiB",
        "-2.0 KiB",
    ]


@pytest.mark.parametrize(
    "value, message",
    [
        (
            -1,
            "max_memory_growth must be an integer >= 0 (bytes of CUDA memory a training step may add) or None, got -1",
        ),
        (1.5, "max_memory_growth must be an integer >= 0"),
        ("1MB", "max_memory_growth must be an integer >= 0"),
        (True, "max_memory_growth must be an integer >= 0"),
    ],
)
def test_bad_budgets_name_the_argument(value: Any, message: str) -> None:
    with pytest.raises(UsageError) as excinfo:
        with watch(max_memory_growth=value):
            pass
    assert message in str(excinfo.value)


def test_a_misspelt_budget_gets_a_suggestion() -> None:
    with pytest.raises(UsageError, match=r"did you mean 'max_memory_growth'"):
        with watch(max_memory_grwoth=0):
            pass


def _loop(device: str, keep: bool, steps: int = 12, **options: Any) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    kept = []
    try:
        with watch(**QUIET, **options) as run:
            for _ in range(steps):
                with run.step():
                    x = torch.randn(32, 64, device=device)
                    loss = model(x).pow(2).mean()
                    if keep:
                        kept.append(x * 2)  # 8 KiB of CUDA memory kept every step
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
    except InvariantViolation as exc:
        return exc.report
    return run.report


@pytest.mark.skipif(CUDA, reason="the CPU verdict")
def test_on_cpu_it_is_not_checked() -> None:
    check = _loop("cpu", keep=True, max_memory_growth=0)[NAME]
    assert check.status == NOT_CHECKED
    assert check.summary == "no CUDA device: allocated memory is only measured on CUDA"
    assert check.figures["cuda_memory_reads"] == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_steady_growth_on_cuda_fails_with_the_steps_it_grew_in() -> None:
    check = _loop("cuda", keep=True, max_memory_growth=1024)[NAME]
    assert check.status == FAILED, check.summary
    assert check.figures["cuda_memory_growth_per_step"] >= 8192
    (finding,) = check.findings
    assert finding.title.startswith("allocated CUDA memory grows by")
    assert any(fact.startswith("steps it grew in: ") for fact in finding.facts)


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_clean_cuda_loop_passes_and_retention_reports_the_figure() -> None:
    report = _loop("cuda", keep=False, max_memory_growth=0, no_graph_retention=True)
    assert report[NAME].status == PASSED, report[NAME].summary
    assert report["no_graph_retention"].figures["cuda_memory_growth_per_step"] == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_cpu_run_on_a_cuda_machine_is_not_checked() -> None:
    check = _loop("cpu", keep=True, max_memory_growth=0)[NAME]
    assert check.status == NOT_CHECKED and check.summary == "nothing was trained on CUDA in the run"
