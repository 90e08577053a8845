"""Every rank observed: real 2-process CPU runs (gloo) under each launcher, one merged report per test.

Each test runs a small user suite in a fresh ``python -m pytest`` (a clean and
a buggy case per launcher) and reads its outcome, terminal report, JSON and
JUnit XML. Launchers: ``torch.multiprocessing.spawn`` (``spawn`` start method;
``fork`` for the rank that raises) and torchrun's API, under ``-n 2``;
Lightning's and Fabric's ``ddp_spawn``; Lightning's and Fabric's ``ddp``, which
re-run the pytest command per rank. Each inner run gets its own ``TMPDIR``, to
show that no report directory is left behind.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

PLAIN = '''
import gc
import os
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
import pytest_torchperf as torchperf

ENV = "PYTEST_TORCHPERF_RANKS"


def train(rank, world, store, sync, fail_rank=None):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        with torchperf.step():
            if rank == fail_rank and step == 1:
                raise RuntimeError(f"rank {rank} ran out of data")
            loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if sync:
                print(f"loss {loss:.3f}")  # SYNC
    # Free the DDP module (and the gloo group it holds) before exiting: torch 2.13 can abort a process whose
    # gloo worker thread frees its last all-reduce while Python shuts down.
    del model, opt, loss
    gc.collect()
    dist.destroy_process_group()
'''

SCRIPT = '''
import gc
import sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(4):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    if "--sync" in sys.argv:
        print(loss.item())  # SYNC
del model, opt, loss  # see plain_ranks.train
gc.collect()
dist.destroy_process_group()
'''

TEST_PLAIN = '''
import os
import pytest
import torch.multiprocessing as mp
from torch.distributed import run as torchrun
from plain_ranks import ENV, train


@pytest.mark.torchperf
@pytest.mark.parametrize("sync", [False, True], ids=["clean", "buggy"])
def test_mp_spawn(tmp_path, sync):
    mp.spawn(train, args=(2, str(tmp_path / "store"), sync), nprocs=2)
    assert ENV not in os.environ


@pytest.mark.torchperf(scope="test")
@pytest.mark.parametrize("flags", [[], ["--sync"]], ids=["clean", "buggy"])
def test_torchrun(flags):
    script = os.path.join(os.path.dirname(__file__), "train_script.py")
    torchrun.main(["--nproc-per-node=2", "--standalone", "--monitor-interval=0.1", script, *flags])
    assert ENV not in os.environ

'''

TEST_FORK = '''
import pytest
import torch.multiprocessing as mp
from plain_ranks import train


@pytest.mark.torchperf
def test_rank_raises(tmp_path):
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 ran out of data"):
        mp.start_processes(train, args=(2, str(tmp_path / "store"), False, 1), nprocs=2, start_method="fork")
'''

MODELS = '''
import atexit
import contextlib
import gc
import torch
from torch.utils.data import DataLoader, TensorDataset
import pytest_torchperf as torchperf

try:
    import pytorch_lightning as pl
    from lightning_fabric import Fabric
except ImportError:  # pragma: no cover - the lightning package only
    import lightning.pytorch as pl
    from lightning.fabric import Fabric


def loader(**kwargs):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g))
    return DataLoader(data, batch_size=4, **kwargs)


class Clean(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Buggy(Clean):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss > 100:  # SYNC
            print("diverged")
        return loss


class ManualAccumulation(Clean):
    """Manual optimization, two micro-batches per optimizer step."""

    def __init__(self, toggle):
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        stepping = batch_idx % 2 == 1
        quiet = opt.toggle_model(sync_grad=stepping) if self.toggle else contextlib.nullcontext()
        with quiet:
            loss = Clean.training_step(self, batch, batch_idx)
            self.manual_backward(loss)
        if stepping:
            opt.step()
            opt.zero_grad()


_RELEASE = []


def release_at_exit():
    """Free the gloo group while Python is still up when this rank exits.

    torch 2.13 can abort a process (SIGABRT, "terminate called without an active exception") whose gloo
    worker thread frees an all-reduce once Python has started shutting down: Lightning and Fabric leave
    the group (and the DDP module holding it) alive in their ranks. torch's own issue, with or without
    torchperf.
    """
    if not _RELEASE:
        _RELEASE.append(True)

        def release():
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            gc.collect()

        atexit.register(release)


class ReleaseAtExit(pl.Callback):
    def setup(self, trainer, pl_module, stage):
        release_at_exit()


def trainer(strategy, **kwargs):
    kwargs.setdefault("max_epochs", 1)
    kwargs["callbacks"] = [ReleaseAtExit()]
    return pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, **kwargs)


def fabric_loop(fabric, sync):
    release_at_exit()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    for _ in range(4):
        with torchperf.step():
            loss = model(torch.randn(4, 8)).pow(2).mean()
            fabric.backward(loss)
            opt.step()
            opt.zero_grad()
            if sync:
                loss.item()  # SYNC in fabric_loop


def fabric(strategy):
    return Fabric(accelerator="cpu", devices=2, strategy=strategy)
'''

TEST_DDP_SPAWN = '''
import pytest
from rank_models import Buggy, Clean, loader, trainer

DDP_CHECKS = dict(no_sync_accumulation=True, no_unused_parameters_search=True)


@pytest.mark.torchperf(**DDP_CHECKS)
def test_ddp_spawn_clean():
    trainer("ddp_spawn", accumulate_grad_batches=2).fit(Clean(), loader())


@pytest.mark.torchperf(**DDP_CHECKS)
def test_ddp_spawn_buggy():
    trainer("ddp_spawn_find_unused_parameters_true").fit(Buggy(), loader())
'''

TEST_FABRIC_SPAWN = '''
import pytest
from rank_models import fabric, fabric_loop


@pytest.mark.torchperf
@pytest.mark.parametrize("sync", [False, True], ids=["clean", "buggy"])
def test_fabric_spawn(sync):
    fabric("ddp_spawn").launch(fabric_loop, sync)
'''

TEST_SCRIPT = '''
import pytest
from rank_models import Buggy, Clean, ManualAccumulation, fabric, fabric_loop, loader, trainer


@pytest.mark.torchperf(no_sync_accumulation=True)
@pytest.mark.parametrize("model", [Clean, Buggy], ids=["clean", "buggy"])
def test_ddp(model):
    trainer("ddp").fit(model(), loader())


@pytest.mark.torchperf(no_sync_accumulation=True)
@pytest.mark.parametrize("toggle", [True, False], ids=["toggle_model", "all_reduce_each_micro_batch"])
def test_ddp_manual_accumulation(toggle):
    trainer("ddp").fit(ManualAccumulation(toggle), loader())


@pytest.mark.torchperf
@pytest.mark.parametrize("persistent", [True, False], ids=["clean", "buggy"])
def test_ddp_loader_workers(persistent):
    # forkserver: a worker forked from a rank whose gloo threads run can hang in CPython's own fork
    # (the child waits forever for the interpreter's thread lock), with or without torchperf.
    workers = dict(num_workers=1, persistent_workers=persistent, multiprocessing_context="forkserver")
    trainer("ddp", max_epochs=2).fit(Clean(), loader(**workers))


@pytest.mark.torchperf
@pytest.mark.parametrize("sync", [False, True], ids=["clean", "buggy"])
def test_fabric_ddp(sync):
    f = fabric("ddp")
    f.launch()
    fabric_loop(f, sync)
'''


@pytest.fixture
def own_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A TMPDIR of its own for the inner run, to show no report directory is left behind.

    Short: multiprocessing puts the Unix socket that hands tensors from DataLoader workers to their
    process in TMPDIR, and a socket path may not exceed 107 bytes.
    """
    tmp = Path(tempfile.mkdtemp(prefix="tp-"))
    monkeypatch.setenv("TMPDIR", str(tmp))
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


