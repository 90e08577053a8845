"""What the installed plugin costs a pytest session that watches nothing, interleaved A/B.

Budget (issue 25): a one-test session with the plugin installed takes at most
20 ms longer than the same session with ``-p no:torchperf``.

Variants, each one ``python -m pytest -q -p no:cacheprovider`` run in a fresh
process on a file holding one plain (unmarked) test:

- ``A``  the plugin disabled (``-p no:torchperf``);
- ``B``  the plugin loaded, as every pytest start of an environment where it
  is installed loads it;
- ``M``  (``--markers``) ``pytest --markers`` with the plugin: the text that
  lists every invariant's signature, built only when it is asked for;
- ``P``  (``--before DIR``) the plugin from another copy of the package (an
  earlier revision), for a before/after figure measured side by side.

Each round runs every variant once, in an order that rotates every round; the
first round is a warm-up and is dropped. Reported: the median wall time of
each variant, the spread (25th-75th percentile), and the median of the
per-round differences B-A (in ms), in wall time and in CPU time (user +
system of the child process, which other processes on the cores disturb less). Others sharing the machine's cores widen
the spread; compare medians of runs made side by side.

    python benchmarks/bench_startup.py [--rounds 15] [--markers] [--smoke]

Exit status 1 when the median B-A is over the budget (not in ``--smoke``).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

BUDGET_MS = 20.0

_TEST = "def test_plain():\n    assert 1 + 1 == 2\n"


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of ``values``."""
    if len(values) < 2:
        return (values[0], values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], statistics.median(values), q[2])


def timed(args: list[str], cwd: str, path: str = "") -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one pytest process (it must pass).

    ``path``: a directory holding another copy of the package, put first on ``PYTHONPATH``.
    """
    env = dict(os.environ)
    if path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (path, env.get("PYTHONPATH", "")) if p)
    env.pop("PYTEST_ADDOPTS", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # users run from cached bytecode
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    elapsed = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: pytest {' '.join(args)} failed:\n{done.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return elapsed, cpu


def measure(rounds: int, markers: bool, before: str = "") -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds of each variant, per round (the warm-up round dropped)."""
    with tempfile.TemporaryDirectory(prefix="torchperf-startup-") as cwd:
        with open(os.path.join(cwd, "test_one.py"), "w") as f:
            f.write(_TEST)
        with open(os.path.join(cwd, "pytest.ini"), "w") as f:
            f.write("[pytest]\n")  # the rootdir: no pyproject of an enclosing repository
        variants: dict[str, list[str]] = {"A": ["-p", "no:torchperf", "test_one.py"], "B": ["test_one.py"]}
        if markers:
            variants["M"] = ["--markers"]
        if before:
            variants["P"] = ["test_one.py"]
        wall: dict[str, list[float]] = {name: [] for name in variants}
        cpu: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                elapsed, used = timed(variants[name], cwd, before if name == "P" else "")
                if r > 0:  # the first round warms the file caches and writes the bytecode caches
                    wall[name].append(elapsed)
                    cpu[name].append(used)
        return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after one warm-up round)")
    parser.add_argument("--markers", action="store_true", help="also time `pytest --markers`")
    parser.add_argument("--before", default="", metavar="DIR",
                        help="also time variant P: the plugin from another copy of the package in DIR "
                             "(e.g. `git archive REV pytest_torchperf | tar -x -C DIR`), interleaved")
    parser.add_argument("--smoke", action="store_true", help="two rounds, no budget verdict (for CI)")
    args = parser.parse_args()
    rounds = 2 if args.smoke else args.rounds
    wall, cpu = measure(rounds, args.markers, args.before)
    print(f"{sys.executable} -m pytest, one unmarked test, {rounds} rounds (+1 warm-up), interleaved")
    print("  wall time, then CPU time (user + system: less disturbed by other processes on the cores)")
    for name in wall:
        lo, mid, hi = quartiles(wall[name])
        clo, cmid, chi = quartiles(cpu[name])
        print(f"  {name}: median {mid * 1e3:7.1f} ms [IQR {lo * 1e3:.1f}-{hi * 1e3:.1f}]   "
              f"CPU {cmid * 1e3:7.1f} ms [IQR {clo * 1e3:.1f}-{chi * 1e3:.1f}]")
    ok = True
    for label, times in (("wall", wall), ("CPU", cpu)):
        for variant in [v for v in times if v != "A"]:
            diffs = [(b - a) * 1e3 for b, a in zip(times[variant], times["A"])]
            lo, mid, hi = quartiles(diffs)
            if label == "wall" and variant == "B":
                ok = mid <= BUDGET_MS
            print(f"  {variant}-A {label}: median {mid:+.1f} ms [IQR {lo:+.1f} to {hi:+.1f}]")
    verdict = "" if args.smoke else ("ok" if ok else "OVER")
    print(f"  budget: B-A wall <= {BUDGET_MS:.0f} ms {verdict}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
