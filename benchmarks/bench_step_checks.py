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
  step in scope (what code outside the steps pays).

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

- ``I``  (with ``--invariants name,name=value``) exactly those invariants, every
  other one off, every step marked: what a new invariant costs on its own, or
  the defaults plus it (``--invariants defaults,no_graph_retention``).
- ``F``  (with ``--floor``) unwatched, but every place the default watch hooks
  into on these steps taken by a Python function that does nothing else:
  ``Tensor.to`` (and ``Tensor.item``, for Adam's host step counters), and each
  step in a ``with`` block whose ``__enter__`` reads the three debug switches
  ``no_debug_modes`` polls. What any design of Python hooks at these points pays
  before it checks anything: the floor under ``B`` on this machine. (Until the
  watch stopped calling optimizer hooks on a marked step, ``F`` had a global
  optimizer pre-hook and post-hook too; until it took its backward wrapper out
  once the steps are marked, a wrapper of ``torch.autograd._engine_run_backward``.)

``--against PATH`` runs the same rounds in a second process on another checkout
of the package (the previous release: ``git archive <commit> | tar -x -C PATH``),
the two processes' rounds interleaved, so both releases' ratios come from one
run on one machine state. ``--clock cpu`` times each step in the thread's CPU
time instead of wall time (a step preempted by another process then costs
nothing extra: for a machine shared with other work). ``--stat p10`` takes a
block's 10th-percentile step instead of its median: where other work shares the
machine, a neighbour's load slows a block's steps for seconds at a time and the
median moves with it, while the fastest tenth of the steps had the core's caches
to themselves (on a 2-core virtual machine under load, the A/A ratio's spread
was 2-4 points wide with p10 and 10-25 with the median). A cost that comes only
every few steps is left out by it; every step pays the default checks' cost.
``--smoke``: a tiny setting for CI (variant F included, ``--stat p10``).

    python benchmarks/bench_step_checks.py [--rounds 21] [--reps 5] [--workload all]
    python benchmarks/bench_step_checks.py --invariants defaults,no_graph_retention --workload op-bound-sgd
    python benchmarks/bench_step_checks.py --against /tmp/prev --clock cpu
    python benchmarks/bench_step_checks.py --floor --workload op-bound-sgd --clock cpu
    python benchmarks/bench_step_checks.py --workload op-bound --clock cpu --stat p10 --against /tmp/prev

Exit status 1 when a median S/A or B/A ratio is over its budget (S only on the budget line before).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable

BUDGETS = {"op-bound-sgd": 1.02, "op-bound-adam": 1.02, "op-bound-residual": 1.02, "compute-bound": 1.02}
#: The clock each step is timed with: wall time, or the thread's CPU time (``--clock cpu``).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}


def lower_decile(durations: list[float]) -> float:
    """The 10th percentile of a block's step times: the step as it runs when no other work shares the core."""
    return sorted(durations)[len(durations) // 10]


#: What a block's time is, from its steps' times (``--stat``).
STATS: dict[str, Callable[[list[float]], float]] = {"median": statistics.median, "p10": lower_decile}


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
    step: Callable[[], object],
    n: int,
    rounds: int,
    reps: int,
    variants_of: Callable[..., dict[str, Callable[[], float]]],
    clock: Callable[[], float] = time.perf_counter,
    stat: Callable[[list[float]], float] = statistics.median,
) -> dict[str, list[float]]:
    """Each variant's median step time per round, the variants run interleaved (see the module's docstring).

    ``variants_of(block, plain_steps, watched_steps)`` names the variants: ``block(steps)`` times ``n``
    steps of a step generator, ``plain_steps()`` runs ``step``, ``watched_steps(run)`` runs it inside
    ``run.step()``.
    """
    one_round = round_runner(step, n, reps, variants_of, clock, stat)
    one_round(0)  # warm-up
    times: dict[str, list[float]] = {}
    for r in range(1, rounds + 1):
        for name, value in one_round(r).items():
            times.setdefault(name, []).append(value)
    return times


def round_runner(
    step: Callable[[], object],
    n: int,
    reps: int,
    variants_of: Callable[..., dict[str, Callable[[], float]]],
    clock: Callable[[], float] = time.perf_counter,
    stat: Callable[[list[float]], float] = statistics.median,
) -> Callable[[int], dict[str, float]]:
    """``one_round(r)``: every variant ``reps`` times, in an order rotated by ``r``; each variant's median block."""
    warm = max(n // 20, 1)
    for _ in range(max(n * 3, 20)):
        step()

    def block(steps: object) -> float:
        """The time of one step over ``n`` steps, each timed alone: their median (a step preempted by
        another process is an outlier the median ignores), or what ``stat`` makes of them."""
        for _ in range(warm):  # untimed: caches settle after the probes are (un)installed
            next(steps)  # type: ignore[call-overload]
        durations = []
        for _ in range(n):
            start = clock()
            next(steps)  # type: ignore[call-overload]
            durations.append(clock() - start)
        return stat(durations)

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

    def one_round(r: int) -> dict[str, float]:
        samples: dict[str, list[float]] = {name: [] for name in names}
        for rep in range(reps):
            shift = (r + rep) % len(names)
            for name in names[shift:] + names[:shift]:
                samples[name].append(variants[name]())
        return {name: statistics.median(samples[name]) for name in names}

    return one_round


def chosen_invariants(spec: str) -> dict[str, Any]:
    """``watch()`` arguments for ``--invariants``: the named invariants on, every other one off.

    ``name`` turns a flag invariant on, ``name=value`` gives its value (``max_memory_growth=0.1``),
    ``defaults`` stands for the invariants on by default.
    """
    import ast

    from pytest_torchperf import registry
    from pytest_torchperf.options import Options

    known = registry.invariants()
    wanted: dict[str, Any] = {}
    for item in (part.strip() for part in spec.split(",")):
        if not item:
            continue
        if item == "defaults":
            wanted.update({name: True for name in Options().enabled_checks})
            continue
        name, _, value = item.partition("=")
        if name not in known:
            raise SystemExit(f"--invariants: no invariant {name!r} (known: {', '.join(known)})")
        wanted[name] = ast.literal_eval(value) if value else True
    off = {name: None if known[name].default is None else False for name in Options().enabled_checks}
    return {**off, **wanted}


class _FloorStep:
    """Variant F's ``with`` block: a Python ``__enter__`` and ``__exit__``, and the three reads of
    ``no_debug_modes``.
    """

    __slots__ = ("reads",)

    def __init__(self) -> None:
        import torch

        self.reads = (
            torch.is_anomaly_enabled,
            torch._C._autograd._profiler_enabled,
            torch._C._get_deterministic_algorithms,
        )

    def step(self) -> _FloorStep:
        return self

    def __enter__(self) -> _FloorStep:
        for read in self.reads:
            if read():
                pass
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def floor_hooks() -> Callable[[], None]:
    """Variant F's hooks: do-nothing Python functions where the default watch hooks in; returns their undo."""
    import torch

    tensor = torch.Tensor
    saved = {name: vars(tensor).get(name) for name in ("to", "item")}
    original_to, original_item = tensor.to, tensor.item

    def to(self: Any, *args: Any, **kwargs: Any) -> Any:
        return original_to(self, *args, **kwargs)

    def item(self: Any) -> Any:
        return original_item(self)

    tensor.to = to  # type: ignore[method-assign]
    tensor.item = item  # type: ignore[method-assign]

    def undo() -> None:
        for name, value in saved.items():
            if value is None:
                delattr(tensor, name)
            else:
                setattr(tensor, name, value)

    return undo


def variants_for(invariants: Any = None, floor: bool = False) -> Callable[..., dict[str, Callable[[], float]]]:
    from pytest_torchperf import watch
    from pytest_torchperf.options import Options

    def variants(block: Any, plain_steps: Any, watched_steps: Any) -> dict[str, Callable[[], float]]:
        def plain() -> float:
            return block(plain_steps())

        def watched() -> float:
            with watch() as run:
                return block(watched_steps(run))

        def installed() -> float:
            with watch():
                return block(plain_steps())

        # Probes are installed for the invariants a run checks: the two step checks alone (every other
        # default off, by the names this checkout knows: ``--against`` runs an older one too).
        only_steps = {name: False for name in Options().enabled_checks if name not in ("no_host_sync", "on_device")}

        def step_checks_only() -> float:
            with watch(**only_steps) as run:
                return block(watched_steps(run))

        out = {"A": plain, "A'": plain, "S": step_checks_only, "B": watched, "C": installed}
        if invariants is not None:

            def chosen() -> float:
                with watch(**invariants) as run:
                    return block(watched_steps(run))

            out["I"] = chosen
        if floor:

            def floor_variant() -> float:
                undo = floor_hooks()
                try:
                    return block(watched_steps(_FloorStep()))
                finally:
                    undo()

            out["F"] = floor_variant
        return out

    return variants


RATIOS = ("S", "B", "C", "I", "F", "A'")


def summarise(times: dict[str, list[float]]) -> dict[str, object]:
    ratios = {f"{name}/A": [b / a for b, a in zip(times[name], times["A"])] for name in RATIOS if name in times}
    return {
        "median_us": {name: statistics.median(v) * 1e6 for name, v in times.items()},
        "ratios": {name: quartiles(v) for name, v in ratios.items()},
    }


def measure(
    kind: str, rounds: int, reps: int, invariants: Any = None, clock: str = "wall", steps: int = 0,
    floor: bool = False, stat: str = "median",
) -> dict[str, object]:
    step, n = build(kind)
    times = interleaved(step, steps or n, rounds, reps, variants_for(invariants, floor), CLOCKS[clock], STATS[stat])
    return summarise(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21, help="timed rounds (after one warm-up round)")
    parser.add_argument("--reps", type=int, default=5, help="blocks per variant per round (their median is kept)")
    parser.add_argument("--workload", choices=("all", "op-bound", *BUDGETS), default="all")
    parser.add_argument(
        "--invariants",
        help="variant I: exactly these invariants (name or name=value, comma-separated; 'defaults' for the default "
             "ones)",
    )
    parser.add_argument("--clock", choices=tuple(CLOCKS), default="wall", help="time steps in wall or thread CPU time")
    parser.add_argument(
        "--stat", choices=tuple(STATS),
        help="a block's time: its steps' median (the default), or their 10th percentile (p10: on a machine shared "
        "with other work; the default of --smoke, so that CI runs both: bench_graph_retention.py takes medians)",
    )
    parser.add_argument("--floor", action="store_true", help="variant F: do-nothing hooks where the watch hooks in")
    parser.add_argument("--against", metavar="PATH", help="also time another checkout of the package, interleaved")
    parser.add_argument("--steps", type=int, default=0, help="steps per timed block (default: the workload's)")
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.reps, args.steps, args.floor = 2, 1, 10, True
        args.workload = "op-bound-sgd" if args.workload == "all" else args.workload
    args.stat = args.stat or ("p10" if args.smoke else "median")

    import torch

    torch.set_num_threads(1)
    if args.workload == "all":
        workloads = list(BUDGETS)
    elif args.workload == "op-bound":
        workloads = [k for k in BUDGETS if k.startswith("op-bound")]
    else:
        workloads = [args.workload]
    invariants = chosen_invariants(args.invariants) if args.invariants else None
    if args.worker:
        return _worker(workloads, args.reps, invariants, args.clock, args.steps, args.floor, args.stat)
    print(
        f"torch {torch.__version__}, 1 thread, {args.clock} clock, {args.rounds} rounds (+1 warm-up) x {args.reps} "
        f"interleaved blocks per variant, a block's {args.stat} step"
    )
    if invariants is not None:
        print(f"I: {', '.join(f'{k}={v!r}' for k, v in invariants.items() if v not in (False, None))}")
    if args.against:
        return _against(workloads, args, invariants)
    print()
    names = ["S", "B", "C"] + (["I"] if invariants is not None else []) + (["F"] if args.floor else []) + ["A'"]
    header = f"{'workload':<18} {'A us':>8} " + " ".join(f"{n + ' us':>8}" for n in names[:-1]) + " " + " ".join(
        f"{n + '/A median [IQR]':>22}" for n in names
    ) + f" {'budget':>12}"
    print(header)
    print("-" * len(header))
    status = 0
    for kind in workloads:
        result = measure(kind, args.rounds, args.reps, invariants, args.clock, args.steps, args.floor, args.stat)
        us, ratios = result["median_us"], result["ratios"]
        status |= _line(kind, us, ratios, names)  # type: ignore[arg-type]
    return 0 if args.smoke else status  # a smoke run says it runs; its few steps cannot judge a budget


def _fmt(ratios: dict[str, Any], name: str) -> str:
    lo, mid, hi = ratios[name]
    return f"{mid:.3f} [{lo:.3f}-{hi:.3f}]"


def _line(kind: str, us: dict[str, float], ratios: dict[str, Any], names: list[str], label: str = "") -> int:
    budget = BUDGETS[kind]
    ok = ratios["S/A"][1] <= budget and ratios["B/A"][1] <= budget
    print(
        f"{(label + kind):<18} {us['A']:>8.1f} " + " ".join(f"{us[n]:>8.1f}" for n in names[:-1]) + " "
        + " ".join(f"{_fmt(ratios, n + '/A'):>22}" for n in names)
        + f" {'S,B <=' + str(budget):>8} {'ok' if ok else 'OVER'}"
    )
    return 0 if ok else 1


def _worker(
    workloads: list[str], reps: int, invariants: Any, clock: str, steps: int, floor: bool, stat: str,
) -> int:
    """One process of ``--against``: one round of every workload per request (see ``_against.py``)."""
    import sys

    from _against import serve

    import pytest_torchperf

    print(f"worker: {pytest_torchperf.__file__}", file=sys.stderr)
    runners = {}
    for kind in workloads:
        step, n = build(kind)
        runners[kind] = round_runner(
            step, steps or n, reps, variants_for(invariants, floor), CLOCKS[clock], STATS[stat]
        )
    counter = [0]

    def one_round() -> dict[str, Any]:
        counter[0] += 1
        return {kind: run(counter[0]) for kind, run in runners.items()}

    serve(one_round)
    return 0


def _against(workloads: list[str], args: argparse.Namespace, invariants: Any) -> int:
    import os
    import sys

    from _against import Workers

    forwarded = ["--workload", args.workload, "--reps", str(args.reps), "--clock", args.clock, "--stat", args.stat]
    forwarded += ["--steps", str(args.steps)]
    if args.invariants:
        forwarded += ["--invariants", args.invariants]
    if args.floor:
        forwarded.append("--floor")
    workers = Workers(os.path.abspath(sys.argv[0]), forwarded, {"this": None, "other": args.against})
    times: dict[str, dict[str, dict[str, list[float]]]] = {}
    try:
        for r, by_worker in enumerate(workers.rounds(args.rounds + 1)):
            if r == 0:
                continue  # warm-up
            for label, per_kind in by_worker.items():
                for kind, values in per_kind.items():
                    for name, value in values.items():
                        times.setdefault(label, {}).setdefault(kind, {}).setdefault(name, []).append(value)
    finally:
        workers.close()
    print(f"this: the checkout the script is in; other: {args.against}; the two processes' rounds interleaved")
    print()
    names = ["S", "B", "C"] + (["I"] if invariants is not None else []) + (["F"] if args.floor else []) + ["A'"]
    status = 0
    for kind in workloads:
        for label in ("this", "other"):
            result = summarise(times[label][kind])
            code = _line(kind, result["median_us"], result["ratios"], names, label + " ")  # type: ignore[arg-type]
            status |= code if label == "this" else 0
    return status


if __name__ == "__main__":
    raise SystemExit(main())
