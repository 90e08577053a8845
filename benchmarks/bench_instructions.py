"""What watching adds, counted in instructions: the step and fit budgets' figures where time cannot tell.

On a shared machine the same unwatched step moves by 10-20% from block to block, so a budget of 2% cannot
be read off a clock. Callgrind counts the instructions a block runs, the same from run to run to within a
few thousand a step. Each count is a lower bound of the cost in time: the plugin's code meets the branch
predictor and the instruction cache cold, so one of its instructions takes about three of torch's
(callgrind's cache and branch simulation, 2026-12-02: ``CHANGELOG.md``; ``docs/cost.md``, "A training step").

What is counted, in one process under ``valgrind --tool=callgrind`` (the cyclic collector off, so that a
collection does not land in one block and not another):

- the op-bound steps of ``bench_step_checks.py``, ``--steps`` steps a block: ``A`` unwatched, ``S`` the two
  step checks, ``B`` the default invariants, every step marked, ``C`` the default watch with no step
  marked, ``F`` do-nothing hooks where the watch hooks in (its ``--floor``; a checkout whose benchmark
  lacks it counts none);
- the tiny Lightning fit of ``bench_watch_fit.py`` (2 epochs x 64 steps), unwatched and inside
  ``watch()``, the watch's start and end included.

Each block is counted ``--blocks`` times, in turn with the others. ``--against PATH`` counts another
checkout of the package the same way, in a process of its own (a count needs no interleaving). Needs
valgrind with its headers (``valgrind/callgrind.h``) and a C compiler; without them it says so and, with
``--smoke``, exits 0.

    python benchmarks/bench_instructions.py [--workload op-bound] [--steps 150] [--against /tmp/prev] [--smoke]
"""

from __future__ import annotations

import argparse
import gc
import glob
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = ("op-bound-sgd", "op-bound-adam", "op-bound-residual")
STEP_VARIANTS = ("A", "S", "B", "C", "F")

#: Callgrind's client requests, as two C functions the counted process calls through ctypes.
_HELPER = """
#include <valgrind/callgrind.h>
void count_start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void count_stop(const char *label) { CALLGRIND_DUMP_STATS_AT(label); CALLGRIND_STOP_INSTRUMENTATION; }
"""


def missing() -> str:
    """What this machine lacks to count (empty when nothing)."""
    if shutil.which("valgrind") is None:
        return "valgrind is not installed"
    if not (shutil.which("cc") or shutil.which("gcc")):
        return "no C compiler (cc, gcc)"
    return ""


def build_helper(folder: str) -> str:
    """The client-request library, compiled into ``folder``; raises with the compiler's message."""
    source, library = os.path.join(folder, "count.c"), os.path.join(folder, "libcount.so")
    with open(source, "w") as f:
        f.write(_HELPER)
    compiler = shutil.which("cc") or shutil.which("gcc") or "cc"
    done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", library, source], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"could not build the callgrind helper (valgrind's headers?): {done.stderr.strip()}")
    return library


# -- the counted process -------------------------------------------------------------------------------------

def _inner(args: argparse.Namespace) -> int:
    import ctypes

    import bench_step_checks as steps_bench
    import torch

    import pytest_torchperf

    print(f"counted: {pytest_torchperf.__file__}", file=sys.stderr)
    torch.set_num_threads(1)
    helper = ctypes.CDLL(args.helper)
    helper.count_stop.argtypes = [ctypes.c_char_p]

    def counted(label: str, body: Callable[[], Any]) -> Any:
        helper.count_start()
        try:
            return body()
        finally:
            helper.count_stop(label.encode())

    for kind in args.workloads:
        step, _ = steps_bench.build(kind)
        for _ in range(60):
            step()
        floor = hasattr(steps_bench, "floor_hooks")
        name = [""]

        def block(steps: Any) -> float:
            for _ in range(5):  # uncounted: the first steps after the probes go in
                next(steps)
            gc.collect()
            gc.disable()
            try:
                counted(f"{kind} {name[0]}", lambda: [next(steps) for _ in range(args.steps)])  # noqa: B023 - called in this iteration
            finally:
                gc.enable()
            return 0.0

        def plain_steps():  # type: ignore[no-untyped-def]
            # The step's loss is dropped at once, as in a watched step: kept in the block's list, it held
            # its graph's nodes (freed uncounted, after the block) and the parameters' grad accumulators
            # (built anew every step once that graph is gone): 7-30 k instructions a step that only
            # the watched variants paid.
            while True:
                step()  # noqa: B023 - called in this iteration
                yield

        def watched_steps(run):  # type: ignore[no-untyped-def]
            while True:
                with run.step():
                    step()  # noqa: B023 - called in this iteration
                yield

        variants = steps_bench.variants_for(None, floor)(block, plain_steps, watched_steps)
        for _ in range(args.blocks):
            for variant in STEP_VARIANTS:
                if variant in variants and variant in args.variants:
                    name[0] = variant
                    variants[variant]()
    if args.fits:
        import logging

        import bench_watch_fit

        fit = bench_watch_fit.build(0)
        for name_ in ("pytorch_lightning", "lightning.pytorch", "lightning.fabric", "lightning_fabric"):
            logging.getLogger(name_).setLevel(logging.WARNING)

        def watched() -> None:
            with pytest_torchperf.watch():
                fit()

        fit()
        watched()
        for _ in range(args.fits):
            for label, body in (("fit A", fit), ("fit B", watched)):
                gc.collect()
                gc.disable()
                try:
                    counted(label, body)
                finally:
                    gc.enable()
    return 0


# -- the driver ----------------------------------------------------------------------------------------------

def count(root: str | None, args: argparse.Namespace, helper: str, folder: str) -> dict[str, list[int]]:
    """Run the counted process on checkout ``root`` (None: this one); ``{label: [instructions per block]}``."""
    out = os.path.join(folder, "cg.%p")
    from _against import checkout_env

    env = checkout_env(root, PYTHONHASHSEED="0")
    command = [
        "valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
        sys.executable, os.path.abspath(__file__), "--inner", "--helper", helper,
        "--steps", str(args.steps), "--blocks", str(args.blocks), "--fits", str(args.fits),
        "--variants", "".join(args.variants), "--workloads", *args.workloads,
    ]
    done = subprocess.run(command, env=env, cwd=os.path.abspath(root) if root else None, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or "").splitlines()[-25:])
        raise RuntimeError(f"the counted process failed ({done.returncode}):\n{tail}")
    for line in done.stderr.splitlines():
        if line.startswith("counted: "):
            print(line)
    counts: dict[str, list[int]] = {}
    # Dumps are numbered in the order they were taken: cg.PID.1, cg.PID.2, ...
    dumps = sorted(glob.glob(os.path.join(folder, "cg.*.*")), key=lambda p: int(p.rsplit(".", 1)[1]))
    for path in dumps:
        label, total = None, None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("desc: Trigger: Client Request: "):
                    label = line.split(": ", 2)[2].split(": ", 1)[1].strip()
                elif line.startswith(("summary:", "totals:")) and total is None:
                    total = int(line.split()[1])
                if label is not None and total is not None:
                    break
        if label is not None and total is not None:
            counts.setdefault(label, []).append(total)
        os.remove(path)
    for path in glob.glob(os.path.join(folder, "cg.*")):
        os.remove(path)
    return counts


