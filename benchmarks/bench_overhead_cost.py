"""What ``max_overhead`` costs a test, in fits of that test's CPU time, against another release in one run.

Each round runs, per case, the same test twice: marked with the defaults
(``D``: the fit inside ``watch()``) and marked ``max_overhead=0.5`` too (``M``:
the fit, then the check's timing replay), in an order that alternates every
round. The cost of the check is ``(M - D) / D``: extra fits of the test, in the
process's CPU time (user + sys, every thread, children included), so that
other work on the machine costs neither side anything but cache misses. Cases
(from ``bench_overhead_load``): ``far``, a 784-128-10 MLP, 2 epochs x 32
batches, Lightning about +85% over its vanilla loop; ``heavy``, a 4x512 MLP, 3
epochs x 8 batches, about +5%. Both clear of the threshold 0.5: the figures are
what a clear verdict costs.

``--against PATH`` runs the same rounds in a second process that imports
another checkout (the previous release: ``git worktree add PATH <commit>``),
the two processes' rounds interleaved (``_against.py``), so both releases'
figures come from one machine state. Reported per case and release: the
median [IQR] of the extra fits, the verdicts, the rounds timed, the measured
overhead, and how long our timing thread waited for a CPU (above 5% the
early look after two rounds is not taken: the machine was loaded).

    python benchmarks/bench_overhead_cost.py --rounds 10 --against /tmp/release
    python benchmarks/bench_overhead_cost.py --smoke
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import statistics
import sys
import tempfile
import warnings
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _against import Workers, serve  # noqa: E402

THRESHOLD = 0.5


def cpu() -> float:
    """CPU seconds of this process and its waited-for children, user + sys."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def setup() -> None:
    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    for name in ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)


def one_test(root: str, case: str, marked: bool, overhead_rounds: int) -> dict[str, Any]:
    """One test of ``case``: the fit watched with the defaults, and with ``max_overhead`` when ``marked``."""
    from bench_max_overhead import make_trainer
    from bench_overhead_load import CASES

    from pytest_torchperf import InvariantViolation, watch
    from pytest_torchperf.report import Inconclusive

    module, loader, epochs = CASES[case]
    kwargs: dict[str, Any] = {"max_overhead": THRESHOLD, "overhead_rounds": overhead_rounds} if marked else {}
    started = cpu()
    run = None
    try:
        with watch(**kwargs) as run:
            trainer = make_trainer(root)
            trainer.fit_loop.max_epochs = epochs
            trainer.fit(module(), loader())
    except (InvariantViolation, Inconclusive):
        pass
    out: dict[str, Any] = {"cpu_s": cpu() - started}
    if marked:
        assert run is not None and run.report is not None
        fit = run.report["max_overhead"].figures["fits"][0]
        out.update(
            verdict=fit.get("verdict", "not timed"), rounds=fit.get("rounds", 0), overhead=fit.get("overhead"),
            wait=(fit.get("load") or {}).get("cpu_wait_fraction"),
        )
    return out


def round_runner(cases: list[str], overhead_rounds: int) -> Any:
    """``one_round()``: each case's D and M tests, in an order that alternates every round."""
    setup()
    scratch = tempfile.TemporaryDirectory(prefix="bench-overhead-cost-")
    for case in cases:  # warm the process up: imports, the first fit, the first replay
        one_test(scratch.name, case, True, overhead_rounds)
    count = [0]

    def one_round() -> dict[str, Any]:
        count[0] += 1
        out: dict[str, Any] = {}
        for case in cases:
            order = (False, True) if count[0] % 2 else (True, False)
            tests = {marked: one_test(scratch.name, case, marked, overhead_rounds) for marked in order}
            plain, marked = tests[False], tests[True]
            fits = (marked["cpu_s"] - plain["cpu_s"]) / plain["cpu_s"]
            out[case] = {**marked, "fits": fits, "test_s": plain["cpu_s"]}
        return out

    one_round.scratch = scratch  # type: ignore[attr-defined]  # removed with the runner
    return one_round


def quartiles(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.2f}"
    q = statistics.quantiles(values, n=4, method="inclusive")
    return f"{q[1]:.2f} [{q[0]:.2f}-{q[2]:.2f}]"


def per_round(runs: list[dict[str, Any]]) -> str:
    """The least-squares line ``fits = fixed + each x rounds``: a release's fixed part (warm-up, set-up) and price
    of one round, apart (the rounds a verdict takes vary with the machine's load far more than either)."""
    xs, ys = [float(r["rounds"]) for r in runs], [r["fits"] for r in runs]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return f"{my:.2f} at {mx:g} rounds"
    each = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return f"{my - each * mx:.2f} + {each:.2f} x rounds"


def report(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    lines = [
        "| case | release | extra fits (CPU), median [IQR] | passed / failed / inconclusive | rounds median (max) "
        "| fits = fixed + per round | overhead median | CPU wait median | a test marked with the defaults |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case, by_release in results.items():
        for release, runs in by_release.items():
            verdicts = [sum(r["verdict"] == v for r in runs) for v in ("passed", "failed", "inconclusive")]
            rounds = [r["rounds"] for r in runs]
            overheads = [r["overhead"] for r in runs if r["overhead"] is not None]
            waits = [r["wait"] or 0.0 for r in runs]
            lines.append(
                f"| {case} | {release} | {quartiles([r['fits'] for r in runs])} | {' / '.join(map(str, verdicts))} "
                f"| {statistics.median(rounds):g} ({max(rounds)}) | {per_round(runs)} "
                f"| {statistics.median(overheads):+.1%} "
                f"| {statistics.median(waits):.0%} | {statistics.median(r['test_s'] for r in runs):.2f} s CPU |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds (each: every case, D and M) (default 10)")
    parser.add_argument("--case", choices=("all", "far", "heavy"), default="all")
    parser.add_argument("--overhead-rounds", type=int, default=10, help="the check's overhead_rounds (default 10)")
    parser.add_argument("--against", metavar="PATH", help="another checkout (the previous release), interleaved")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (the figures mean nothing)")
    parser.add_argument("--json", help="write every round's figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.case, args.overhead_rounds, args.against = 1, "far", 4, None
    cases = ["far", "heavy"] if args.case == "all" else [args.case]
    if args.worker:
        serve(round_runner(cases, args.overhead_rounds))
        return 0
    results: dict[str, dict[str, list[dict[str, Any]]]] = {case: {} for case in cases}
    if args.against is None:
        one_round = round_runner(cases, args.overhead_rounds)
        rounds = ({"this": one_round()} for _ in range(args.rounds))
        workers = None
    else:
        forwarded = ["--case", args.case, "--overhead-rounds", str(args.overhead_rounds)]
        workers = Workers(os.path.abspath(__file__), forwarded, {"this": None, "previous": args.against})
        rounds = workers.rounds(args.rounds)
    try:
        for i, by_release in enumerate(rounds):
            for release, figures in by_release.items():
                for case in cases:
                    r = figures[case]
                    results[case].setdefault(release, []).append(r)
                    print(
                        f"round {i + 1:2d} {release:8} {case:5}: {r['fits']:.2f} fits, {r['verdict']}, "
                        f"{r['rounds']} rounds, {r['overhead']:+.1%}, wait {r['wait'] or 0:.0%}",
                        flush=True,
                    )
    finally:
        if workers is not None:
            workers.close()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{cpus} CPUs, load average {load:.1f} at the end; max_overhead={THRESHOLD}, "
          f"overhead_rounds={args.overhead_rounds}")
    print("\n".join(report(results)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
