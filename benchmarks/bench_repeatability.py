"""Does ``max_overhead`` give the same verdict when the same fit is timed again? Quiet, and beside a CPU hog.

Three cases, each fitted ``--runs`` times on a quiet machine and ``--runs``
times beside ``--hogs`` bursty CPU hogs (random 20-300 ms bursts of busy work
and rest), cases interleaved so drifts of the machine hit all alike:

(a) tiny: Lightning's backbone image classifier at its size (a 784-128-10 MLP,
    batches of 32, 32 batches per epoch): Lightning roughly doubles its epoch,
    far above ``max_overhead=0.5``;
(b) heavy: a 4x512 MLP, batches of 256, 8 per epoch (about 15 ms of matrix
    work per step on one thread): far below 0.5;
(c) near: the heavy model plus fixed matrix work in ``on_train_batch_end``
    sized to bring it to about +50%, and the threshold set to its median
    overhead over ``--calibration`` runs: the hardest case there is.

The fits run with torch's default thread count (``--threads`` changes it), as
a new user's would; the check times both loops with one thread on a CPU.

Targets (issue 14): (a) and (b) give the same verdict in every run in both
conditions; (c) never gives both a pass and a fail across runs (inconclusive
is allowed).

    .venv/bin/python benchmarks/bench_repeatability.py --runs 10 --json repeatability.json
    .venv/bin/python benchmarks/bench_repeatability.py --runs 2 --calibration 1    # a smoke run
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

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl

from bench_max_overhead import BATCHES, HOG, ONLY_OVERHEAD, Heavy, make_loader, make_trainer, matmuls_for

from pytest_torchperf import InvariantViolation, watch
from pytest_torchperf.report import Inconclusive

THRESHOLD = 0.5


class Backbone(pl.LightningModule):
    """The size of Lightning's backbone image classifier example: 28x28 images, a 128-wide hidden layer, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = torch.nn.Linear(28 * 28, 128)
        self.l2 = torch.nn.Linear(128, 10)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        logits = torch.relu(self.l2(torch.relu(self.l1(x.view(x.size(0), -1)))))
        loss = torch.nn.functional.cross_entropy(logits, y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=1e-4)


def tiny_loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    n = 32 * 32
    images = torch.randn(n, 1, 28, 28, generator=g)
    return DataLoader(TensorDataset(images, torch.randint(0, 10, (n,), generator=g)), batch_size=32)


def timed_fit(root: str, module: Any, loader: DataLoader, max_overhead: Any, rounds: int) -> dict[str, Any]:
    """One test's worth: the fit under ``watch(max_overhead=...)``; its verdict and figures."""
    started = time.perf_counter()
    if isinstance(max_overhead, float) and max_overhead > 1:
        max_overhead = f"{max_overhead:.1%}"  # a fraction above 1 is refused as a likely percentage
    run = None
    try:
        with watch(max_overhead=max_overhead, overhead_rounds=rounds, **ONLY_OVERHEAD) as run:
            make_trainer(root).fit(module, loader)
    except (InvariantViolation, Inconclusive):
        pass
    assert run is not None and run.report is not None
    fit = run.report["max_overhead"].figures["fits"][0]
    if "verdict" not in fit:
        raise RuntimeError(f"the check did not time the fit: {run.report['max_overhead'].summary}")
    return {
        "verdict": fit["verdict"],
        "overhead": fit["overhead"],
        "interval": fit["interval"],
        "rounds": fit["rounds"],
        "unit": fit["unit"],
        "threads": fit["threads"],
        "cpu_wait": fit["load"].get("cpu_wait_fraction"),
        "vanilla_epoch_s": fit["baseline"]["median_s"],
        "ratios": fit["ratios"],
        "candidate_first": fit["candidate_first"],
        "check_s": fit["check_seconds"],
        "total_s": time.perf_counter() - started,
    }


