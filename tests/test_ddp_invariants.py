"""``no_unused_parameters_search`` and ``no_sync_accumulation``: DDP's own traps, on CPU with gloo.

These run DistributedDataParallel in the test's own process, in a gloo group of
one rank (the probe reads DDP's decisions, which do not depend on the world
size); ``test_ranks.py`` runs both with two real ranks under Lightning.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from step_check_helpers import OFF, report_of
from torch.nn.parallel import DistributedDataParallel as DDP

from pytest_torchperf import parse_options, step, watch
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED, Report


class Net(torch.nn.Module):
    def __init__(self, spare: bool = False) -> None:
        super().__init__()
        self.encoder = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.spare = torch.nn.Linear(8, 1) if spare else None  # never called in forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.encoder(x)))


def fit(make: Any, steps: int = 3, accumulate: int = 1, no_sync: bool = False, **options: Any) -> Report:
    """Train ``make()`` (built inside the watch, as a Lightning strategy or a rank would) under ``options``."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(steps * accumulate)]

    def body() -> Any:
        with watch(**{**OFF, **options}) as run:
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for s in range(steps):
                with step():
                    for m in range(accumulate):
                        quiet = no_sync and m < accumulate - 1
                        with model.no_sync() if quiet else torch.enable_grad():  # type: ignore[operator]
                            model(batches[s * accumulate + m]).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
        return run

    return report_of(body)


def test_both_are_off_by_default_and_validated_from_the_registry() -> None:
    enabled = parse_options({}).enabled_checks
    assert "no_unused_parameters_search" not in enabled and "no_sync_accumulation" not in enabled
    with pytest.raises(ValueError, match="did you mean 'no_sync_accumulation'"):
        parse_options({"no_sync_acumulation": True})
    with pytest.raises(ValueError, match="no_unused_parameters_search must be True or False"):
        parse_options({"no_unused_parameters_search": "yes"})


# -- no_unused_parameters_search -------------------------------------------------------------


def test_a_search_that_never_finds_an_unused_parameter_fails(group: None) -> None:
    report = fit(lambda: DDP(Net(), find_unused_parameters=True), no_unused_parameters_search=True)
    check = report["no_unused_parameters_search"]
    assert check.status == FAILED
    assert check.summary == "find_unused_parameters=True, but all 4 parameters got a gradient in all 3 iterations"
    (finding,) = check.findings
    assert finding.sites[0].label == "DDP built with find_unused_parameters=True"
    assert (
        finding.sites[0].frame.source
        == "report = fit(lambda: DDP(Net(), find_unused_parameters=True), no_unused_parameters_search=True)"
    )
    assert "drop find_unused_parameters=True" in finding.hint
    assert check.figures["modules"][0]["unused_parameters"] == []


def test_a_needed_search_passes_and_names_the_unused_parameters(group: None) -> None:
    check = fit(lambda: DDP(Net(spare=True), find_unused_parameters=True), no_unused_parameters_search=True)[
        "no_unused_parameters_search"
    ]
    assert check.status == PASSED
    assert check.summary == "the search is needed: 2 parameters went without a gradient"
    (note,) = check.findings
    assert "spare.weight (never), spare.bias (never)" in note.title
    assert check.figures["modules"][0]["unused_parameters"] == ["spare.weight", "spare.bias"]


def test_no_search_passes_and_no_ddp_is_not_checked(group: None) -> None:
    assert fit(lambda: DDP(Net()), no_unused_parameters_search=True)["no_unused_parameters_search"].status == PASSED
    plain = fit(Net, no_unused_parameters_search=True)["no_unused_parameters_search"]
    assert plain.status == NOT_CHECKED
    assert plain.summary == "no DistributedDataParallel forward pass in this process"


# -- no_sync_accumulation --------------------------------------------------------------------