def report(title: str, counts: dict[str, list[int]], args: argparse.Namespace) -> None:
    print(f"\n{title}")
    for kind in args.workloads:
        base = counts.get(f"{kind} A")
        if not base:
            continue
        a = statistics.mean(base) / args.steps
        cells = [f"{kind:<18} A {a / 1e6:6.3f} M/step"]
        for variant in STEP_VARIANTS[1:]:
            blocks = counts.get(f"{kind} {variant}")
            if blocks:
                extra = statistics.mean(blocks) / args.steps - a
                cells.append(f"{variant} {extra / 1e3:+7.1f} k ({1 + extra / a:.4f})")
        print("  ".join(cells))
    fits_a, fits_b = counts.get("fit A"), counts.get("fit B")
    if fits_a and fits_b:
        a = statistics.mean(fits_a)
        extras = ", ".join(f"{(b - x) / 1e6:+.1f} M ({b / x:.4f})" for x, b in zip(fits_a, fits_b))
        print(f"{'tiny fit':<18} A {a / 1e6:6.1f} M/fit  watched: {extras}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("op-bound", *WORKLOADS), default="op-bound")
    parser.add_argument("--steps", type=int, default=150, help="steps per counted block")
    parser.add_argument("--blocks", type=int, default=2, help="counted blocks per variant")
    parser.add_argument("--fits", type=int, default=2, help="counted fits each, unwatched and watched (0: none)")
    parser.add_argument("--against", metavar="PATH", help="also count another checkout of the package")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--helper", help=argparse.SUPPRESS)
    parser.add_argument("--workloads", nargs="*", help=argparse.SUPPRESS)
    parser.add_argument("--variants", default="".join(STEP_VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("steps", "blocks"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    if args.fits < 0:
        parser.error(f"--fits must be 0 or more, not {args.fits}")
    if args.inner:
        return _inner(args)
    if args.smoke:
        args.workload, args.steps, args.blocks, args.fits, args.variants = "op-bound-sgd", 10, 1, 0, "AB"
    args.workloads = list(WORKLOADS) if args.workload == "op-bound" else [args.workload]
    why = missing()
    if why:
        print(f"bench_instructions: cannot count here: {why}")
        return 0 if args.smoke else 2
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as folder:
        try:
            helper = build_helper(folder)
        except RuntimeError as exc:
            print(f"bench_instructions: cannot count here: {exc}")
            return 0 if args.smoke else 2
        print(f"callgrind, {args.steps} steps a block, {args.blocks} block(s) a variant, {args.fits} fit(s) each; "
              "extra instructions per step (ratio to A)")
        report("this checkout", count(None, args, helper, folder), args)
        if args.against:
            report(f"other: {args.against}", count(args.against, args, helper, folder), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
