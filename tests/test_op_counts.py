"""``max_ops_per_step``: the ATen ops of a training step, counted exactly, against a budget or the baseline.

Real training steps on CPU: plain loops marked with ``run.step()``, a
Lightning fit (its train batches are the steps), and pytest sessions with
``--torchperf-baseline`` (made, then compared; under ``-n 2`` too).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from step_check_helpers import OFF, report_of, write_module

from pytest_torchperf import parse_options, stacks, watch
from pytest_torchperf.glue.baseline import compare, observe
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED, Report

EMA = """
import torch


class EMA:
    def __init__(self, model, decay=0.99):
        self.decay = decay
        self.shadow = [p.detach().clone() for p in model.parameters()]

    @torch.no_grad()
    def update(self, model):
        for e, p in zip(self.shadow, model.parameters()):
            e.lerp_(p, 1 - self.decay)  # HERE
"""


def train(steps: int = 5, foreach: bool = True, ema: Any = None, **options: Any) -> Report:
    """AdamW on a 2-layer MLP (4 parameters), one ``run.step()`` per batch; ``ema``: updated every step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    average = ema(model) if ema is not None else None
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps)]

    def body() -> Any:
        with watch(**{**OFF, **options}) as run:
            for x, y in data:
                with run.step():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if average is not None:
                        average.update(model)
        return run

    return report_of(body)


def test_off_by_default_and_validated() -> None:
    assert "max_ops_per_step" not in parse_options({}).enabled_checks
    assert parse_options({"max_ops_per_step": "baseline"}).max_ops_per_step == "baseline"
    with pytest.raises(ValueError, match="max_ops_per_step must be an integer >= 0.*did you mean 'baseline'"):
        parse_options({"max_ops_per_step": "baselin"})
    with pytest.raises(ValueError, match="max_ops_per_step must be an integer >= 0"):
        parse_options({"max_ops_per_step": -1})
    with pytest.raises(ValueError, match="count_warmup_steps must be an integer >= 0"):
        parse_options({"max_ops_per_step": 10, "count_warmup_steps": None})


def test_foreach_false_breaks_a_budget_that_foreach_true_keeps() -> None:
    fused = train(foreach=True, max_ops_per_step=60)["max_ops_per_step"]
    looped = train(foreach=False, max_ops_per_step=60)["max_ops_per_step"]
    assert fused.status == PASSED, fused.summary
    assert looped.status == FAILED
    ops_fused, ops_looped = fused.figures["ops"], looped.figures["ops"]
    # AdamW's per-parameter update: one lerp_ per parameter, against one _foreach_lerp_ for all 4.
    assert ops_looped["cpu:aten::lerp_"] == 4.0 and "cpu:aten::lerp_" not in ops_fused
    assert ops_fused["cpu:aten::_foreach_lerp_"] == 1.0
    # The backward is in the step: its ops are counted.
    assert ops_fused["cpu:aten::threshold_backward"] == 1.0
    assert looped.figures["counted_steps"] == 3 and looped.figures["steps_seen"] == 5  # 2 warm-up steps
    assert looped.summary.startswith(f"{looped.figures['worst_step_ops']} ATen ops in one step, max_ops_per_step=60")
    hints = {f.title.split(": ")[0]: f.hint for f in looped.findings}
    assert "foreach=True" in hints["aten::add_"] and "fused=True" in hints["aten::add_"]


def test_counts_are_the_same_on_every_run() -> None:
    counts = [train(max_ops_per_step=10_000)["max_ops_per_step"].figures["ops"] for _ in range(5)]
    assert all(c == counts[0] for c in counts)
    assert sum(counts[0].values()) > 20


def test_a_per_parameter_ema_loop_fails_against_the_baseline_at_its_line(tmp_path: Path) -> None:
    stacks.set_display_root(str(tmp_path))
    module, line = write_module(tmp_path, "ema_loop", EMA)
    before = observe(train(max_ops_per_step="baseline"))
    after = observe(train(ema=module.EMA, max_ops_per_step="baseline"))
    comparison = compare(after, before)
    failing = {m.observation.function: m for m in comparison.failing}
    assert set(failing) == {"aten::lerp_"}, comparison.lines()
    match = failing["aten::lerp_"]
    assert match.status == "new"
    assert match.describe() == (
        f"new: max_ops_per_step: aten::lerp_ on cpu: 0 -> 4 per step, from ema_loop.py:{line} in update "
        "(not in the baseline)"
    )
    # The report names the loop and the fix.
    check = train(ema=module.EMA, max_ops_per_step=10)["max_ops_per_step"]
    (lerp,) = [f for f in check.findings if f.title.startswith("aten::lerp_:")]
    assert lerp.sites[0].frame.lineno == line
    assert "torch._foreach_lerp_" in lerp.hint and f"ema_loop.py:{line}" in lerp.hint


