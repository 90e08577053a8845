"""``max_overhead`` under load, and what a clear verdict costs: fits of time, passes of a far case, coverage.

Two cases, each a whole watched test (the user's fit, then the check):

- ``far``: Lightning's backbone image classifier at its size (784-128-10 MLP,
  batch 32, 32 batches x 2 epochs, Adam): Lightning adds about +85% to its
  epoch, far above ``max_overhead=0.5``. A pass is a wrong verdict;
- ``heavy``: a 4x512 MLP, batch 256, 8 batches x 3 epochs (about 15 ms of
  matrix work per step on one thread): far below 0.5.

Reported per case: verdicts (passed / failed / inconclusive), the measured
overhead and its interval, whether each interval covers the reference
overhead (the median of the quiet runs of the same case, or ``--reference``),
the rounds, and the time the check adds to the test in fits of that test
(``(test - fit) / fit``: the figure the docs' cost table gives).

``--hogs N`` runs N ``while True: pass`` processes beside it (default: none;
``--hogs -1``: one per core), for the loaded case: a far case must never pass.

    .venv/bin/python benchmarks/bench_overhead_load.py --runs 10                 # quiet: fits of time
    .venv/bin/python benchmarks/bench_overhead_load.py --runs 30 --case far --hogs -1
    .venv/bin/python benchmarks/bench_overhead_load.py --smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from bench_max_overhead import ONLY_OVERHEAD, Heavy, make_loader, make_trainer  # noqa: E402
from bench_repeatability import Backbone, tiny_loader  # noqa: E402

from pytest_torchperf import InvariantViolation, watch  # noqa: E402
from pytest_torchperf.report import Inconclusive  # noqa: E402

THRESHOLD = 0.5
CASES: dict[str, tuple[Callable[[], Any], Callable[[], Any], int]] = {
    "far": (Backbone, tiny_loader, 2),
    "heavy": (Heavy, make_loader, 3),
}
HOG = "while True:\n    pass\n"


def one_test(root: str, case: str, rounds: int) -> dict[str, Any]:
    module, loader, epochs = CASES[case]
    started = time.perf_counter()
    run = None
    try:
        with watch(max_overhead=THRESHOLD, overhead_rounds=rounds, **ONLY_OVERHEAD) as run:
            fit_started = time.perf_counter()
            trainer = make_trainer(root)
            trainer.fit_loop.max_epochs = epochs
            trainer.fit(module(), loader())
            fit_s = time.perf_counter() - fit_started
    except (InvariantViolation, Inconclusive):
        pass
    total_s = time.perf_counter() - started
    assert run is not None and run.report is not None
    fit = run.report["max_overhead"].figures["fits"][0]
    if "verdict" not in fit:
        raise RuntimeError(f"the check did not time the fit: {run.report['max_overhead'].summary}")
    return {
        "verdict": fit["verdict"],
        "overhead": fit["overhead"],
        "interval": fit["interval"],
        "rounds": fit["rounds"],
        "cpu_wait": fit["load"].get("cpu_wait_fraction"),
        "fit_s": fit_s,
        "total_s": total_s,
        "fits": (total_s - fit_s) / fit_s,
    }


def summary(case: str, runs: list[dict[str, Any]], reference: float) -> list[str]:
    counts = {v: sum(r["verdict"] == v for r in runs) for v in ("passed", "failed", "inconclusive")}
    covered = sum(r["interval"][0] <= reference <= r["interval"][1] for r in runs)
    fits = [r["fits"] for r in runs]
    waits = [r["cpu_wait"] or 0.0 for r in runs]
    return [
        f"{case}: passed {counts['passed']}, failed {counts['failed']}, inconclusive {counts['inconclusive']} "
        f"of {len(runs)} at max_overhead={THRESHOLD:.0%}",
        f"  overhead median {statistics.median(r['overhead'] for r in runs):+.1%} "
        f"(range {min(r['overhead'] for r in runs):+.1%}..{max(r['overhead'] for r in runs):+.1%}); "
        f"intervals covering the reference {reference:+.1%}: {covered}/{len(runs)}",
        f"  rounds median {statistics.median(r['rounds'] for r in runs):g} (max {max(r['rounds'] for r in runs)}); "
        f"check time in fits of the test: median {statistics.median(fits):.2f}, max {max(fits):.2f}",
        f"  our threads waited for a CPU {statistics.median(waits):.0%} (median; {min(waits):.0%}-{max(waits):.0%})",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="tests per case (default 10)")
    parser.add_argument("--case", choices=("all", *CASES), default="all")
    parser.add_argument("--rounds", type=int, default=10, help="overhead_rounds (default 10)")
    parser.add_argument("--hogs", type=int, default=0, help="'while True: pass' processes beside it (-1: one per core)")
    parser.add_argument("--reference", type=float, help="the true overhead of the case (default: median of the runs)")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (2 runs of the far case)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.case, args.hogs = 2, "far", 0
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    scratch = tempfile.TemporaryDirectory(prefix="bench-overhead-load-")  # removed with it, when main() ends
    root = scratch.name
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    n_hogs = cpus if args.hogs < 0 else args.hogs

    def log(text: str) -> None:
        print(text, file=sys.__stdout__, flush=True)

    log(f"{cpus} CPUs, 1 torch thread, {n_hogs} CPU hogs beside it, {args.runs} runs per case,"
        f" torch {torch.__version__}")
    cases = list(CASES) if args.case == "all" else [args.case]
    one_test(root, cases[0], args.rounds)  # warm the process up (imports, first fit)
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(n_hogs)]
    results: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    status = 0
    try:
        for i in range(args.runs):
            line = []
            for case in cases:
                r = one_test(root, case, args.rounds)
                results[case].append(r)
                lo, hi = r["interval"]
                line.append(
                    f"{case} {r['verdict'][:6]:6} {r['overhead']:+6.1%} [{lo:+.1%}..{hi:+.1%}] {r['rounds']:2d} rounds "
                    f"{r['fits']:.2f} fits wait {r['cpu_wait'] or 0:.0%}"
                )
            log(f"  run {i + 1:2d}: " + " | ".join(line))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    log("")
    for case in cases:
        runs = results[case]
        reference = args.reference if args.reference is not None else statistics.median(r["overhead"] for r in runs)
        for text in summary(case, runs, reference):
            log(text)
        if case == "far" and any(r["verdict"] == "passed" for r in runs):
            status = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpus": cpus, "hogs": n_hogs, "threshold": THRESHOLD, "runs": results}, f, indent=1)
    return 0 if args.smoke else status


if __name__ == "__main__":
    raise SystemExit(main())
