"""The collective checks on 2 real ranks (gloo on CPU): ``torch.multiprocessing.spawn`` and Lightning's ``ddp_spawn``.

One fresh ``python -m pytest`` runs a small suite, a clean and a buggy case
each: one ``mp.spawn`` launch that trains DDP with a constant buffer
(``no_constant_buffer_broadcast``) and then FSDP2 accumulating 4 micro-batches
(``no_sync_accumulation``), and a LightningModule logging with
``sync_dist=True`` under ``ddp_spawn`` (``max_collectives_per_step``). Every
rank checks; the launching process merges their verdicts. (Each launch starts
two interpreters that import torch: about a minute for the suite on an idle
2-core machine, several under load.)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

RANKS = '''
import atexit
import gc
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl


class Masked(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.register_buffer("mask", torch.ones(8, 8).tril())

    def forward(self, x):
        return self.layer(x @ self.mask)


def ddp_buffers(rank, world, store, broadcast):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    model = DDP(Masked(), broadcast_buffers=broadcast)  # BUILT
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    del model, opt, loss
    gc.collect()
    dist.destroy_process_group()


def fsdp(rank, world, store, quiet):
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        for m in range(4):
            if quiet:
                model.set_requires_gradient_sync(m == 3)
            model(torch.randn(4, 8)).pow(2).mean().backward()  # BACKWARD
        opt.step()
        opt.zero_grad()
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def ddp_and_fsdp(rank, world, store, clean):
    """Both in one launch (each spawn starts 2 interpreters): DDP buffers first, then FSDP2."""
    ddp_buffers(rank, world, store + "-ddp", broadcast=not clean)
    fsdp(rank, world, store + "-fsdp", quiet=clean)


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.randn(1, generator=g)


class Logged(pl.LightningModule):
    def __init__(self, on_step):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.on_step = on_step

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, sync_dist=True, on_step=self.on_step, on_epoch=not self.on_step)  # LOG
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


_RELEASE = []


class ReleaseAtExit(pl.Callback):
    """Free the gloo group while Python is still up (torch 2.13 can abort at exit otherwise; see test_ranks)."""

    def setup(self, trainer, pl_module, stage):
        if not _RELEASE:
            _RELEASE.append(True)

            def release():
                if dist.is_initialized():
                    dist.destroy_process_group()
                gc.collect()

            atexit.register(release)


def fit(on_step):
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp_spawn", max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[ReleaseAtExit()],
    )
    trainer.fit(Logged(on_step), torch.utils.data.DataLoader(Data(), batch_size=2))
'''

TESTS = '''
import pytest
import torch.multiprocessing as mp
from collective_ranks import ddp_and_fsdp, fit


@pytest.mark.torchperf(no_constant_buffer_broadcast=True, no_sync_accumulation=True, scope="test")
@pytest.mark.parametrize("clean", [False, True], ids=["buggy", "clean"])
def test_ddp_and_fsdp(tmp_path, clean):
    # buggy: DDP broadcasts a constant buffer (broadcast_buffers default), FSDP2 reduce-scatters every micro-batch;
    # clean: broadcast_buffers=False, set_requires_gradient_sync(False) until the last micro-batch.
    mp.spawn(ddp_and_fsdp, args=(2, str(tmp_path / "store"), clean), nprocs=2)


@pytest.mark.torchperf(max_collectives_per_step=1, count_warmup_steps=1)
@pytest.mark.parametrize("on_step", [True, False], ids=["on_step", "on_epoch"])
def test_sync_dist(on_step):
    fit(on_step)
'''


def line_of(path: Path, marker: str) -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


@pytest.mark.slow
def test_every_rank_checks_buffers_fsdp2_and_sync_dist(pytester: pytest.Pytester, tmp_path: Path) -> None:
    pytester.makepyfile(collective_ranks=RANKS, test_collective_ranks=TESTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = pytester.run(
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore", "-rA",
            "--torchperf-json=report.json", timeout=900,
        )
    doc = json.loads((pytester.path / "report.json").read_text())
    tests = {t["nodeid"].split("::")[-1]: t for t in doc["tests"]}
    out = result.stdout.str()
    outcome = {name: t["outcome"] for name, t in tests.items()}
    assert outcome == {
        "test_ddp_and_fsdp[buggy]": "failed", "test_ddp_and_fsdp[clean]": "passed",
        "test_sync_dist[on_step]": "failed", "test_sync_dist[on_epoch]": "passed",
    }, out

    def check(name: str, invariant: str) -> dict:
        return tests[name]["runs"][0]["checks"][invariant]

    buffers = check("test_ddp_and_fsdp[buggy]", "no_constant_buffer_broadcast")
    assert set(buffers["processes"]) == {"rank0", "rank1", "main"}
    assert all(buffers["processes"][r]["status"] == "failed" for r in ("rank0", "rank1"))
    assert buffers["findings"][0]["title"] == "rank 0, 1: DDP broadcast 1 buffer that never changed"
    built = line_of(pytester.path / "collective_ranks.py", "# BUILT")
    assert buffers["findings"][0]["sites"][0]["site"] == f"collective_ranks.py:{built}"
    assert check("test_ddp_and_fsdp[clean]", "no_constant_buffer_broadcast")["status"] == "passed"

    every = check("test_ddp_and_fsdp[buggy]", "no_sync_accumulation")
    assert every["summary"] == (
        "rank 0, 1: 12 reduce-scatter rounds for 3 optimizer steps, up to 4 per step: 9 not needed"
    )
    backward = line_of(pytester.path / "collective_ranks.py", "# BACKWARD")
    assert every["findings"][0]["sites"][0]["site"] == f"collective_ranks.py:{backward}"
    assert check("test_ddp_and_fsdp[clean]", "no_sync_accumulation")["status"] == "passed"

    logged = check("test_sync_dist[on_step]", "max_collectives_per_step")
    log_line = line_of(pytester.path / "collective_ranks.py", "# LOG")
    (user,) = [f for f in logged["findings"] if f["title"].startswith("rank 0, 1: all_reduce: ")]
    assert user["title"].startswith("rank 0, 1: all_reduce: ") and user["title"].endswith(", by your code")
    assert user["sites"][0]["site"] == f"collective_ranks.py:{log_line}"
    assert "on_step=False, on_epoch=True" in user["hint"]
    quiet = check("test_sync_dist[on_epoch]", "max_collectives_per_step")
    assert quiet["status"] == "passed", quiet
    assert any(f["title"].startswith("rank 0, 1: note: ") for f in quiet["findings"]), quiet
