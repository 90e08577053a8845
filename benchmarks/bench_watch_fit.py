"""What watching costs a whole Lightning fit: watched vs unwatched, interleaved.

Each round runs the same tiny fit three ways in alternating order: unwatched
(A), unwatched again (A', the A/A calibration of this machine's noise) and
inside ``pytest_torchperf.watch()`` (B). Reported: median seconds per fit, the
median and the spread (25th-75th percentile) of the per-round ratios B/A and
A'/A. The first round is a warm-up and is dropped.

Each timed variant also counts the garbage collector's work during it (collections,
full ones apart, and the time they took): reported as means, since a full
collection, hundreds of milliseconds in a process with torch and Lightning
loaded, comes once in many fits, and what a watch keeps alive brings the next
one sooner. The mean fit times, collections included, are reported beside the
medians.

Besides the whole fits, each round times the costs a watch adds apart:

- ``W``: ``with watch(): pass``: installing and removing the default probes,
  the slot bookkeeping, the Lightning observer's patches (the fixed cost per watch);
- ``A1`` / ``B1``: one-epoch fits unwatched / watched, so that the cost per epoch
  is ``((B - A) - (B1 - A1))`` (the 2-epoch fits less the 1-epoch ones) and the
  fixed cost per watched fit is ``(B1 - A1)`` less one epoch's.

``--against PATH`` runs the same rounds in a second process on another checkout
(the previous release), the two processes' rounds interleaved (see
``_against.py``). ``--clock cpu`` times each fit in the thread's CPU time rather
than wall time: on a machine shared with other work, the time the fit waited
for a CPU is left out (with ``--workers 0`` only: the DataLoader's worker
processes would be left out too). ``--smoke``: a tiny setting for CI.

``--series K`` replaces the rounds by series: each round runs K one-epoch fits
unwatched and K watched, one block after the other, and reports the mean fit
of each side with its share of the garbage collector's work, full collections
included (what a suite of watched tests pays, watch after watch, in one process).

    python benchmarks/bench_watch_fit.py [--rounds 15] [--workers 2] [--against /tmp/prev] [--clock cpu]
    python benchmarks/bench_watch_fit.py --series 10 --rounds 20 --batches 16 --clock cpu --against /tmp/prev
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
import warnings
from typing import Callable

from bench_step_checks import CLOCKS  # wall time, or the thread's CPU time (``--clock cpu``)


def build(workers: int, batches: int = 64):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    try:
        import pytorch_lightning as pl
    except ImportError:  # pragma: no cover
        import lightning.pytorch as pl
    # Each fit's "GPU available" lines and the logger tip, hundreds in a run, would bury the report.
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(32 * batches, 64)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=32, num_workers=workers, persistent_workers=workers > 0)
    # Removed when the last fit that names it is gone (with this closure), at the latest at exit.
    scratch = tempfile.TemporaryDirectory(prefix="bench-watch-fit-")

    def fit(epochs: int = 2) -> None:
        trainer = pl.Trainer(
            max_epochs=epochs,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=scratch.name,
        )
        trainer.fit(Regressor(), loader)

    return fit


def quantiles(values: list[float]) -> tuple[float, float, float]:
    if len(values) < 2:
        return values[0], values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


class GcTally:
    """The garbage collector's work while :attr:`on`: collections by generation, and seconds collecting."""

    def __init__(self) -> None:
        self.on = False
        self.counts = [0, 0, 0]
        self.seconds = 0.0
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.on:
            return
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[min(info.get("generation", 0), 2)] += 1
            self.seconds += time.perf_counter() - self._start

    def start(self) -> None:
        self.counts, self.seconds, self.on = [0, 0, 0], 0.0, True


def round_runner(fit, clock: Callable[[], float] = time.perf_counter) -> Callable[[int], dict[str, float]]:
    """``one_round(r)``: every variant once, in an order rotated by ``r``; seconds per variant, and for each
    ``gc_s:<variant>`` (seconds collecting garbage), ``gc_n:<variant>`` (collections) and ``gc_full:<variant>``
    (full collections) during it."""
    import gc

    from pytest_torchperf import watch

    tally = GcTally()
    gc.callbacks.append(tally)
    gc_figures: dict[str, float] = {}

    def timed(fn) -> float:
        tally.start()
        start = clock()
        fn()
        elapsed = clock() - start
        tally.on = False
        gc_figures.update(seconds=tally.seconds, count=sum(tally.counts), full=tally.counts[2])
        return elapsed

    def watched(epochs: int) -> None:
        with watch():  # the default invariants
            fit(epochs)

    def empty_watch() -> None:
        with watch():
            pass

    variants = {
        "A": lambda: timed(fit),
        "B": lambda: timed(lambda: watched(2)),
        "A'": lambda: timed(fit),
        "A1": lambda: timed(lambda: fit(1)),
        "B1": lambda: timed(lambda: watched(1)),
        "W": lambda: timed(empty_watch),
    }
    names = list(variants)

    def one_round(r: int) -> dict[str, float]:
        shift = r % len(names)
        out: dict[str, float] = {}
        for name in names[shift:] + names[:shift]:
            out[name] = variants[name]()
            out[f"gc_s:{name}"], out[f"gc_n:{name}"] = gc_figures["seconds"], gc_figures["count"]
            out[f"gc_full:{name}"] = gc_figures["full"]
        return out

    return one_round