def test_shrunk_counts_are_reported_lower_and_grown_ones_higher(tmp_path: Path) -> None:
    stacks.set_display_root(str(tmp_path))
    module, line = write_module(tmp_path, "ema_twice", EMA)
    with_ema = observe(train(foreach=False, ema=module.EMA, max_ops_per_step="baseline"))
    without = observe(train(foreach=False, max_ops_per_step="baseline"))
    comparison = compare(without, with_ema)  # the EMA removed, against the baseline made with it
    assert not comparison.failing, comparison.lines()
    (lower,) = [m for m in comparison.known if m.lower]
    assert lower.describe().startswith("lower: max_ops_per_step: aten::lerp_ on cpu: 8 -> 4 per step, from ")
    assert lower.describe().endswith("(--torchperf-baseline-update lowers the baseline)")
    again = compare(with_ema, without)  # the EMA added back: grew
    (higher,) = again.failing
    assert higher.status == "higher"
    assert higher.describe() == (
        f"higher: max_ops_per_step: aten::lerp_ on cpu: 4 -> 8 per step, from ema_twice.py:{line} in update"
    )
    # Any op that is new, or gone, counts: foreach=True against a foreach=False baseline names the new ops.
    fused = compare(observe(train(foreach=True, max_ops_per_step="baseline")), without)
    assert {m.observation.function for m in fused.failing} >= {"aten::_foreach_lerp_", "aten::_foreach_addcdiv_"}
    assert {e.function for e in fused.stale} >= {"aten::lerp_", "aten::addcdiv_"}


def test_count_steps_counts_the_first_steps_after_the_warm_up_only() -> None:
    every = train(steps=8, max_ops_per_step=10_000)["max_ops_per_step"]
    first = train(steps=8, max_ops_per_step=10_000, count_steps=2)["max_ops_per_step"]
    assert every.figures["counted_steps"] == 6 and first.figures["counted_steps"] == 2
    assert first.figures["ops"] == every.figures["ops"]  # the same per-step counts


def test_a_run_of_warm_up_steps_only_is_not_checked() -> None:
    check = train(steps=2, max_ops_per_step=10)["max_ops_per_step"]
    assert check.status == NOT_CHECKED
    assert check.summary == "no training step counted: 2 steps seen, the first 2 are warm-up (count_warmup_steps)"
    assert train(steps=2, max_ops_per_step=10, count_warmup_steps=0)["max_ops_per_step"].figures["counted_steps"] == 2


def test_nothing_is_counted_outside_steps_and_the_mode_is_gone_after() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    with watch(**OFF, max_ops_per_step=10_000, count_warmup_steps=0) as run:
        for _ in range(3):
            torch.ones(3).sum()  # outside any step
            with run.step():
                torch.ones(3).add(1)
                assert _get_current_dispatch_mode() is not None
            assert _get_current_dispatch_mode() is None
    ops = run.report["max_ops_per_step"].figures["ops"]
    assert ops == {"cpu:aten::add": 1.0, "cpu:aten::ones": 1.0}
    assert _get_current_dispatch_mode() is None


LIGHTNING_TEST = '''
import pytest
import torch
from torchperf_models import TinyModule, make_loader, make_trainer


class Model(TinyModule):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.01, foreach={foreach})


@pytest.mark.torchperf(max_ops_per_step="baseline", no_host_sync=False)
def test_fit(tmp_path):
    torch.manual_seed(0)
    make_trainer(tmp_path, max_epochs=1, limit_val_batches=0).fit(Model(), make_loader(num_workers=0))
'''


def _lightning_suite(pytester: pytest.Pytester, user_models: Any, foreach: bool) -> None:
    pytester.makepyfile(test_fit=LIGHTNING_TEST.format(foreach=foreach))


def test_lightning_adamw_foreach_false_fails_against_the_foreach_true_baseline(
    pytester: pytest.Pytester, user_models: Any
) -> None:
    _lightning_suite(pytester, user_models, foreach=True)
    made = pytester.runpytest("--torchperf-baseline=perf.json", "--torchperf-baseline-update", "-p", "no:randomly")
    made.assert_outcomes(passed=1)
    entries = json.loads((pytester.path / "perf.json").read_text())["tests"]["test_fit.py::test_fit"]
    by_op = {e["function"]: e for e in entries}
    assert by_op["aten::_foreach_lerp_"]["per_step"] == 1.0 and by_op["aten::_foreach_lerp_"]["source"] == "cpu"
    same = pytester.runpytest("--torchperf-baseline=perf.json")
    same.assert_outcomes(passed=1)
    _lightning_suite(pytester, user_models, foreach=False)
    result = pytester.runpytest("--torchperf-baseline=perf.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines([
        "*new: max_ops_per_step: aten::lerp_ on cpu: 0 -> 2 per step, from *(not in the baseline)*",
        "*new: max_ops_per_step: aten::addcdiv_ on cpu: 0 -> 2 per step*",
    ])
    assert "hint: the optimizer runs one op per parameter: build it with foreach=True" in result.stdout.str()


XDIST_TEST = '''
import pytest
import torch


def step_loop(run, width):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(width, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    for _ in range(4):
        with run.step():
            model(torch.randn(4, width)).sum().backward()
            opt.step()
            opt.zero_grad()


@pytest.mark.parametrize("width", [4, 8])
def test_counts(torchperf, width):
    with torchperf.watch(max_ops_per_step="baseline", no_host_sync=False) as run:
        step_loop(run, width)
'''


