"""``max_collectives_per_step``, ``no_constant_buffer_broadcast`` and FSDP2 under ``no_sync_accumulation``.

The fast tests run in the test's own process, in a gloo group of one rank
(what the probes count does not depend on the world size); the slow ones run
2 real ranks (``torch.multiprocessing.spawn`` and Lightning's ``ddp_spawn``)
in a fresh pytest and read the merged report.
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


class Masked(torch.nn.Module):
    """A linear layer behind a constant causal mask (a buffer), and optionally a BatchNorm (buffers that change)."""

    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.register_buffer("mask", torch.ones(8, 8).tril())
        self.norm = torch.nn.BatchNorm1d(8) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x @ self.mask
        return self.layer(self.norm(x) if self.norm is not None else x)


def fit(make: Any, steps: int = 6, every: int = 0, **options: Any) -> Report:
    """Train ``make()`` (built inside the watch); ``every``: a user all_reduce every N steps (0: never)."""
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(steps)]

    def body() -> Any:
        with watch(**{**OFF, **options}) as run:
            model = make()
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for i, x in enumerate(batches):
                with step():
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    if every and i % every == 0:
                        dist.all_reduce(loss.detach())  # SYNC
        return run

    return report_of(body)


def test_off_by_default_and_validated() -> None:
    enabled = parse_options({}).enabled_checks
    assert "max_collectives_per_step" not in enabled and "no_constant_buffer_broadcast" not in enabled
    with pytest.raises(ValueError, match="max_collectives_per_step must be an integer >= 0"):
        parse_options({"max_collectives_per_step": 1.5})
    with pytest.raises(ValueError, match="did you mean 'no_constant_buffer_broadcast'"):
        parse_options({"no_constant_buffer_broadcasts": True})


def test_a_user_all_reduce_every_step_breaks_the_budget_at_its_line(group: None) -> None:
    check = fit(lambda: DDP(torch.nn.Linear(8, 1)), every=1, max_collectives_per_step=1)["max_collectives_per_step"]
    assert check.status == FAILED
    assert check.summary.startswith("2 collectives in one step, max_collectives_per_step=1 (2 sites;")
    assert check.figures["per_kind"] == {"all_reduce": 2.0}
    titles = [f.title for f in check.findings]
    assert "all_reduce: 1 per step over 4 steps, by your code" in titles
    assert "DDP gradient all-reduce: 1 per step over 4 steps, by DDP" in titles
    (user,) = [f for f in check.findings if f.title.startswith("all_reduce")]
    assert user.sites[0].frame.source == "dist.all_reduce(loss.detach())  # SYNC"
    assert user.facts == ["16 B in all (all_reduce)"]  # a float32 scalar in each of the 4 counted steps
    assert "reduce once per epoch or every N steps" in user.hint


def test_a_periodic_all_reduce_is_a_note_and_the_budget_holds(group: None) -> None:
    check = fit(lambda: DDP(torch.nn.Linear(8, 1)), steps=24, every=10, max_collectives_per_step=1)[
        "max_collectives_per_step"
    ]
    assert check.status == PASSED, check.summary
    assert check.summary == "at most 1 collectives per step over 22 counted steps (max_collectives_per_step=1)"
    notes = [f.title for f in check.findings if f.title.startswith("note: ")]
    assert notes == ["note: periodic: 2 of 22 steps: all_reduce: 1 per step in 2 of 22 steps, by your code"]


def test_the_baseline_gets_one_entry_per_site_with_its_calls_per_step(group: None) -> None:
    check = fit(lambda: DDP(torch.nn.Linear(8, 1)), every=1, max_collectives_per_step="baseline")[
        "max_collectives_per_step"
    ]
    assert check.status == FAILED  # the ratchet decides
    entries = sorted(check.figures["baseline_counts"], key=lambda e: e["label"])
    assert [(e["label"], e["per_step"], e["function"]) for e in entries] == [
        ("DDP gradient all-reduce", 1.0, "body"), ("all_reduce", 1.0, "body"),
    ]
    assert entries[1]["source"] == "dist.all_reduce(loss.detach())  # SYNC"
    clean = fit(lambda: torch.nn.Linear(8, 1), max_collectives_per_step="baseline")["max_collectives_per_step"]
    assert clean.status == PASSED and clean.figures["baseline_counts"] == []


def test_an_object_broadcast_is_sized_by_the_pickled_object_it_sends(group: None) -> None:
    """``broadcast_object_list`` has no tensor argument: its size is what it sends (each object's size as an
    8-byte integer, then its pickled bytes), counted once (its own two broadcasts are its)."""
    import pickle

    state = {"lr": 0.1, "epoch": 3, "path": "checkpoints/last.ckpt"}

    def body() -> Any:
        with watch(**OFF, max_collectives_per_step=0) as run:
            for _ in range(6):
                with step():
                    dist.broadcast_object_list([state])  # OBJECTS
        return run

    check = report_of(body)["max_collectives_per_step"]
    assert check.status == FAILED
    (finding,) = check.findings
    assert finding.title == "broadcast: 1 per step over 4 steps, by your code"
    assert finding.facts == [f"{4 * (8 + len(pickle.dumps(state)))} B in all (broadcast)"]
    assert finding.sites[0].frame.source == "dist.broadcast_object_list([state])  # OBJECTS"


# -- no_constant_buffer_broadcast -----------------------------------------------------------------


def test_ddp_broadcasting_a_constant_buffer_fails(group: None) -> None:
    check = fit(lambda: DDP(Masked()), no_constant_buffer_broadcast=True)["no_constant_buffer_broadcast"]
    assert check.status == FAILED
    assert check.summary == "DDP broadcast constant buffers before every forward: 1.5 KiB for nothing"
    (finding,) = check.findings
    assert finding.title == "DDP broadcast 1 buffer that never changed"
    assert finding.facts[0] == "broadcast from rank 0 before each of 6 forwards: mask (256 B)"
    built, forward = finding.sites
    assert built.label == "DDP built with its buffer broadcast on (the default)"
    assert built.frame.source.startswith("check = fit(lambda: DDP(Masked()), ")
    assert forward.frame.source == "loss = model(x).pow(2).mean()" and forward.count == 6
    assert "DistributedDataParallel(model, forward_sync_buffers=False)" in finding.hint
    assert "persistent=False" in finding.hint


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
def test_broadcast_buffers_false_and_changing_buffers_pass(group: None) -> None:
    for off in (dict(broadcast_buffers=False), dict(forward_sync_buffers=False)):
        report = fit(lambda off=off: DDP(Masked(), **off), no_constant_buffer_broadcast=True)
        check = report["no_constant_buffer_broadcast"]
        assert check.status == PASSED
        assert check.summary.startswith("DDP broadcast no buffers in 6 forwards")
    normed = fit(lambda: DDP(Masked(norm=True)), no_constant_buffer_broadcast=True)["no_constant_buffer_broadcast"]
    # BatchNorm's statistics change every forward, the mask does not: the finding says to keep the broadcast.
    assert normed.status == FAILED
    (finding,) = normed.findings
    assert finding.facts[0] == "broadcast from rank 0 before each of 6 forwards: mask (256 B)"
    assert "norm.running_mean, norm.running_var, norm.num_batches_tracked" in finding.facts[2]
    assert finding.hint.startswith("other buffers do change, so keep the broadcast")
    plain = fit(Masked, no_constant_buffer_broadcast=True)["no_constant_buffer_broadcast"]
    assert plain.status == NOT_CHECKED


# -- FSDP2 ------------------------------------------------------------------------------------------


def fsdp_fit(quiet: bool, steps: int = 3, micro: int = 4) -> Report:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(steps * micro)]

    def body() -> Any:
        with watch(**OFF, no_sync_accumulation=True) as run:
            model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
            fully_shard(model[0])
            fully_shard(model)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for s in range(steps):
                for m in range(micro):
                    if quiet:
                        model.set_requires_gradient_sync(m == micro - 1)
                    model(batches[s * micro + m]).pow(2).mean().backward()  # BACKWARD
                opt.step()
                opt.zero_grad()
        return run

    return report_of(body)


def test_fsdp2_reduce_scattering_every_micro_batch_fails_no_sync_accumulation(group: None) -> None:
    check = fsdp_fit(quiet=False)["no_sync_accumulation"]
    assert check.status == FAILED
    assert check.summary == "12 reduce-scatter rounds for 3 optimizer steps, up to 4 per step: 9 not needed"
    (finding,) = check.findings
    assert finding.title == "gradients reduce-scattered on every micro-batch (FSDP2): 9 extra reduce-scatter rounds"
    assert finding.sites[0].frame.source == "model(batches[s * micro + m]).pow(2).mean().backward()  # BACKWARD"
    assert "set_requires_gradient_sync(False)" in finding.hint


def test_fsdp2_with_gradient_sync_off_until_the_last_micro_batch_passes(group: None) -> None:
    check = fsdp_fit(quiet=True)["no_sync_accumulation"]
    assert check.status == PASSED
    assert check.summary == "at most 1 reduce-scatter per optimizer step over 3 steps (4 micro-batches each)"


# -- a framework's own collectives ------------------------------------------------------------------

LIGHTNING_FIT = '''
import datetime

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl


class Logged(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, sync_dist=True, on_step=True, on_epoch=False)  # LOG
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.torchperf(max_collectives_per_step=2, count_warmup_steps=1)
def test_fit(tmp_path):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    checkpoint = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, train_time_interval=datetime.timedelta(0))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy="ddp", max_epochs=1, logger=False, callbacks=[checkpoint],
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
    )
    trainer.fit(Logged(), DataLoader(data, batch_size=4))  # FIT
'''


def test_lightnings_own_broadcasts_are_its_notes_at_its_callback(pytester: pytest.Pytester) -> None:
    """Lightning's ``ddp`` strategy in a group of one rank (it still calls ``broadcast_object_list``): its
    ``ModelCheckpoint`` broadcasts are Lightning's notes at the callback's line, sized by what they send, with
    ModelCheckpoint's setting; the all-reduce of ``self.log(..., sync_dist=True)`` stays the user's line."""
    import json
    import pickle

    pytest.importorskip("pytorch_lightning")
    pytester.makepyfile(test_fit=LIGHTNING_FIT)
    result = pytester.runpytest_subprocess("--torchperf-json=out.json", "-p", "no:cacheprovider", "-W", "ignore")
    doc = json.loads((pytester.path / "out.json").read_text())
    check = doc["tests"][0]["runs"][0]["checks"]["max_collectives_per_step"]
    # the budget counts the user's all-reduce and DDP's, not Lightning's own broadcasts
    assert check["status"] == "passed", result.stdout.str()
    findings = {f["title"]: f for f in check["findings"]}
    every = findings["note: broadcast: 1 per step over 7 steps, by pytorch_lightning, not your code"]
    site = every["sites"][0]
    assert site["site"].startswith("pytorch_lightning/callbacks/model_checkpoint.py:"), site
    assert site["function"] == "on_train_batch_end"
    assert site["source"] == "skip_time = trainer.strategy.broadcast(skip_time)"
    # each of the 7 broadcasts sends rank 0's pickled bool after its size (an 8-byte integer)
    assert every["facts"][0] == f"{7 * (len(pickle.dumps(True)) + 8)} B in all (broadcast)"
    assert "not counted in max_collectives_per_step" in every["facts"][1]
    assert "every_n_train_steps" in every["hint"] and "enable_checkpointing=False" in every["hint"]
    setup = [f for t, f in findings.items() if t.startswith("note: broadcast: 1 time outside training steps")]
    assert any("model_checkpoint.py" in f["sites"][0]["site"] for f in setup), setup
    assert not any(f["sites"][0]["site"].startswith("test_fit.py") for f in setup + [every])
    logged = [f for t, f in findings.items() if t.startswith("all_reduce: ")]
    assert [f["title"] for f in logged] == ["all_reduce: 1 per step over 7 steps, by your code"]
    source = (pytester.path / "test_fit.py").read_text().splitlines()
    log_line = next(i for i, text in enumerate(source, 1) if "# LOG" in text)
    assert logged[0]["sites"][0]["site"] == f"test_fit.py:{log_line}"
