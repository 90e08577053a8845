"""A rank started with ``fork`` is watched exactly as one started with ``spawn``: the same verdict, the same line.

A forked child inherits the launching process's installed probes; the engine re-arms its copy of their state
in the child (``os.register_at_fork``), so the rank's own runs see its events and report to the merge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_ranks import line_of, own_tmpdir, run_suite  # noqa: F401 - own_tmpdir is a fixture

RANKS = '''
import gc
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(rank, world, store):
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"file://{store}")
    torch.manual_seed(rank)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = torch.nn.functional.mse_loss(model(torch.randn(4, 8)), torch.randn(4, 1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(loss.item())  # SYNC
    del model, opt, loss  # free the gloo group before exit (see test_ranks.PLAIN)
    gc.collect()
    dist.destroy_process_group()
'''

TEST = '''
import pytest
import torch.multiprocessing as mp
from fork_ranks import train


@pytest.mark.torchperf
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_ranks(tmp_path, method):
    mp.start_processes(train, args=(2, str(tmp_path / "store")), nprocs=2, start_method=method)
'''


@pytest.mark.slow
def test_ranks_started_with_fork_and_with_spawn_fail_alike_at_the_sync_line(
    pytester: pytest.Pytester, own_tmpdir: Path  # noqa: F811
) -> None:
    pytester.makepyfile(fork_ranks=RANKS, test_fork=TEST)
    result, tests = run_suite(pytester, own_tmpdir)
    result.assert_outcomes(failed=2)
    line = line_of(pytester.path / "fork_ranks.py")
    verdicts = {}
    for method in ("fork", "spawn"):
        check = tests[f"test_ranks[{method}]"]["checks"]["no_host_sync"]
        assert check["status"] == "failed", (method, check["summary"])
        assert f"fork_ranks.py:{line}" in check["summary"]
        ranks = check["processes"]  # each process's own verdict, beside the invariant's figures
        assert ranks["rank0"]["figures"]["syncs"] == 3 and ranks["rank1"]["figures"]["syncs"] == 3, (method, ranks)
        verdicts[method] = check["summary"]
    assert verdicts["fork"] == verdicts["spawn"]