def summarize(name: str, threshold: float, condition: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    counts = {v: sum(r["verdict"] == v for r in runs) for v in ("passed", "failed", "inconclusive")}
    overheads = [r["overhead"] for r in runs]
    return {
        "case": name,
        "threshold": threshold,
        "condition": condition,
        "runs": len(runs),
        **counts,
        "overhead_median": statistics.median(overheads),
        "overhead_min": min(overheads),
        "overhead_max": max(overheads),
        "rounds_median": statistics.median(r["rounds"] for r in runs),
        "check_s_median": statistics.median(r["check_s"] for r in runs),
        "cpu_wait_median": statistics.median(r["cpu_wait"] or 0.0 for r in runs),
    }


def wait_line(rows: list[dict[str, Any]]) -> str:
    waits = [row["cpu_wait_median"] for row in rows]
    return (
        f"our threads waited for a CPU {min(waits):.0%}-{max(waits):.0%} of their runnable time (median per case and "
        "condition): above 10% the machine was busy with other work, above 50% heavily"
    )


def verdict_line(row: dict[str, Any]) -> str:
    return (
        f"| {row['case']} | {row['threshold']:.1%} | {row['condition']} | "
        f"{row['passed']}/{row['failed']}/{row['inconclusive']} "
        f"| {row['overhead_median']:+.1%} ({row['overhead_min']:+.1%}..{row['overhead_max']:+.1%}) "
        f"| {row['rounds_median']:g} | {row['check_s_median']:.1f} s |"
    )


def target(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for row in rows:
        if row["case"].startswith("(c)"):
            ok = not (row["passed"] and row["failed"])
            out.append(
                f"{row['case']} {row['condition']}: "
                f"{'never both a pass and a fail' if ok else 'BOTH a pass and a fail'}"
            )
        else:
            same = max(row["passed"], row["failed"], row["inconclusive"])
            out.append(f"{row['case']} {row['condition']}: same verdict in {same}/{row['runs']} runs")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10, help="runs per case and condition (default 10)")
    parser.add_argument("--calibration", type=int, default=3, help="runs that place the threshold of case (c)")
    parser.add_argument("--rounds", type=int, default=10, help="overhead_rounds of every check (default 10)")
    parser.add_argument("--hogs", type=int, default=1, help="bursty CPU hogs in the loaded condition (default 1)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads of the fits (default: torch's own)")
    parser.add_argument("--conditions", default="quiet,hog", help="which conditions to run (default quiet,hog)")
    parser.add_argument("--json", help="write every run's figures here")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no budget verdict)")
    args = parser.parse_args()
    if args.smoke:
        args.runs, args.calibration, args.rounds, args.conditions = 1, 1, 4, "quiet"
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    scratch = tempfile.TemporaryDirectory(prefix="bench-repeatability-")  # removed with it, when main() ends
    root = scratch.name

    def log(text: str) -> None:
        print(text, file=sys.__stdout__, flush=True)

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    log(f"{cpus} CPUs, torch threads of the fits {torch.get_num_threads()}, {args.runs} runs per case and condition")

    # (c): the heavy model plus a hook sized to about +50%, the threshold at its measured overhead.
    clean = [timed_fit(root, Heavy(), make_loader(), "1000%", args.rounds) for _ in range(max(args.calibration, 1))]
    clean_overhead = statistics.median(r["overhead"] for r in clean)
    step_s = statistics.median(r["vanilla_epoch_s"] for r in clean) / BATCHES
    threads = torch.get_num_threads()
    torch.set_num_threads(clean[0]["threads"] or threads)  # the check times with this many threads
    try:
        extra = matmuls_for(max(THRESHOLD - clean_overhead, 0.05) * step_s)
    finally:
        torch.set_num_threads(threads)
    near = [timed_fit(root, Heavy(extra), make_loader(), "1000%", args.rounds) for _ in range(max(args.calibration, 1))]
    near_threshold = round(statistics.median(r["overhead"] for r in near), 3)
    log(
        f"calibration: heavy clean {clean_overhead:+.1%}, vanilla step {step_s * 1e3:.1f} ms; case (c) adds "
        f"{extra} matmuls of 128x128 per batch: {', '.join(format(r['overhead'], '+.1%') for r in near)} -> "
        f"threshold {near_threshold:.1%}"
    )

    cases: list[tuple[str, float, Callable[[], Any], Callable[[], DataLoader]]] = [
        ("(a) tiny, far above", THRESHOLD, Backbone, tiny_loader),
        ("(b) heavy, far below", THRESHOLD, Heavy, make_loader),
        ("(c) near the threshold", near_threshold, lambda: Heavy(extra), make_loader),
    ]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    rows = []
    for condition in [c.strip() for c in args.conditions.split(",") if c.strip()]:
        hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs if condition == "hog" else 0)]
        label = "quiet" if condition == "quiet" else f"beside {args.hogs} bursty CPU hog{'s' if args.hogs != 1 else ''}"
        try:
            per_case: dict[str, list[dict[str, Any]]] = {name: [] for name, *_ in cases}
            for i in range(args.runs):
                line = []
                for name, threshold, module, loader in cases:
                    r = timed_fit(root, module(), loader(), threshold, args.rounds)
                    per_case[name].append(r)
                    line.append(f"{name[:3]} {r['verdict'][:6]:6} {r['overhead']:+6.1%} ({r['rounds']:2d} rounds)")
                log(f"  {condition} run {i + 1:2d}: " + " | ".join(line))
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        results[condition] = per_case
        for name, threshold, *_ in cases:
            rows.append(summarize(name, threshold, label, per_case[name]))

    log("")
    log(
        "| case | threshold | condition | passed/failed/inconclusive | overhead median (range) | rounds (median) | "
        "check time (median) |"
    )
    log("|---|---|---|---|---|---|---|")
    for row in rows:
        log(verdict_line(row))
    log("")
    log(wait_line(rows))
    for line in target(rows):
        log(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "threshold": THRESHOLD,
                    "near_threshold": near_threshold,
                    "near_extra_matmuls": extra,
                    "calibration": {"clean": clean, "near": near},
                    "rows": rows,
                    "runs": results,
                    "torch_threads": torch.get_num_threads(),
                    "cpus": cpus,
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