#: What torch 2.13 prints when a gloo rank aborts in the C++ teardown of interpreter exit, after its work
#: (with or without torchperf; the ranks here free their group before exiting, which avoids it, see
#: plain_ranks.train and rank_models.release_at_exit).
TORCH_EXIT_ABORT = "terminate called without an active exception"


def run_suite(pytester: pytest.Pytester, tmp: Path, *args: str, timeout: float = 400) -> Any:
    """``python -m pytest`` in the pytester directory; returns the result and the JSON.

    Run again, once, only when a rank died of torch's own abort at exit (``TORCH_EXIT_ABORT``): that
    exit code fails the launch whatever torchperf does. Any other failure counts at once.
    """
    for attempt in (1, 2):
        result = pytester.run(
            sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "ignore", "-rA",
            "--torchperf-json=report.json", "--junitxml=junit.xml", *args, timeout=timeout,
        )
        if attempt == 2 or TORCH_EXIT_ABORT not in result.stdout.str() + result.stderr.str():
            break
        print("a rank aborted at exit (torch's teardown, not torchperf): running the suite again")
    leftovers = [p.name for p in tmp.iterdir() if p.name.startswith("torchperf-")]
    assert leftovers == [], f"report directories left behind: {leftovers}"
    doc = json.loads((pytester.path / "report.json").read_text())
    return result, {t["nodeid"].split("::")[-1]: t for t in doc["tests"]}