@pytest.mark.slow
def test_five_runs_and_an_xdist_run_give_the_baseline_s_counts(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_counts=XDIST_TEST)
    pytester.runpytest("--torchperf-baseline=perf.json", "--torchperf-baseline-update").assert_outcomes(passed=2)
    written = (pytester.path / "perf.json").read_text()
    for _ in range(4):  # five sessions in all, each rewriting the file: the same text every time
        pytester.runpytest("--torchperf-baseline=perf.json", "--torchperf-baseline-update").assert_outcomes(passed=2)
        assert (pytester.path / "perf.json").read_text() == written
    result = pytester.runpytest_subprocess("--torchperf-baseline=perf.json", "-n", "2", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*torchperf baseline *perf.json: * known findings, 0 new or higher, 0 stale*"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts kernel launches of a CUDA step")
def test_a_cuda_run_counts_the_kernel_launches_of_a_step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)).cuda()
    results = {}
    for foreach in (False, True):
        opt = torch.optim.AdamW(model.parameters(), foreach=foreach)
        with watch(**OFF, max_ops_per_step="baseline") as run:
            for _ in range(5):
                with run.step():
                    model(torch.randn(4, 8, device="cuda")).sum().backward()
                    opt.step()
                    opt.zero_grad()
        check = run.report["max_ops_per_step"]
        assert "ops" in check.figures, check.summary  # counted at all: else the summary says why not
        assert "cuda:aten::addmm" in check.figures["ops"]
        results[foreach] = check.figures["kernel_launches_per_step"]
        entries = {(e["function"], e["source"]) for e in check.figures["baseline_counts"]}
        assert ("kernel launches", "cuda") in entries
    assert results[False] > results[True] > 0  # one launch per parameter and op, against one per op


BLOCKS_TEST = '''
import pytest
import torch

ACTIVATIONS = {activations}


class Blocks(torch.nn.Module):
    """Linear + SiLU blocks applied in sequence: each block's output is the next one's input."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            for _ in range(ACTIVATIONS):
                x = torch.nn.functional.silu(x)  # SILU
        return x


def train(run, budget):
    torch.manual_seed(0)
    model = Blocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    for _ in range(4):
        with run.step():
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def test_baseline(torchperf):
    with torchperf.watch(max_ops_per_step="baseline", no_host_sync=False) as run:
        train(run, None)


def test_budget(torchperf):
    with torchperf.watch(max_ops_per_step=40, no_host_sync=False) as run:
        train(run, 40)
'''


def test_the_headline_names_the_ops_that_grew_and_no_batching_for_sequential_blocks(pytester: pytest.Pytester) -> None:
    """A SiLU more per block (AdamW's per-parameter step-counter reads, ``_local_scalar_dense``, the most frequent
    op, unchanged): the baseline's headline and the check's findings lead with the ops that grew, and the SiLU
    line, run once per block in sequence, gets no advice to batch its calls; a budget names no op as the cause."""
    pytester.makepyfile(test_blocks=BLOCKS_TEST.format(activations=1))
    made = pytester.runpytest("--torchperf-baseline=perf.json", "--torchperf-baseline-update", "-k", "baseline")
    made.assert_outcomes(passed=1)
    pytester.makepyfile(test_blocks=BLOCKS_TEST.format(activations=2))
    result = pytester.runpytest("--torchperf-baseline=perf.json", "--torchperf-json=out.json", "-p", "no:randomly")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    doc = json.loads((pytester.path / "out.json").read_text())
    tests = {t["nodeid"].split("::")[-1]: t["runs"][0]["checks"]["max_ops_per_step"] for t in doc["tests"]}
    figures = tests["test_baseline"]["figures"]["ops"]
    assert figures["cpu:aten::_local_scalar_dense"] > figures["cpu:aten::silu"]  # the most frequent did not change
    titles = [f["title"] for f in tests["test_baseline"]["findings"]]
    assert titles == [
        "aten::silu: 8 per step on cpu (baseline: 4 per step)",
        "aten::silu_backward: 8 per step on cpu (baseline: 4 per step)",
    ], titles
    assert "torchperf: 2 findings not in the baseline: max_ops_per_step at aten::silu on cpu (8 per step" in out
    silu = tests["test_baseline"]["findings"][0]
    assert "times a step" in silu["hint"] and "nothing to batch" in silu["hint"]
    assert "once per tensor in a Python loop" not in out
    budget = tests["test_budget"]
    assert re.match(r"\d+ ATen ops in one step, max_ops_per_step=40 \(", budget["summary"]), budget["summary"]
    assert "aten::" not in budget["summary"] and "most" not in budget["summary"]
    budget_titles = [f["title"] for f in budget["findings"]]
    # no fix is known for any op: the most frequent are listed first, the SiLU not promoted by a batching hint
    counts = [float(t.split(": ", 1)[1].split(" per step")[0]) for t in budget_titles]
    assert counts == sorted(counts, reverse=True) and not budget_titles[0].startswith("aten::silu"), budget_titles
