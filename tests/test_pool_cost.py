"""``no_iterator_reset`` measures what a rebuilt worker pool costs: seconds to each pass's first batch, and a share.

Each worker sleeps 0.2 s in its ``worker_init_fn`` (opening a shard, loading a
tokenizer...), so a pass that starts a pool cannot reach its first batch in
under 0.2 s, and one that reuses its pool has no such wait: the assertions
rest on that, with an order of magnitude as margin.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pytest_torchperf import InvariantViolation, watch
from pytest_torchperf.durations import seconds
from pytest_torchperf.report import FAILED, PASSED

QUIET = {"no_host_sync": False, "on_device": False}


def open_shard(worker_id: int) -> None:
    time.sleep(0.2)


def loader(persistent: bool) -> DataLoader:
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    return DataLoader(data, batch_size=8, num_workers=2, persistent_workers=persistent, worker_init_fn=open_shard)


def epochs(run: Any, batches: DataLoader, n: int = 3) -> None:
    for _ in range(n):
        for _x, _y in batches:
            with run.step():
                time.sleep(0.001)


def test_each_rebuilt_pool_is_measured_in_seconds_and_as_a_share_of_the_run() -> None:
    with pytest.raises(InvariantViolation) as caught:
        with watch(**QUIET) as run:
            epochs(run, loader(persistent=False))
    check = caught.value.report["no_iterator_reset"]
    assert check.status == FAILED
    (finding,) = check.findings
    first = next(f for f in finding.facts if f.startswith("time from the start of each pass to its first batch: "))
    assert first.count("(pass ") == 3
    line = next(f for f in finding.facts if f.startswith("3 worker pools started; 2 rebuilt, "))
    found = re.match(r"3 worker pools started; 2 rebuilt, ([\d.]+ m?s) each \((\d+)% of the watched run\): "
                     r"([\d.]+ m?s) lost \(each from the start of its pass to its first batch, "
                     r"that batch's own loading included\)$", line)
    assert found, line
    each, lost = seconds(found.group(1).replace(" ", "")), seconds(found.group(3).replace(" ", ""))
    share = int(found.group(2))
    assert each is not None and lost is not None
    assert 0.19 <= each < 20  # the workers' 0.2 s worker_init_fn is inside it
    assert lost == pytest.approx(2 * each, rel=0.5)
    assert 10 <= share <= 100  # 0.4 s of 0.2 s pools in a run of three of them and six 1 ms steps
    figures = check.figures
    assert figures["rebuilt_pools_lost_s"] >= 0.38
    assert 0.1 <= figures["rebuilt_pools_lost_share"] <= 1
    assert len(figures["loaders"][0]["first_batch_s"]) == 3
    assert min(figures["loaders"][0]["first_batch_s"]) >= 0.19


def test_a_persistent_pool_reused_loses_nothing_and_its_passes_are_timed() -> None:
    with watch(**QUIET) as run:
        epochs(run, loader(persistent=True))
    check = run.report["no_iterator_reset"]  # type: ignore[index]
    assert check.status == PASSED
    assert check.figures["rebuilt_pools_lost_s"] == 0.0
    first, *reused = check.figures["loaders"][0]["first_batch_s"]
    assert first >= 0.19 and len(reused) == 2
    assert max(reused) < first  # no worker_init_fn again: the reused pool's workers are already open
