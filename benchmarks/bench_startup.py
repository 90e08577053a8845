"""What the installed plugin costs a pytest session that watches nothing, interleaved A/B.

Budget (issue 25): a one-test session with the plugin installed takes at most
20 ms longer than the same session with ``-p no:torchperf``.

Variants, each one ``python -m pytest -q -p no:cacheprovider`` run in a fresh
process on a file holding one plain (unmarked) test:

- ``A``  the plugin disabled (``-p no:torchperf``);
- ``B``  the plugin loaded, as every pytest start of an environment where it
  is installed loads it;
- ``M``  (``--markers``) ``pytest --markers`` with the plugin: the text that
  lists every invariant's signature, built only when it is asked for.

Each round runs every variant once, in an order that rotates every round; the
first round is a warm-up and is dropped. Reported: the median wall time of
each variant, the spread (25th-75th percentile), and the median of the
per-round differences B-A (in ms). Others sharing the machine's cores widen
the spread; compare medians of runs made side by side.

    python benchmarks/bench_startup.py [--rounds 15] [--markers] [--smoke]

Exit status 1 when the median B-A is over the budget (not in ``--smoke``).
"""

from __future__ import annotations

import argparse
import os
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


def timed(args: list[str], cwd: str) -> float:
    """Wall seconds of one pytest process (it must pass)."""
    env = dict(os.environ)
    env.pop("PYTEST_ADDOPTS", None)
    env["PYTHONDONTWRITEBYTECODE"] = "0"
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
    if done.returncode != 0:
        raise SystemExit(f"bench_startup: pytest {' '.join(args)} failed:\n{done.stdout}")
    return elapsed


def measure(rounds: int, markers: bool) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory(prefix="torchperf-startup-") as cwd:
        with open(os.path.join(cwd, "test_one.py"), "w") as f:
            f.write(_TEST)
        with open(os.path.join(cwd, "pytest.ini"), "w") as f:
            f.write("[pytest]\n")  # the rootdir: no pyproject of an enclosing repository
        variants: dict[str, list[str]] = {"A": ["-p", "no:torchperf", "test_one.py"], "B": ["test_one.py"]}
        if markers:
            variants["M"] = ["--markers"]
        times: dict[str, list[float]] = {name: [] for name in variants}
        names = list(variants)
        for r in range(rounds + 1):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                elapsed = timed(variants[name], cwd)
                if r > 0:  # the first round warms the file caches
                    times[name].append(elapsed)
        return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after one warm-up round)")
    parser.add_argument("--markers", action="store_true", help="also time `pytest --markers`")
    parser.add_argument("--smoke", action="store_true", help="two rounds, no budget verdict (for CI)")
    args = parser.parse_args()
    rounds = 2 if args.smoke else args.rounds
    times = measure(rounds, args.markers)
    print(f"{sys.executable} -m pytest, one unmarked test, {rounds} rounds (+1 warm-up), interleaved")
    for name, values in times.items():
        lo, mid, hi = quartiles(values)
        print(f"  {name}: median {mid * 1e3:7.1f} ms  [IQR {lo * 1e3:.1f}-{hi * 1e3:.1f}]")
    diffs = [(b - a) * 1e3 for b, a in zip(times["B"], times["A"])]
    lo, mid, hi = quartiles(diffs)
    ok = mid <= BUDGET_MS
    verdict = "" if args.smoke else ("  ok" if ok else "  OVER")
    print(f"  B-A: median {mid:+.1f} ms [IQR {lo:+.1f} to {hi:+.1f}]  budget <= {BUDGET_MS:.0f} ms{verdict}")
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    raise SystemExit(main())