def line_of(path: Path, marker: str = "# SYNC") -> int:
    return next(i for i, text in enumerate(path.read_text().splitlines(), 1) if marker in text)


def junit(pytester: pytest.Pytester) -> dict[str, dict[str, str]]:
    root = ET.parse(pytester.path / "junit.xml").getroot()
    return {
        case.get("name", ""): {p.get("name", ""): p.get("value", "") for p in case.iter("property")}
        for case in root.iter("testcase")
    }


def processes(test: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["process"]: r for r in test["runs"][0]["ranks"]}


@pytest.mark.slow
def test_mp_spawn_torchrun_and_lightning_ddp_spawn_ranks_under_xdist(
    pytester: pytest.Pytester, own_tmpdir: Path
) -> None:
    # Two workers each run DDP groups at the same time: file stores for mp.spawn, torchrun's standalone
    # rendezvous on a port the OS picks, Lightning's MASTER_PORT found free by each worker's launcher.
    pytester.makepyfile(
        plain_ranks=PLAIN, train_script=SCRIPT, test_plain=TEST_PLAIN, rank_models=MODELS, test_ddp_spawn=TEST_DDP_SPAWN
    )
    result, tests = run_suite(pytester, own_tmpdir, "-n", "2")
    result.assert_outcomes(passed=3, failed=3)
    plain_line = line_of(pytester.path / "plain_ranks.py")
    script_line = line_of(pytester.path / "train_script.py")
    result.stdout.fnmatch_lines([
        f"*torchperf: 1 invariant broken: no_host_sync (rank 0, 1: 4 syncs at plain_ranks.py:{plain_line}: "
        "1 per step over 4 steps)*",
    ])
    result.stdout.fnmatch_lines([
        f"*torchperf: 1 invariant broken: no_host_sync (rank 0, 1: 4 syncs at train_script.py:{script_line}: "
        "4 times outside training steps)*",
    ])
    result.stdout.fnmatch_lines(["rank 0, 1: an f-string or `format()` of a tensor in train: 1 per step over 4 steps"])

    clean = tests["test_mp_spawn[clean]"]
    assert clean["checks"]["no_host_sync"]["summary"] == "rank 0, 1: no sync in your code over 4 steps"
    ranks = processes(clean)
    assert set(ranks) == {"main process", "rank 0", "rank 1"}
    assert ranks["rank 1"]["steps"] == 4 and ranks["rank 1"]["launcher"] == "torch.multiprocessing"
    assert ranks["rank 0"]["pid"] != ranks["rank 1"]["pid"] != ranks["main process"]["pid"]
    buggy = tests["test_mp_spawn[buggy]"]["checks"]["no_host_sync"]
    assert buggy["processes"]["rank1"]["figures"]["syncs"] == 4 and buggy["count"] == 8
    assert tests["test_torchrun[clean]"]["outcome"] == "passed"
    assert processes(tests["test_torchrun[buggy]"])["rank 1"]["launcher"] == "torchrun"

    props = junit(pytester)
    assert props["test_mp_spawn[buggy]"]["torchperf.no_host_sync.rank0.syncs"] == "4"
    assert props["test_mp_spawn[buggy]"]["torchperf.no_host_sync.rank1.status"] == "failed"
    assert props["test_mp_spawn[clean]"]["torchperf.no_host_sync.main.status"] == "not checked"

    line = line_of(pytester.path / "rank_models.py")
    result.stdout.fnmatch_lines([
        "*torchperf: 2 invariants broken: no_host_sync (rank 0, 1: 4 syncs at rank_models.py:"
        f"{line}: 1 per step over 4 steps); no_unused_parameters_search (rank 0, 1: find_unused_parameters=True, "
        "but all 2 parameters got a gradient in all 4 iterations)*",
        "*torchperf: no_unused_parameters_search*",
        "rank 0, 1: DistributedDataParallel(Buggy) searched for unused parameters after each "
        "of 4 iterations, and all 2 parameters got a gradient on every rank every time",
        "*hint: use Trainer(strategy=\"ddp_spawn\") instead of \"ddp_spawn_find_unused_parameters_true\"*",
    ], consecutive=False)
    spawned = tests["test_ddp_spawn_clean"]["checks"]
    assert spawned["no_host_sync"]["summary"] == "rank 0, 1: no sync in your code over 4 steps"
    # Lightning's accumulate_grad_batches runs the first micro-batch under no_sync: one all-reduce per step.
    assert spawned["no_sync_accumulation"]["summary"] == (
        "rank 0, 1: at most 1 all-reduce per optimizer step over 2 steps (2 micro-batches each)"
    )
    assert spawned["no_unused_parameters_search"]["status"] == "passed"


