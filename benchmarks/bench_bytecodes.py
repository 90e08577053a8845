"""The Python bytecodes watching adds to a training step: the count that predicts a watched step's time.

On the op-bound steps of ``bench_step_checks.py`` the defaults' cost in time follows the number of
bytecodes they add to a step, not their instruction count: between torch's kernels the interpreter's
dispatch of each one runs cold (an indirect branch mispredicted, the instruction cache missed), 20-25 ns
a bytecode on a 2-core virtual machine where the quiet SGD step takes 185 us (``docs/cost.md``, "A training
step"). The count is exact and the same from run to run: it shows a change of a few bytecodes a step that
no clock on a shared machine resolves.

Every bytecode of every frame is counted (``sys.settrace``, opcode events) over ``--steps`` steps after
``--warm`` uncounted ones, on each op-bound workload, and each variant is reported as what it adds to
the unwatched step ``A``: the plugin's own code, and torch's Python code it calls (``is_dynamo_compiling``):

- ``F``  do-nothing hooks where the default watch hooks in (``bench_step_checks.py --floor``);
- ``S``  the two step checks, every step marked ``with run.step():``;
- ``B``  the default invariants, every step marked;
- ``C``  the default watch with no step marked (its steps found at ``optimizer.step()``);
- ``I``  (with ``--invariants``, as in ``bench_step_checks.py``) exactly those invariants, every step marked.

``--by-function`` lists where each variant's bytecodes are. ``--against PATH`` counts another checkout
of the package (the previous release) in a process of its own. On CPython 3.11, where ``CEILINGS`` were
counted, the exit status is 1 when ``B`` adds more bytecodes to a step than its ceiling (this release's
count and a margin of 5%): a guard that a change did not make the watched step slower. Other versions
compile to other bytecodes; there the counts are reported only. ``--smoke`` counts 5 steps (the same
count: each step runs the same bytecodes), and checks the ceilings too.

    python benchmarks/bench_bytecodes.py [--workload op-bound] [--by-function] [--against /tmp/prev]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from types import FrameType
from typing import Any, Callable, Optional

WORKLOADS = ("op-bound-sgd", "op-bound-adam", "op-bound-residual")
VARIANTS = ("F", "S", "B", "C")
#: What ``B`` may add to a step on CPython 3.11: this release's count (497 / 1041 / 497) and 5%. The
#: previous release added 243 / 589 / 243; what this one adds and buys (``docs/cost.md``, CHANGELOG): the
#: engine's exact guard around every probe wrapper (its frame and the tracked original's: about 80 on the
#: SGD step, 280 on Adam's six counter reads), the core's step rules stated once (about 85), and the
#: equality-transparent holders of the namespace functions still replaced.
CEILINGS = {"op-bound-sgd": 522, "op-bound-adam": 1093, "op-bound-residual": 522}


class Counter:
    """Counts the bytecodes every frame runs (``sys.settrace``, opcode events), by function."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()

    def _trace(self, frame: FrameType, event: str, arg: Any) -> Optional[Callable[..., Any]]:
        frame.f_trace_opcodes = True
        if event == "opcode":
            code = frame.f_code
            name = getattr(code, "co_qualname", code.co_name)
            self.counts[f"{os.path.basename(code.co_filename)}:{name}"] += 1
        return self._trace

    def count(self, steps: Iterator[None], n: int) -> collections.Counter[str]:
        self.counts = collections.Counter()
        sys.settrace(self._trace)
        try:
            for _ in range(n):
                next(steps)
        finally:
            sys.settrace(None)
        return self.counts


def measure(workloads: list[str], steps: int, warm: int, invariants: Any) -> dict[str, dict[str, dict[str, int]]]:
    """``{workload: {variant: {function: bytecodes over the counted steps}}}``, ``A`` the unwatched step."""
    import bench_step_checks as bench
    import torch

    from pytest_torchperf import watch
    from pytest_torchperf.options import Options

    torch.set_num_threads(1)
    counter = Counter()
    # The variants of bench_step_checks.py: S turns off every default but the two step checks.
    defaults = Options().enabled_checks
    step_checks = {name: False for name in defaults if name not in ("no_host_sync", "on_device")}
    out: dict[str, dict[str, dict[str, int]]] = {}
    for kind in workloads:
        step, _ = bench.build(kind)
        for _ in range(60):
            step()

        def marked(run: Any) -> Iterator[None]:
            while True:
                with run.step():
                    step()  # noqa: B023 - called in this iteration
                yield

        def unmarked() -> Iterator[None]:
            while True:
                step()  # noqa: B023 - called in this iteration
                yield

        def counted(steps_: Iterator[None]) -> dict[str, int]:
            for _ in range(warm):
                next(steps_)
            return dict(counter.count(steps_, steps))

        results: dict[str, dict[str, int]] = {"A": counted(unmarked())}
        undo = bench.floor_hooks()
        try:
            results["F"] = counted(marked(bench._FloorStep()))
        finally:
            undo()
        with watch(**step_checks) as run:
            results["S"] = counted(marked(run))
        with watch() as run:
            results["B"] = counted(marked(run))
        with watch():
            results["C"] = counted(unmarked())
        if invariants is not None:
            with watch(**invariants) as run:
                results["I"] = counted(marked(run))
        out[kind] = results
    return out


