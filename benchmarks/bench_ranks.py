"""What watching costs a training step inside a rank process (2 CPU ranks, gloo, DDP), interleaved.

Each variant is one ``torch.multiprocessing.spawn`` launch of two ranks that
train the same small DDP MLP (width 64, batch 32, SGD, one CPU thread each),
every step marked with ``pytest_torchperf.step()``:

- ``A``  unwatched (``step()`` then costs one list check);
- ``B``  launched inside the default ``pytest_torchperf.watch()``: each rank
  runs under the launching run's options (its probes, its checks) and reports
  back;
- ``D``  ``B`` plus the two DDP invariants (``no_unused_parameters_search``,
  ``no_sync_accumulation``: the probe of DDP's forward and of its reducer).

Inside each rank every step is timed alone and the rank's figure is its median
step after a warm-up; a launch's figure is the slower rank's. Rounds run every
variant once, in an order that rotates; the first round is dropped. Reported:
the median microseconds per step of each variant, the median per-round
difference to ``A`` in microseconds, and the median and spread (25th-75th
percentile) of the per-round ratios. Also the fixed cost a watched launch adds
(starting the ranks' runs, writing and merging their reports), as the median
difference of whole-launch wall times.

Across two processes on a shared machine the all-reduce's own jitter hides
differences of tens of microseconds; ``--local`` times the same step in this
process, DDP over a gloo group of one rank, in interleaved blocks, to measure
the per-step cost of the watch itself.

    python benchmarks/bench_ranks.py [--rounds 5] [--steps 300] [--local]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time

# One thread per rank, set before torch starts (changing it at run time in a rank makes some of them abort
# at exit, "terminate called without an active exception", with or without torchperf).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def train(rank: int, store: str, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pytest_torchperf

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"file://{store}")
    torch.manual_seed(rank)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    times = []
    for i in range(steps + 30):
        start = time.perf_counter()
        with pytest_torchperf.step():
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        if i >= 30:
            times.append(time.perf_counter() - start)
    with open(f"{out}.{rank}", "w") as fh:
        json.dump(statistics.median(times), fh)
    del model, opt, loss  # free the gloo group before exiting (torch 2.13 can abort at exit otherwise)
    gc.collect()
    dist.destroy_process_group()


def launch(variant: str, steps: int) -> tuple[float, float]:
    """``(median step seconds of the slower rank, wall seconds of the launch)``."""
    import torch.multiprocessing as mp

    from pytest_torchperf import watch

    work = tempfile.mkdtemp(prefix="bench-ranks-")
    out = os.path.join(work, "step")
    args = (os.path.join(work, "store"), steps, out)
    start = time.perf_counter()
    try:
        if variant == "A":
            mp.spawn(train, args=args, nprocs=2)
        else:
            extra = {"no_unused_parameters_search": True, "no_sync_accumulation": True} if variant == "D" else {}
            with watch(**extra) as run:
                mp.spawn(train, args=args, nprocs=2)
            assert run.report is not None and run.report.passed, run.report.render()  # type: ignore[union-attr]
    except mp.ProcessExitedException as exc:
        # torch 2.13's gloo ranks sometimes abort at interpreter exit, after their work (and their report):
        # keep the figures they wrote, say so.
        if exc.signal_name != "SIGABRT":
            raise
        print(f"  ({variant}: a rank aborted at exit after its work: {exc})", flush=True)
    wall = time.perf_counter() - start
    medians = []
    for rank in (0, 1):
        with open(f"{out}.{rank}") as fh:
            medians.append(json.load(fh))
    for name in os.listdir(work):
        os.remove(os.path.join(work, name))
    os.rmdir(work)
    return max(medians), wall


def local(rounds: int, steps: int) -> None:
    """The same step in this process, DDP over a gloo group of one rank: the per-step cost without the
    other rank's noise (``--local``). Blocks of ``steps`` steps, interleaved, each block's median step."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import pytest_torchperf
    from pytest_torchperf import watch

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="bench-ranks-")
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{os.path.join(work, 'store')}")
    torch.manual_seed(0)
    x, y = torch.randn(32, 64), torch.randn(32, 1)

    def block(variant: str) -> float:
        model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        extra = {"no_unused_parameters_search": True, "no_sync_accumulation": True} if variant == "D" else {}
        times = []
        with (watch(**extra) if variant != "A" else _nothing()):
            for i in range(steps + 10):
                start = time.perf_counter()
                with pytest_torchperf.step():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                if i >= 10:
                    times.append(time.perf_counter() - start)
        return statistics.median(times)

    variants = ["A", "B", "D"]
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(rounds + 1):
        for variant in variants[r % 3:] + variants[: r % 3]:
            value = block(variant)
            if r:
                per_step[variant].append(value)
    dist.destroy_process_group()
    for name in os.listdir(work):
        os.remove(os.path.join(work, name))
    os.rmdir(work)
    a = per_step["A"]
    print(f"A: median step {statistics.median(a) * 1e6:.1f} us (in-process, one rank)")
    for variant in ("B", "D"):
        diffs = [(x - y) * 1e6 for x, y in zip(per_step[variant], a)]
        lo, mid, hi = quartiles([x / y for x, y in zip(per_step[variant], a)])
        print(f"{variant}: median step {statistics.median(per_step[variant]) * 1e6:.1f} us, "
              f"+{statistics.median(diffs):.1f} us per step, ratio {mid:.3f} (IQR {lo:.3f}-{hi:.3f})")


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--local", action="store_true", help="time the step in this process (one rank) instead")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no budget verdict)")
    args = parser.parse_args()
    if args.smoke:  # one timed round of two variants: four launches of two ranks each
        args.rounds, args.steps = 1, 20
    if args.local:
        local(args.rounds, args.steps)
        return
    variants = ["A", "B"] if args.smoke else ["A", "B", "D"]
    per_step: dict[str, list[float]] = {v: [] for v in variants}
    walls: dict[str, list[float]] = {v: [] for v in variants}
    last: dict[str, float] = {}
    for r in range(args.rounds + 1):
        order = variants[r % len(variants):] + variants[: r % len(variants)]
        for variant in order:
            step, wall = launch(variant, args.steps)
            if r:
                per_step[variant].append(step)
                walls[variant].append(wall)
            last[variant] = step
        print(f"round {r}{' (warm-up, dropped)' if not r else ''}: "
              + ", ".join(f"{v} {last[v] * 1e6:.0f} us" for v in variants), flush=True)
    a = per_step["A"]
    for variant in variants:
        med = statistics.median(per_step[variant]) * 1e6
        line = f"{variant}: median step {med:.0f} us"
        if variant != "A":
            diffs = [(x - y) * 1e6 for x, y in zip(per_step[variant], a)]
            ratios = [x / y for x, y in zip(per_step[variant], a)]
            lo, mid, hi = quartiles(ratios)
            wall = statistics.median([x - y for x, y in zip(walls[variant], walls["A"])])
            line += (f", +{statistics.median(diffs):.0f} us per step, ratio {mid:.3f} (IQR {lo:.3f}-{hi:.3f}), "
                     f"launch wall time +{wall:.2f} s")
        print(line)


if __name__ == "__main__":
    main()
