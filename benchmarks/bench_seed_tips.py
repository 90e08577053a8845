"""What the seed-tip invariants cost a whole Lightning fit, interleaved with unwatched fits.

Each round runs the same tiny fit (the one of ``bench_watch_fit.py``) four
ways in rotating order: unwatched (A), unwatched again (A', the machine's
noise), watched with the step checks off and this group's invariants at their
defaults (B: ``no_iterator_reset``, ``no_data_parallel``; every probe is
installed, they just have nothing to record), and watched with all of them on
(C: ``min_workers``, ``pin_memory``, ``no_empty_cache``, ``no_data_parallel``,
``grads_set_to_none``, ``no_recompiles``, ``mixed_precision``). Reported:
median seconds per fit and the median and spread (25th-75th percentile) of
the per-round ratios to A. The first round is a warm-up and is dropped.

    python benchmarks/bench_seed_tips.py [--rounds 15] [--workers 0]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings

from bench_watch_fit import build, quantiles

QUIET = {"no_host_sync": False, "on_device": False}
ALL = {
    **QUIET,
    "min_workers": 1,
    "pin_memory": True,
    "no_empty_cache": True,
    "grads_set_to_none": True,
    "no_recompiles": True,
    "mixed_precision": True,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no budget verdict)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 2

    import torch

    from pytest_torchperf import InvariantViolation, watch

    torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    fit = build(args.workers)

    def timed(options: dict | None) -> float:
        start = time.perf_counter()
        if options is None:
            fit()
        else:
            try:
                with watch(**options):
                    fit()
            except InvariantViolation:  # min_workers with num_workers=0: the verdict is not the point here
                pass
        return time.perf_counter() - start

    runners = {"A": None, "A'": None, "B": QUIET, "C": ALL}
    times: dict[str, list[float]] = {key: [] for key in runners}
    keys = list(runners)
    for r in range(args.rounds + 1):
        order = keys[r % len(keys):] + keys[: r % len(keys)]
        for key in order:
            elapsed = timed(runners[key])
            if r:  # round 0 is the warm-up
                times[key].append(elapsed)

    print(
        f"tiny Lightning fit, 2 epochs x 64 steps, num_workers={args.workers}, threads={args.threads}, "
        f"{args.rounds} rounds (+1 warm-up), torch {torch.__version__}"
    )
    labels = {"A": "unwatched", "A'": "unwatched again (A/A)", "B": "defaults", "C": "all seed tips on"}
    for key, label in labels.items():
        lo, med, hi = quantiles(times[key])
        print(f"  {label:24} median {med * 1000:8.1f} ms  (IQR {lo * 1000:.1f}-{hi * 1000:.1f})")
    for key in ("A'", "B", "C"):
        lo, med, hi = quantiles([b / a for a, b in zip(times["A"], times[key])])
        print(f"  {labels[key] + ' / A':24} median {med:.3f}x     (IQR {lo:.3f}-{hi:.3f})")


if __name__ == "__main__":
    main()