def added(per: dict[str, dict[str, int]], variant: str, steps: int) -> float:
    """The bytecodes ``variant`` adds to a step of the unwatched ``A``."""
    return (sum(per[variant].values()) - sum(per["A"].values())) / steps


def show(label: str, counts: dict[str, dict[str, dict[str, int]]], steps: int, by_function: bool) -> None:
    names = [v for v in (*VARIANTS, "I") if any(v in per for per in counts.values())]
    print(f"{label}: the bytecodes each variant adds to a step")
    print(f"  {'workload':<20}{'A':>8}" + "".join(f"{v:>8}" for v in names))
    for kind, per in counts.items():
        a = sum(per["A"].values()) / steps
        print(f"  {kind:<20}{a:>8.0f}" + "".join(f"{added(per, v, steps):>+8.0f}" for v in names if v in per))
    if not by_function:
        return
    for kind, per in counts.items():
        for variant in names:
            if variant not in per:
                continue
            base = per["A"]
            diff = {name: value - base.get(name, 0) for name, value in per[variant].items()}
            top = sorted((item for item in diff.items() if item[1]), key=lambda item: -abs(item[1]))[:8]
            cells = ", ".join(f"{name} {value / steps:+.0f}" for name, value in top)
            print(f"  {kind} {variant}: {cells}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=("op-bound", *WORKLOADS), default="op-bound")
    parser.add_argument("--steps", type=int, default=20, help="counted steps a variant (default 20)")
    parser.add_argument("--warm", type=int, default=10, help="uncounted steps first (default 10)")
    parser.add_argument(
        "--invariants",
        help="variant I: exactly these invariants (name or name=value, comma-separated; 'defaults': the defaults)",
    )
    parser.add_argument("--by-function", action="store_true", help="where each variant's bytecodes are")
    parser.add_argument("--against", metavar="PATH", help="also count another checkout of the package")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 1 or args.warm < 0:
        parser.error("--steps must be at least 1 and --warm at least 0")
    if args.smoke:
        args.steps, args.warm = 5, 5
    workloads = list(WORKLOADS) if args.workload == "op-bound" else [args.workload]
    invariants = None
    if args.invariants:
        from bench_step_checks import chosen_invariants

        invariants = chosen_invariants(args.invariants)
    counts = measure(workloads, args.steps, args.warm, invariants)
    if args.json:
        print(json.dumps(counts))
        return 0
    import torch

    print(f"Python {sys.version.split()[0]}, torch {torch.__version__}, {args.steps} steps counted after {args.warm}")
    show("this", counts, args.steps, args.by_function)
    if args.against:
        forwarded = ["--workload", args.workload, "--steps", str(args.steps), "--warm", str(args.warm), "--json"]
        if args.invariants:
            forwarded += ["--invariants", args.invariants]
        from _against import checkout_env

        done = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *forwarded],
            env=checkout_env(args.against), cwd=os.path.abspath(args.against), capture_output=True, text=True,
        )
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
        show(f"other ({args.against})", json.loads(done.stdout.splitlines()[-1]), args.steps, args.by_function)
    if sys.version_info[:2] != (3, 11):
        print("(ceilings are for CPython 3.11: not checked here)")
        return 0
    over = [
        f"{kind}: B adds {added(per, 'B', args.steps):.0f} > {CEILINGS[kind]}"
        for kind, per in counts.items()
        if added(per, "B", args.steps) > CEILINGS[kind]
    ]
    for line in over:
        print(f"OVER the ceiling: {line}")
    return 1 if over else 0


if __name__ == "__main__":
    raise SystemExit(main())