@pytest.mark.slow
def test_fabric_ddp_spawn_ranks_and_a_rank_that_raises(pytester: pytest.Pytester, own_tmpdir: Path) -> None:
    # The forking test runs first, in a process that has not started any torch.distributed store (a forked
    # child that inherits one can hang in its destructor: torch's hazard, with or without torchperf).
    pytester.makepyfile(plain_ranks=PLAIN, test_fork=TEST_FORK, rank_models=MODELS, test_spawn=TEST_FABRIC_SPAWN)
    result, tests = run_suite(pytester, own_tmpdir)
    result.assert_outcomes(passed=2, failed=1)
    fabric = tests["test_fabric_spawn[buggy]"]["checks"]["no_host_sync"]
    line = line_of(pytester.path / "rank_models.py", "# SYNC in fabric_loop")
    assert fabric["status"] == "failed"
    assert fabric["summary"] == f"rank 0, 1: 4 syncs at rank_models.py:{line}: 1 per step over 4 steps"
    assert tests["test_fabric_spawn[clean]"]["outcome"] == "passed"
    assert processes(tests["test_fabric_spawn[clean]"])["rank 1"]["steps"] == 4

    raised = tests["test_rank_raises"]
    assert raised["outcome"] == "passed"  # the test expected the rank's exception
    rank1 = processes(raised)["rank 1"]
    assert rank1["error"]["type"] == "RuntimeError" and rank1["error"]["message"] == "rank 1 ran out of data"
    assert rank1["error"]["where"].startswith("plain_ranks.py:") and rank1["steps"] == 2
    # A rank that raised (or was killed when its peer died) vouches for nothing: not checked, never passed.
    assert raised["checks"]["no_host_sync"]["status"] == "not checked"
    assert "rank 1: not checked (raised RuntimeError: rank 1 ran out of data at plain_ranks.py:" in (
        raised["checks"]["no_data_parallel"]["summary"]
    )
    result.stdout.fnmatch_lines(
        ["        rank 1 (pid *) raised RuntimeError: rank 1 ran out of data at plain_ranks.py:*"]
    )


