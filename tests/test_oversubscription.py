"""``no_oversubscription`` (opt-in): main-process threads plus DataLoader workers over the usable cores."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from seed_tips_models import loader, report_of, train

from pytest_torchperf.invariants.no_oversubscription import usable_cores
from pytest_torchperf.options import parse_options
from pytest_torchperf.report import FAILED, PASSED


@pytest.fixture(autouse=True)
def threads_back() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_off_by_default() -> None:
    assert "no_oversubscription" not in parse_options({}).enabled_checks


def test_workers_beside_a_process_using_every_core_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    cores = usable_cores()

    def body(run: Any) -> None:
        torch.set_num_threads(cores)  # every core
        train(run, torch.nn.Linear(8, 1), loader(num_workers=2), epochs=1)

    check = report_of(body, no_oversubscription=True)["no_oversubscription"]
    assert check.status == FAILED
    assert check.summary == f"{cores + 2} CPU threads for {cores} cores"
    (finding,) = check.findings
    assert finding.facts[1] == f"main process: {cores} torch threads (torch.set_num_threads({cores}))" or cores == 1
    assert finding.facts[2] == "DataLoader workers: 2 x 1 thread (torch sets one thread in each worker)"
    assert finding.facts[3].startswith("OMP_NUM_THREADS is not set")
    assert finding.sites[0].frame.source == "torch.set_num_threads(cores)  # every core"
    assert f"torch.set_num_threads({max(cores - 2, 1)})" in finding.hint
    assert check.figures["threads"] == cores + 2


def test_threads_within_the_cores_pass() -> None:
    def body(run: Any) -> None:
        torch.set_num_threads(1)
        train(run, torch.nn.Linear(8, 1), loader(), epochs=1)

    check = report_of(body, no_oversubscription=True)["no_oversubscription"]
    assert check.status == PASSED, check.summary
    assert check.summary == f"1 CPU thread for {usable_cores()} cores" or usable_cores() == 1


@pytest.mark.skipif(usable_cores() < 2, reason="needs two cores")
def test_a_worker_beside_the_cores_it_leaves_passes() -> None:
    cores = usable_cores()

    def body(run: Any) -> None:
        torch.set_num_threads(cores - 1)
        train(run, torch.nn.Linear(8, 1), loader(num_workers=1), epochs=1)

    check = report_of(body, no_oversubscription=True)["no_oversubscription"]
    assert check.status == PASSED, check.summary
    assert check.figures["dataloader_workers"] == 1
