"""What the DataLoader timing probe (``batches``) costs per batch, interleaved A/B.

The probe wraps ``DataLoader.__iter__``, ``_BaseDataLoaderIter.__next__`` and
the dataset fetchers. By default (``no_iterator_reset``, on in every watch) it
times only each pass's first batch; ``max_data_wait`` makes it time every batch
(two clock reads and a dict look-up), and with ``num_workers=0`` the dataset
and ``collate_fn`` too (two more clock reads and a swap of the fetcher's
``collate_fn``). Variants, timed in one process over the same loader:

- ``A``  unwatched;
- ``A'`` unwatched again: the A/A calibration (this machine's noise);
- ``D0`` ``watch()`` with ``no_iterator_reset`` as it was before the ``batches`` probe
  (that probe made, its patches left out: the ``iterators`` and ``loaders`` probes' only);
- ``D``  ``watch()`` with ``no_iterator_reset`` (the default): ``D - D0`` is what
  the probe costs every watched loop by default;
- ``M``  ``watch(min_workers=1)`` alone: the ``loaders`` probe reading every batch;
- ``W``  ``watch(max_data_wait=1.0)`` alone (the ``loaders`` probe reading every
  batch, and this probe timing every batch): ``W - M`` is what timing every batch costs.

A block is a number of passes over a loader of tiny batches (``num_workers=0``,
a ``TensorDataset`` of 4-float rows, batch 8: about the cheapest batch a
``DataLoader`` makes, so the probe's share is as large as it gets). Each round
runs every variant ``--reps`` times, interleaved, in an order that rotates,
keeps each variant's median block; reported: median microseconds per batch of
each variant, the extra microseconds per batch (variant minus ``A``, median
over rounds, with the 25th-75th percentile), and the ratios. The first round
is a warm-up and is dropped.

    python benchmarks/bench_data_wait.py [--rounds 15] [--reps 3] [--batches 2000]
    python benchmarks/bench_data_wait.py --smoke     # a few seconds, for CI

On a machine others share, the spread says how far to trust the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any, Callable

QUIET = {"no_host_sync": False, "on_device": False, "no_data_parallel": False}


def make_loader(batches: int) -> Any:
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(batches * 8, 4), torch.randn(batches * 8, 1))
    return DataLoader(data, batch_size=8)


def variants() -> dict[str, Callable[[], Any]]:
    from pytest_torchperf import watch
    from pytest_torchperf.probes.batches import BatchesProbe

    @contextlib.contextmanager
    def nothing() -> Iterator[None]:
        yield None

    @contextlib.contextmanager
    def without_probe() -> Iterator[Any]:
        # The batches probe made and handed to the check as usual, its patches left out: what they cost.
        install = BatchesProbe.install
        BatchesProbe.install = lambda self, patcher: None  # type: ignore[method-assign]
        try:
            with watch(**QUIET) as run:
                yield run
        finally:
            BatchesProbe.install = install  # type: ignore[method-assign]

    alone = {**QUIET, "no_iterator_reset": False}
    return {
        "A": nothing,
        "A'": nothing,
        "D0": without_probe,
        "D": lambda: watch(**QUIET),
        "M": lambda: watch(**alone, min_workers=1),
        "W": lambda: watch(**alone, max_data_wait=1.0),
    }


def block(context: Callable[[], Any], loader: Any, passes: int, clock: Callable[[], float]) -> float:
    """Seconds per batch over ``passes`` passes, inside ``context()`` (entered before the clock starts)."""
    with context():
        for _ in loader:  # a warm pass: the probes' first-pass costs are per test, not per batch
            pass
        n = 0
        start = clock()
        for _ in range(passes):
            for _batch in loader:
                n += 1
        elapsed = clock() - start
    return elapsed / n


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batches", type=int, default=2000, help="batches per pass")
    parser.add_argument("--passes", type=int, default=2, help="passes per timed block")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: this process's CPU time (steadier on a machine others share); wall: perf_counter")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting (seconds), for CI")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.reps, args.batches, args.passes = 3, 1, 300, 1
    import torch

    torch.set_num_threads(1)
    loader = make_loader(args.batches)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    kinds = variants()
    names = list(kinds)
    per_round: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.rounds):
        times: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(args.reps):
            shift = (r * args.reps + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(block(kinds[name], loader, args.passes, clock))
        if r == 0:
            continue  # warm-up
        for name in names:
            per_round[name].append(statistics.median(times[name]))

    def quartiles(values: list[float]) -> tuple[float, float, float]:
        if len(values) < 2:
            return values[0], values[0], values[0]
        q = statistics.quantiles(values, n=4)
        return q[0], statistics.median(values), q[2]

    print(f"bench_data_wait: {args.rounds - 1} rounds x {args.reps} reps, {args.passes} passes of "
          f"{args.batches} batches of 8 (num_workers=0), one torch thread, {args.clock} time")
    base = per_round["A"]
    for name in names:
        reference = {"D": "D0", "W": "M"}.get(name)
        if reference is not None:
            extra = [(v - b) * 1e6 for v, b in zip(per_round[name], per_round[reference])]
            lo, mid, hi = quartiles(extra)
            print(f"  {name} - {reference}: {mid:+6.2f} us/batch [{lo:+.2f}, {hi:+.2f}] (this probe's own cost)")
    for name in names:
        us = statistics.median(per_round[name]) * 1e6
        line = f"  {name:3} {us:8.2f} us/batch vs A:"
        if name != "A":
            extra = [(v - b) * 1e6 for v, b in zip(per_round[name], base)]
            ratio = [v / b for v, b in zip(per_round[name], base)]
            lo, mid, hi = quartiles(extra)
            rlo, rmid, rhi = quartiles(ratio)
            line += f"   extra {mid:+6.2f} us/batch [{lo:+.2f}, {hi:+.2f}]   ratio {rmid:.3f} [{rlo:.3f}, {rhi:.3f}]"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
