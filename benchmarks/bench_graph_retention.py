"""What ``no_graph_retention`` costs a training step, interleaved A/B, on the workloads of ``bench_step_checks.py``.

Budget (issue 13): with ``no_graph_retention=True`` alone, the tiny op-bound
step runs at most 1.05x its unwatched time.

Variants, timed in one process over the same model and data (each step marked
``with run.step():``, as a plain loop under the fixture would):

- ``A``  unwatched; ``A'`` unwatched again (the A/A calibration: this machine's noise);
- ``R``  ``watch()`` checking ``no_graph_retention`` only (its probes, ``graphs`` and
  ``optimizers``, and the Lightning observer installed);
- ``D``  ``watch()`` with the default invariants;
- ``DR`` the defaults plus ``no_graph_retention`` (what turning it on by default would add).

Each step is timed alone and a block's time is its median step; each round runs
every variant ``--reps`` times in a rotating order and keeps each variant's
median block; ratios are taken per round (R/A, DR/D, A'/A) and reported as
median [25th-75th percentile]. The first round is a warm-up. Each block enters
its ``watch()`` and runs a few untimed steps before its clock starts: the first
backward pass of a run is always walked, a per-run cost, not a per-step one.

Also reported, from one extra watched block of ``--reps`` x the block's steps: the
share of backward passes the adaptive cadence walked and the time those walks
took, as a fraction of the block (the probe's budget is 0.5%).

    python benchmarks/bench_graph_retention.py [--rounds 21] [--reps 5] [--workload all]

Exit status 1 when a median R/A ratio is over its budget.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

from bench_step_checks import build, interleaved, quartiles

BUDGETS = {"op-bound-sgd": 1.05, "op-bound-adam": 1.05, "compute-bound": 1.02}
#: The defaults switched off for ``R``: only ``no_graph_retention`` (and what every run installs) remains.
ONLY_RETENTION = dict(
    no_graph_retention=True, no_host_sync=False, on_device=False, no_iterator_reset=False, no_data_parallel=False
)


def measure(kind: str, rounds: int, reps: int) -> dict[str, object]:
    from pytest_torchperf import watch

    def variants(block: Any, plain_steps: Any, watched_steps: Any) -> dict[str, Callable[[], float]]:
        def plain() -> float:
            return block(plain_steps())

        def retention() -> float:
            with watch(**ONLY_RETENTION) as run:
                return block(watched_steps(run))

        def defaults() -> float:
            with watch() as run:
                return block(watched_steps(run))

        def defaults_and_retention() -> float:
            with watch(no_graph_retention=True) as run:
                return block(watched_steps(run))

        return {"A": plain, "A'": plain, "R": retention, "D": defaults, "DR": defaults_and_retention}

    step, n = build(kind)
    times = interleaved(step, n, rounds, reps, variants)
    ratios = {
        "R/A": [b / a for b, a in zip(times["R"], times["A"])],
        "DR/D": [b / a for b, a in zip(times["DR"], times["D"])],
        "A'/A": [b / a for b, a in zip(times["A'"], times["A"])],
    }
    # The cadence: one long watched block, read from the check's figures.
    with watch(**ONLY_RETENTION) as run:
        begin = time.perf_counter()
        for _ in range(n * reps):
            with run.step():
                step()
        elapsed = time.perf_counter() - begin
    figures = run.report["no_graph_retention"].figures  # type: ignore[index]
    return {
        "median_us": {name: statistics.median(v) * 1e6 for name, v in times.items()},
        "ratios": {name: quartiles(v) for name, v in ratios.items()},
        "walked": (figures["backward_passes_sampled"], figures["backward_passes"]),
        "walk_share": figures["sampling_ms"] / 1e3 / elapsed,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (after one warm-up round)")
    parser.add_argument("--reps", type=int, default=5, help="blocks per variant per round (their median is kept)")
    parser.add_argument("--workload", choices=("all", *BUDGETS), default="all")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no budget verdict)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.reps, args.workload = 2, 1, list(BUDGETS)[0]

    import torch

    torch.set_num_threads(1)
    workloads = list(BUDGETS) if args.workload == "all" else [args.workload]
    print(
        f"torch {torch.__version__}, 1 thread, {args.rounds} rounds (+1 warm-up) x {args.reps} interleaved blocks per "
        "variant"
    )
    print()
    header = (
        f"{'workload':<15} {'A us':>8} {'R us':>8} {'D us':>8} {'DR us':>8} "
        f"{'R/A median [IQR]':>22} {'DR/D median [IQR]':>22} {'A/A median [IQR]':>22} "
        f"{'walked':>10} {'walk time':>10} {'budget':>10}"
    )
    print(header)
    print("-" * len(header))
    status = 0
    for kind in workloads:
        result = measure(kind, args.rounds, args.reps)
        us = result["median_us"]
        ratios = result["ratios"]

        def fmt(name: str) -> str:
            lo, mid, hi = ratios[name]  # type: ignore[index]  # noqa: B023 - called in this iteration
            return f"{mid:.3f} [{lo:.3f}-{hi:.3f}]"

        budget = BUDGETS[kind]
        ok = ratios["R/A"][1] <= budget  # type: ignore[index]
        status |= 0 if ok else 1
        walked, passes = result["walked"]  # type: ignore[misc]
        print(
            f"{kind:<15} {us['A']:>8.1f} {us['R']:>8.1f} {us['D']:>8.1f} {us['DR']:>8.1f} "  # type: ignore[index]
            f"{fmt('R/A'):>22} {fmt('DR/D'):>22} {fmt(chr(65) + chr(39) + '/A'):>22} "
            f"{walked:>4}/{passes:<5} {result['walk_share'] * 100:>9.2f}% "
            f"{'R <=' + str(budget):>8} {'ok' if ok else 'OVER'}"
        )
    return 0 if args.smoke else status


if __name__ == "__main__":
    raise SystemExit(main())