def series_runner(fit, k: int, clock: Callable[[], float] = time.perf_counter) -> Callable[[int], dict[str, float]]:
    """``--series K``: ``one_round(r)`` runs ``k`` one-epoch fits unwatched (``SA``) and ``k`` watched (``SB``),
    in an order alternating by round; the seconds of each block, and its garbage collector's work.

    A test suite runs watch after watch in one process: what each leaves to the collector (the objects it
    keeps alive while a fit's collections run) adds up to the next full collection of the whole heap, which
    one interleaved round rarely sees. Here a block's mean per fit carries its share of them.
    """
    import gc

    from pytest_torchperf import watch

    tally = GcTally()
    gc.callbacks.append(tally)

    def watched() -> None:
        with watch():
            fit(1)

    blocks = {"SA": lambda: fit(1), "SB": watched}

    def one_round(r: int) -> dict[str, float]:
        out: dict[str, float] = {}
        for name in (("SA", "SB") if r % 2 == 0 else ("SB", "SA")):
            tally.start()
            start = clock()
            for _ in range(k):
                blocks[name]()
            out[name] = (clock() - start) / k
            tally.on = False
            out[f"gc_s:{name}"], out[f"gc_n:{name}"] = tally.seconds / k, sum(tally.counts) / k
            out[f"gc_full:{name}"] = tally.counts[2] / k
        return out

    return one_round


def series_report(label: str, times: dict[str, list[float]], k: int) -> None:
    mean = statistics.fmean
    a, b = mean(times["SA"]), mean(times["SB"])
    ratios = quantiles([sb / sa for sa, sb in zip(times["SA"], times["SB"])])
    n = len(times["SA"]) * k
    print(f"  {label}{'series of one-epoch fits':30} {n} unwatched, {n} watched: {a * 1000:.1f} ms and "
          f"{b * 1000:.1f} ms a fit, {b / a:.3f}x (blocks of {k}: median {ratios[1]:.3f}x, "
          f"IQR {ratios[0]:.3f}-{ratios[2]:.3f})")
    for key, text in (("SA", "GC a fit, unwatched"), ("SB", "GC a fit, watched")):
        count, full, spent = (mean(times[f"{what}:{key}"]) for what in ("gc_n", "gc_full", "gc_s"))
        print(f"  {label}{text:30} {count:5.2f} collections ({full:.3f} full), {spent * 1000:.2f} ms")