def test_accumulation_that_all_reduces_every_micro_batch_fails(group: None) -> None:
    check = fit(lambda: DDP(Net()), accumulate=4, no_sync_accumulation=True)["no_sync_accumulation"]
    assert check.status == FAILED
    assert check.summary == "12 all-reduce rounds for 3 optimizer steps, up to 4 per step: 9 not needed"
    assert check.count == 9
    assert check.figures["micro_batches"] == 12 and check.figures["gradient_bytes_per_round"] == (8 * 8 + 8 + 8 + 1) * 4
    (finding,) = check.findings
    assert finding.sites[0].frame.source == "model(batches[s * accumulate + m]).pow(2).mean().backward()"
    assert finding.hint.startswith(
        "run the forward and backward of every micro-batch but the last under `with model.no_sync():`"
    )


def test_accumulation_under_no_sync_and_plain_steps_pass(group: None) -> None:
    check = fit(lambda: DDP(Net()), accumulate=4, no_sync=True, no_sync_accumulation=True)["no_sync_accumulation"]
    assert check.status == PASSED
    assert check.summary == "at most 1 all-reduce per optimizer step over 3 steps (4 micro-batches each)"
    assert check.figures["all_reduce_rounds"] == 3
    plain = fit(lambda: DDP(Net()), no_sync_accumulation=True)["no_sync_accumulation"]
    assert (plain.status, plain.summary) == (
        PASSED,
        "at most 1 all-reduce per optimizer step over 3 steps (1 micro-batch each)",
    )


def test_forwards_without_gradients_are_no_micro_batches(group: None) -> None:
    model = DDP(Net())
    with watch(**OFF, no_sync_accumulation=True) as run:
        with torch.no_grad():
            model(torch.randn(4, 8))
    check = run.report["no_sync_accumulation"]  # type: ignore[index]
    assert check.status == NOT_CHECKED
    assert check.figures["ddp_forwards"] == 1 and check.figures["micro_batches"] == 0


def test_a_ddp_built_before_the_watch_is_shown_where_it_runs(group: None) -> None:
    model = DDP(Net(), find_unused_parameters=True)
    report = fit(lambda: model, no_unused_parameters_search=True)
    (finding,) = report["no_unused_parameters_search"].findings
    assert finding.sites[0].label == "first forward of the DDP built with find_unused_parameters=True"
    assert finding.sites[0].frame.source == "model(batches[s * accumulate + m]).pow(2).mean().backward()"


def test_the_probe_is_removed_with_the_watch(group: None) -> None:
    from torch._C._distributed_c10d import Reducer

    forward, prepare = DDP.forward, Reducer.prepare_for_backward
    with watch(**OFF, no_sync_accumulation=True):
        assert DDP.forward is not forward and Reducer.prepare_for_backward is not prepare
    assert DDP.forward is forward and Reducer.prepare_for_backward is prepare


@pytest.mark.skipif(
    not torch.cuda.is_available() or not dist.is_nccl_available(), reason="needs a CUDA device and NCCL"
)
def test_on_cuda_with_nccl_the_checks_see_the_same_and_add_no_sync(tmp_path: Any) -> None:
    import warnings

    dist.init_process_group("nccl", rank=0, world_size=1, init_method=f"file://{tmp_path / 'store'}")
    try:
        torch.manual_seed(0)
        batches = [torch.randn(4, 8, device="cuda") for _ in range(8)]

        def steps(model: Any) -> list[str]:
            """Two micro-batches per step; the synchronising operations torch reports after the first step."""
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            seen: list[str] = []
            for s in range(4):
                if s == 1:
                    torch.cuda.set_sync_debug_mode("warn")
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    for m in range(2):
                        model(batches[2 * s + m]).pow(2).mean().backward()
                    opt.step()
                    opt.zero_grad()
                seen += [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            torch.cuda.set_sync_debug_mode("default")
            return seen

        unwatched = steps(DDP(Net().cuda(), find_unused_parameters=True))
        watched: list[str] = []

        def body() -> Any:
            with watch(**OFF, no_unused_parameters_search=True, no_sync_accumulation=True) as run:
                watched.extend(steps(DDP(Net().cuda(), find_unused_parameters=True)))
            return run

        report = report_of(body)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        dist.destroy_process_group()
    assert len(watched) == len(unwatched), (watched, unwatched)  # the device-side fold adds no sync
    assert (
        report["no_sync_accumulation"].summary
        == "8 all-reduce rounds for 4 optimizer steps, up to 2 per step: 4 not needed"
    )
    assert report["no_unused_parameters_search"].status == FAILED