@pytest.mark.slow
def test_lightning_and_fabric_ddp_rerun_the_test_in_each_rank(
    pytester: pytest.Pytester, own_tmpdir: Path
) -> None:
    pytester.makepyfile(rank_models=MODELS, test_script=TEST_SCRIPT)
    result, tests = run_suite(pytester, own_tmpdir)
    # The rank process re-runs the whole session; its own outcomes never fail (its launcher judges) and its
    # JSON is not written over the launcher's.
    result.stdout.fnmatch_lines(["*torchperf summary of rank process 1 (reported to its launcher, which judges)*"])
    result.stdout.fnmatch_lines(["* 8 passed in *"])
    result.stdout.fnmatch_lines(["* 4 failed, 4 passed in *"])
    assert result.ret == 1
    assert {name: t["outcome"] for name, t in tests.items()} == {
        "test_ddp[clean]": "passed",
        "test_ddp[buggy]": "failed",
        "test_ddp_manual_accumulation[toggle_model]": "passed",
        "test_ddp_manual_accumulation[all_reduce_each_micro_batch]": "failed",
        "test_ddp_loader_workers[clean]": "passed",
        "test_ddp_loader_workers[buggy]": "failed",
        "test_fabric_ddp[clean]": "passed",
        "test_fabric_ddp[buggy]": "failed",
    }
    line = line_of(pytester.path / "rank_models.py")
    buggy = tests["test_ddp[buggy]"]["checks"]["no_host_sync"]
    assert buggy["summary"] == f"rank 0, 1: 4 syncs at rank_models.py:{line}: 1 per step over 4 steps"
    # The launching process is rank 0 itself; the later tests reuse the rank processes of the first one.
    for name in ("test_ddp[clean]", "test_fabric_ddp[buggy]"):
        ranks = processes(tests[name])
        assert set(ranks) == {"rank 0", "rank 1"}, name
        assert ranks["rank 1"]["launcher"] in ("lightning ddp", "fabric ddp")
    assert (
        processes(tests["test_ddp[clean]"])["rank 1"]["pid"]
        == processes(tests["test_fabric_ddp[buggy]"])["rank 1"]["pid"]
    )
    manual = tests["test_ddp_manual_accumulation[all_reduce_each_micro_batch]"]["checks"]["no_sync_accumulation"]
    assert manual["summary"] == "rank 0, 1: 4 all-reduce rounds for 2 optimizer steps, up to 2 per step: 2 not needed"
    result.stdout.fnmatch_lines(["*hint: in manual optimization, run the micro-batches that do not step under "
                                 "`with optimizer.toggle_model(sync_grad=False):`*"])
    assert tests["test_ddp_manual_accumulation[toggle_model]"]["checks"]["no_sync_accumulation"]["summary"] == (
        "rank 0, 1: at most 1 all-reduce per optimizer step over 2 steps (2 micro-batches each)"
    )
    # no_iterator_reset runs in each rank too: each rank's loader started a worker pool every epoch.
    reset = tests["test_ddp_loader_workers[buggy]"]["checks"]["no_iterator_reset"]
    assert reset["status"] == "failed" and reset["summary"].startswith("rank 0, 1: ")
    assert {k: v["status"] for k, v in reset["processes"].items()} == {"rank0": "failed", "rank1": "failed"}
    assert tests["test_ddp_loader_workers[clean]"]["checks"]["no_iterator_reset"]["status"] == "passed"


SCRIPT_WATCH = '''
import os
from rank_models import Buggy, loader, trainer
from pytest_torchperf import InvariantViolation, watch

if __name__ == "__main__":
    try:
        with watch():
            trainer("ddp").fit(Buggy(), loader())
        verdict = "no violation raised"
    except InvariantViolation as exc:
        verdict = exc.report.summary_line()
    left = "PYTEST_TORCHPERF_RANKS" in os.environ
    print(f"LOCAL_RANK={os.environ.get('LOCAL_RANK')}: {verdict}; variable in the environment: {left}")
'''


@pytest.mark.slow
def test_a_script_watching_a_ddp_fit_gets_every_rank(pytester: pytest.Pytester, own_tmpdir: Path) -> None:
    # Lightning's ddp re-runs the script for rank 1; torchperf, imported by the script, reports from there.
    pytester.makepyfile(rank_models=MODELS, train_ddp=SCRIPT_WATCH)
    result = pytester.run(sys.executable, "-W", "ignore", "train_ddp.py", timeout=300)
    line = line_of(pytester.path / "rank_models.py")
    result.stdout.fnmatch_lines([
        "LOCAL_RANK=1: no violation raised; variable in the environment: True",
    ])
    result.stdout.fnmatch_lines([
        f"LOCAL_RANK=0: torchperf: 1 invariant broken: no_host_sync (rank 0, 1: 4 syncs at rank_models.py:{line}: "
        "1 per step over 4 steps); variable in the environment: False",
    ])
    assert [p.name for p in own_tmpdir.iterdir() if p.name.startswith("torchperf-")] == []