def costs(times: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Per round: the ratios and the costs apart (seconds), each as (25th percentile, median, 75th)."""
    rounds = range(len(times["A"]))
    per = {
        "B/A": [times["B"][i] / times["A"][i] for i in rounds],
        "A'/A": [times["A'"][i] / times["A"][i] for i in rounds],
        "watch": list(times["W"]),
        "epoch": [(times["B"][i] - times["A"][i]) - (times["B1"][i] - times["A1"][i]) for i in rounds],
    }
    per["fit"] = [(times["B1"][i] - times["A1"][i]) - per["epoch"][i] for i in rounds]
    return {name: quantiles(values) for name, values in per.items()}


def report(label: str, times: dict[str, list[float]]) -> None:
    c = costs(times)
    for key, text in (("A", "unwatched fit"), ("A'", "unwatched again (A/A)"), ("B", "watched fit")):
        lo, med, hi = quantiles(times[key])
        print(f"  {label}{text:24} median {med * 1000:8.1f} ms  (IQR {lo * 1000:.1f}-{hi * 1000:.1f})")
    for key, text in (("A'/A", "A'/A (noise)"), ("B/A", "watched/unwatched")):
        lo, med, hi = c[key]
        print(f"  {label}{text:24} median {med:.3f}x     (IQR {lo:.3f}-{hi:.3f})")
    for key, text in (
        ("watch", "per watch (W: probes in and out)"),
        ("fit", "per watched fit, fixed"),
        ("epoch", "per watched epoch"),
    ):
        lo, med, hi = c[key]
        print(f"  {label}{text:34} median {med * 1000:7.1f} ms  (IQR {lo * 1000:.1f}-{hi * 1000:.1f})")
    # The garbage collector, in means: a full collection (hundreds of ms with torch and Lightning loaded) comes
    # once in many fits, and a median leaves it out; what a watch allocates brings it sooner.
    if "gc_n:A" in times:
        mean = statistics.fmean
        a_mean, b_mean = mean(times["A"] + times["A'"]), mean(times["B"])
        print(f"  {label}{'mean fit, GC included':34} unwatched {a_mean * 1000:.1f} ms, "
              f"watched {b_mean * 1000:.1f} ms: {b_mean / a_mean:.3f}x")
        for key, text in (("A", "GC in an unwatched fit"), ("B", "GC in a watched fit"), ("W", "GC in an empty watch")):
            count, full, spent = (mean(times[f"{what}:{key}"]) for what in ("gc_n", "gc_full", "gc_s"))
            print(f"  {label}{text:34} {count:5.2f} collections ({full:.2f} full), {spent * 1000:.2f} ms (mean)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", type=int, default=64, help="batches per epoch (default 64)")
    parser.add_argument("--against", metavar="PATH", help="also time another checkout of the package, interleaved")
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                        help="time fits in wall time or in the thread's CPU time (with --workers 0)")
    parser.add_argument("--series", type=int, default=0, metavar="K",
                        help="instead of the rounds above: each round K one-epoch fits unwatched, then K watched")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.batches = 2, 4
        args.series = min(args.series, 2)
    if args.clock == "cpu" and args.workers:
        parser.error("--clock cpu times the main thread: it needs --workers 0 (the workers' processes would not count)")

    import logging

    import torch

    torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    fit = build(args.workers, args.batches)
    if not args.worker:  # a worker's stdout is the protocol
        what = f"series of {args.series} one-epoch fits a side a round" if args.series else "2 epochs"
        print(f"tiny Lightning fit, {what}, {args.batches} steps an epoch, num_workers={args.workers}, "
              f"threads={args.threads}, {args.rounds} rounds (+1 warm-up), {args.clock} clock, "
              f"torch {torch.__version__}")

    def runner() -> Callable[[int], dict[str, float]]:
        if args.series:
            return series_runner(fit, args.series, CLOCKS[args.clock])
        return round_runner(fit, CLOCKS[args.clock])

    def show(label: str, times: dict[str, list[float]]) -> None:
        if args.series:
            series_report(label, times, args.series)
        else:
            report(label, times)
    if args.worker:
        import sys

        from _against import serve

        import pytest_torchperf

        print(f"worker: {pytest_torchperf.__file__}", file=sys.stderr)
        one_round = runner()
        counter = [0]

        def served() -> dict[str, float]:
            counter[0] += 1
            return one_round(counter[0])

        serve(served)
        return
    if args.against:
        import os
        import sys

        from _against import Workers

        forwarded = ["--workers", str(args.workers), "--threads", str(args.threads), "--batches", str(args.batches),
                     "--clock", args.clock, "--series", str(args.series)]
        workers = Workers(os.path.abspath(sys.argv[0]), forwarded, {"this": None, "other": args.against})
        by_label: dict[str, dict[str, list[float]]] = {}
        try:
            for r, out in enumerate(workers.rounds(args.rounds + 1)):
                if r == 0:
                    continue  # warm-up
                for label, values in out.items():
                    for name, value in values.items():
                        by_label.setdefault(label, {}).setdefault(name, []).append(value)
        finally:
            workers.close()
        print(f"this: the checkout the script is in; other: {args.against}; the two processes' rounds interleaved")
        for label in ("this", "other"):
            show(f"{label:6}", by_label[label])
        return
    one_round = runner()
    times: dict[str, list[float]] = {}
    for r in range(args.rounds + 1):
        out = one_round(r)
        if r:  # round 0 is the warm-up
            for name, value in out.items():
                times.setdefault(name, []).append(value)
    show("", times)
    if args.smoke and not args.series:  # the series' code runs in the smoke run too
        one_block = series_runner(fit, 1, CLOCKS[args.clock])
        blocks: dict[str, list[float]] = {}
        for r in range(2):
            for name, value in one_block(r).items():
                blocks.setdefault(name, []).append(value)
        series_report("", blocks, 1)


if __name__ == "__main__":
    main()
