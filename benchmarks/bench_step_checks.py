"""What the step checks (``no_host_sync`` and ``on_device``) cost a training step, interleaved A/B.

Budget (issues 3 and 4): with the default checks on, a step of a tiny op-bound
MLP (batch 32, width 64, one CPU thread) runs at most 1.05x its unwatched
time, and a compute-bound step at most 1.02x.

Variants, timed in one process over the same model and data:

- ``A``  unwatched;
- ``A'`` unwatched again: the A/A calibration (this machine's noise);
- ``S``  inside ``pytest_torchperf.watch()`` checking only the two step
  checks (so only their probes, ``_tensors``, ``syncs``, ``placement``, and
  the Lightning observer are installed) and every step marked ``with
  run.step():``, so the step checks apply to every operation;
- ``B``  the same with the default ``watch()``: every default invariant
  (the budget line: what a user pays for the defaults together);
- ``C``  default ``watch()`` without ``run.step()``: the probes installed, no
  step in scope (what code outside the steps pays);
- ``O``  (with ``--ops``) ``B`` plus ``max_ops_per_step`` (opt-in): every ATen op of
  every step counted by a dispatch mode (the warm-up steps excluded, as in a test).

Each step is timed alone and a block's time is its median step (a step
preempted by another process is an outlier the median ignores). Each round
runs every variant ``--reps`` times, interleaved, in an order that rotates
every time, and keeps each variant's median block; the ratios B/A, C/A and
A'/A are taken per round. Reported: the median microseconds per step of
each variant, and the median and spread (25th-75th percentile) of the
per-round ratios. The first round is a warm-up and is dropped. Each block
enters its ``watch()`` and runs a few untimed steps before its clock starts:
installing the probes is a per-test cost, not a per-step one.

Workloads:

- ``op-bound-sgd``:  3-layer MLP, width 64, batch 32, SGD with momentum;
- ``op-bound-adam``: the same with Adam (which reads its host ``step`` counter
  with ``.item()`` once per parameter per step: inside a step, on every call);
- ``op-bound-residual``: 3 residual blocks ``h = h + 0.5 * relu(linear(h))``,
  width 64, batch 32, SGD: Python arithmetic on tensors in the forward pass,
  which the host-provenance wrappers (``+ - * /``, comparisons) see on every call;
- ``compute-bound``: 3-layer MLP, width 512, batch 256, Adam.

Every step moves its batch with ``.to(device)``, as a real loop does.

    python benchmarks/bench_step_checks.py [--rounds 21] [--reps 3] [--workload all] [--ops] [--smoke]

``--smoke``: 2 rounds of 1 block of the op-bound SGD workload (a CI check that it runs; no verdict).

Exit status 1 when a median S/A ratio is over its budget.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

BUDGETS = {"op-bound-sgd": 1.05, "op-bound-adam": 1.05, "op-bound-residual": 1.05, "compute-bound": 1.02}


def build(kind: str) -> tuple[Callable[[], object], int]:
    """The step function of a workload and how many steps make one timed block."""
    import torch

    torch.manual_seed(0)
    if kind.startswith("op-bound"):
        width, batch, steps = 64, 32, 100
    else:
        width, batch, steps = 512, 256, 3
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )
    if kind == "op-bound-residual":
        model = _Residual(torch, width)
    if kind in ("op-bound-sgd", "op-bound-residual"):
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    else:
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width)
    y = torch.randn(batch, 1)
    device = torch.device("cpu")

    def step() -> object:
        xb, yb = x.to(device), y.to(device)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        loss.backward()
        opt.step()
        return loss

    return step, steps


def _Residual(torch: object, width: int) -> object:
    nn = torch.nn  # type: ignore[attr-defined]

    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(3))
            self.head = nn.Linear(width, 1)

        def forward(self, h: object) -> object:
            for block in self.blocks:
                h = h + 0.5 * torch.relu(block(h))  # type: ignore[attr-defined, operator]
            return self.head(h)

    return Residual()


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def interleaved(
    step: Callable[[], object], n: int, rounds: int, reps: int, variants_of: Callable[..., dict[str, Callable[[], float]]]
) -> dict[str, list[float]]:
    """Each variant's median step time per round, the variants run interleaved (see the module's docstring).

    ``variants_of(block, plain_steps, watched_steps)`` names the variants: ``block(steps)`` times ``n``
    steps of a step generator, ``plain_steps()`` runs ``step``, ``watched_steps(run)`` runs it inside
    ``run.step()``.
    """
    warm = max(n // 20, 1)
    for _ in range(max(n * 3, 20)):
        step()

    clock = time.perf_counter

    def block(steps: object) -> float:
        """The median time of one step over ``n`` steps, each timed alone (a step preempted by another
        process is an outlier the median ignores)."""
        for _ in range(warm):  # untimed: caches settle after the probes are (un)installed
            next(steps)  # type: ignore[call-overload]
        durations = []
        for _ in range(n):
            start = clock()
            next(steps)  # type: ignore[call-overload]
            durations.append(clock() - start)
        return statistics.median(durations)

    def plain_steps():  # type: ignore[no-untyped-def]
        while True:
            yield step()

    def watched_steps(run):  # type: ignore[no-untyped-def]
        while True:
            with run.step():
                step()
            yield

    variants = variants_of(block, plain_steps, watched_steps)
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        samples: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            shift = (r + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(variants[name]())
        if r == 0:
            continue  # warm-up
        for name in names:
            times[name].append(statistics.median(samples[name]))
    return times


def measure(kind: str, rounds: int, reps: int, ops: bool = False) -> dict[str, object]:
    from pytest_torchperf import watch

    def variants(block: Any, plain_steps: Any, watched_steps: Any) -> dict[str, Callable[[], float]]:
        def plain() -> float:
            return block(plain_steps())

        def watched() -> float:
            with watch() as run:
                return block(watched_steps(run))

        def installed() -> float:
            with watch():
                return block(plain_steps())

        def step_checks_only() -> float:
            # Probes are installed for the invariants a run checks: these two alone.
            with watch(
                no_iterator_reset=False, no_data_parallel=False, no_graph_breaks=False, no_debug_modes=False
            ) as run:
                return block(watched_steps(run))

        def counted() -> float:
            # count_warmup_steps=0: the block's untimed warm-up steps already are its warm-up.
            with watch(max_ops_per_step=10**9, count_warmup_steps=0) as run:
                return block(watched_steps(run))

        out = {"A": plain, "A'": plain, "S": step_checks_only, "B": watched, "C": installed}
        if ops:
            out["O"] = counted
        return out

    step, n = build(kind)
    times = interleaved(step, n, rounds, reps, variants)
    ratios = {
        f"{name}/A": [b / a for b, a in zip(times[name], times["A"])]
        for name in ("S", "B", "C", "A'") + (("O",) if ops else ())
    }
    return {
        "median_us": {name: statistics.median(v) * 1e6 for name, v in times.items()},
        "ratios": {name: quartiles(v) for name, v in ratios.items()},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (after one warm-up round)")
    parser.add_argument("--reps", type=int, default=5, help="blocks per variant per round (their median is kept)")
    parser.add_argument("--workload", choices=("all", *BUDGETS), default="all")
    parser.add_argument("--ops", action="store_true", help="also time max_ops_per_step (opt-in op counting): O")
    parser.add_argument("--smoke", action="store_true", help="a tiny run (2 rounds, 1 block, op-bound-sgd)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.reps, args.workload = 2, 1, "op-bound-sgd"

    import torch

    torch.set_num_threads(1)
    workloads = list(BUDGETS) if args.workload == "all" else [args.workload]
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} rounds (+1 warm-up) x {args.reps} interleaved blocks per variant")
    print()
    header = (
        f"{'workload':<15} {'A us':>8} {'S us':>8} {'B us':>8} {'C us':>8} "
        f"{'S/A median [IQR]':>22} {'B/A median [IQR]':>22} {'C/A median [IQR]':>22} {'A/A median [IQR]':>22} {'budget':>10}"
    )
    print(header)
    print("-" * len(header))
    status = 0
    AA = "A'/A"
    for kind in workloads:
        result = measure(kind, args.rounds, args.reps, args.ops)
        us = result["median_us"]
        ratios = result["ratios"]

        def fmt(name: str) -> str:
            lo, mid, hi = ratios[name]  # type: ignore[index]
            return f"{mid:.3f} [{lo:.3f}-{hi:.3f}]"

        budget = BUDGETS[kind]
        ok = ratios["S/A"][1] <= budget  # type: ignore[index]
        status |= 0 if ok else 1
        print(
            f"{kind:<15} {us['A']:>8.1f} {us['S']:>8.1f} {us['B']:>8.1f} {us['C']:>8.1f} "  # type: ignore[index]
            f"{fmt('S/A'):>22} {fmt('B/A'):>22} {fmt('C/A'):>22} {fmt(AA):>22} "
            f"{'S <=' + str(budget):>8} {'ok' if ok else 'OVER'}"
        )
        if args.ops:
            lo, mid, hi = ratios["O/A"]  # type: ignore[index]
            extra = (us["O"] - us["B"])  # type: ignore[index]
            o_us = us["O"]  # type: ignore[index]
            print(f"{'':<15} O (max_ops_per_step) {o_us:.1f} us, O/A {mid:.3f} [{lo:.3f}-{hi:.3f}], "
                  f"+{extra:.1f} us per step over B")
    return 0 if args.smoke else status


if __name__ == "__main__":
    raise SystemExit(main())
