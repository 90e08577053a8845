"""``max_overhead`` under a baseline: an inconclusive verdict stays one, a failed one is one entry.

A baseline accepts findings a suite already has; it cannot accept a verdict
that was never reached. And a failed ``max_overhead`` is one finding (at the
``Trainer.fit`` call) with a breakdown of where the time went beside it, not
two findings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pytest_torchperf.glue.baseline import SCHEMA, SCHEMA_VERSION, observe
from pytest_torchperf.report import FAILED, CheckResult, Finding, Report, Site
from pytest_torchperf.stacks import Frame

STRADDLING = """
import itertools


def straddling():
    \"\"\"Epoch times whose ratios to 1.0 s straddle 30% (for rounds=4).\"\"\"
    times = itertools.cycle([1.0, 1.1, 1.5, 1.5, 1.1])
    return lambda: next(times)


def test_unsure(torchperf):
    torchperf.parity(straddling(), lambda: 1.0, max_overhead=0.3, rounds=4)
"""

EMPTY = {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "tests": {}}


def test_the_breakdown_beside_a_failed_overhead_verdict_is_not_a_finding_of_its_own(tmp_path: Path) -> None:
    fit = Frame(str(tmp_path / "test_fit.py"), 12, "test_fit")
    verdict = Finding("Trainer.fit(Tiny): a Lightning epoch took 2 ms against 1 ms", [], [Site("fit called", (fit,))])
    breakdown = Finding("where the extra 1 ms per batch went (4 batches per epoch; ...)", ["..."], [], "hint")
    report = Report(checks={"max_overhead": CheckResult("max_overhead", FAILED, "+90%", 1, [verdict, breakdown])})
    (obs,) = observe(report)
    assert (obs.invariant, obs.function, obs.count) == ("max_overhead", "test_fit", 1)


@pytest.mark.parametrize("update", [False, True], ids=["judged", "written"])
def test_an_inconclusive_verdict_fails_with_an_empty_baseline(pytester: pytest.Pytester, update: bool) -> None:
    pytester.makepyfile(test_unsure=STRADDLING)
    (pytester.path / "baseline.json").write_text(json.dumps(EMPTY))
    args = ["--torchperf-baseline=baseline.json"] + (["--torchperf-baseline-update"] if update else [])
    result = pytester.runpytest(*args)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*torchperf: inconclusive: max_overhead*straddles 30%*"])
    assert json.loads((pytester.path / "baseline.json").read_text())["tests"] == {}
    # Without a baseline it fails alike: the baseline changes nothing about it.
    pytester.runpytest().assert_outcomes(failed=1)


FAR = """
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.torchperf(max_overhead=0.05, no_host_sync=False, on_device=False, no_iterator_reset=False,
                       no_data_parallel=False)
def test_far(tmp_path):
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), loader)
"""


def test_a_failed_overhead_verdict_is_one_baseline_entry_at_the_fit(pytester: pytest.Pytester) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("pytorch_lightning")
    pytester.makepyfile(test_far=FAR)
    pytester.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update").assert_outcomes(passed=1)
    (entries,) = json.loads((pytester.path / "b.json").read_text())["tests"].values()
    found = [(e["invariant"], e["function"], e["file"]) for e in entries]
    assert found == [("max_overhead", "test_far", "test_far.py")]
    pytester.runpytest("--torchperf-baseline=b.json").assert_outcomes(passed=1)  # known: it does not fail
