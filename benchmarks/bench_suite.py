"""What the plugin costs a whole suite: every test marked against the same suite unmarked, interleaved.

A synthetic suite like a foreign project's is written to a temporary directory
(``--tests`` tests, 60 by default): about 40% configuration tests that never
train, ``unittest.TestCase`` classes (one test each that unittest skips, every
other class with a failing test), a test pytest skips, tiny real training loops
(a ``Linear`` and SGD, a few steps) and two tests with a real finding (a
``.item()`` every step). Two variants, each a fresh ``python -m pytest`` process:

- ``U`` unmarked: the plugin installed, nothing watched;
- ``M`` marked: a ``conftest.py`` marks every test ``@pytest.mark.torchperf`` with
  the defaults (``--torchperf-report-only`` in both, so the findings do not change
  the outcome; the unittest failures fail both alike).

Rounds run ``U M`` then ``M U`` (A B B A ...), after a warm-up round that is
dropped. Reported: each variant's median wall and CPU time (user + system of the
pytest process and its children, from ``os.wait4``) with the 25th-75th
percentile spread, and the median and spread of the per-round ratios M/U.

    python benchmarks/bench_suite.py [--tests 60] [--rounds 6] [--smoke]
    python benchmarks/bench_suite.py --write DIR [--tests 60]   # only write the suite (to look at its output)
    python benchmarks/bench_suite.py --against OTHER_CHECKOUT [--rounds 6]

``--against``: the same rounds for another checkout of pytest-torchperf (its
root put first on ``PYTHONPATH``; this script's checkout likewise for its own
runs), its ``U`` and ``M`` runs interleaved with this checkout's in every round
(the order of the four reversed every other round); reported for each checkout,
then the per-round ratio of this checkout's marked CPU time to the other's.

``--smoke`` (CI): 12 tests, one round, no warm-up: checks that both variants run
and give the same outcomes (the figures mean nothing).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

_HEAD = '''\
import unittest

import pytest
import torch


def train(steps=4, sync=False):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sync:
            print(loss.item())  # a finding: a host sync every step
'''

_CONFTEST = '''\
import os

import pytest


def pytest_collection_modifyitems(items):
    if os.environ.get("BENCH_SUITE_MARKED") == "1":
        for item in items:
            item.add_marker(pytest.mark.torchperf)
'''


def suite_source(tests: int) -> str:
    """The test module: ``tests`` tests in all (at least 12)."""
    tests = max(tests, 12)
    idle = tests * 2 // 5
    classes = max(2, tests // 6)
    findings = 2
    trainers = max(1, tests - idle - 2 * classes - findings - 1)
    parts = [_HEAD]
    parts.append(textwrap.dedent(f'''
        @pytest.mark.parametrize("size", range({idle}))
        def test_config_round_trips(size):
            config = {{"hidden": size, "layers": [size] * 3}}
            assert config["layers"][-1] == size


        @pytest.mark.parametrize("seed", range({trainers}))
        def test_trains(seed):
            torch.manual_seed(seed)
            train()


        @pytest.mark.parametrize("steps", [3, 5])
        def test_logs_the_loss(steps):
            train(steps, sync=True)


        @pytest.mark.skip(reason="needs a GPU")
        def test_on_gpu():
            train()
    '''))
    for i in range(classes):
        first = "self.assertEqual(len('ab'), 3)" if i % 2 else "self.assertEqual('ab'.upper(), 'AB')"
        parts.append(textwrap.dedent(f'''
            class TestTokenizer{i}(unittest.TestCase):
                def test_encodes(self):
                    {first}

                def test_downloads(self):
                    self.skipTest("no network")
        '''))
    return "".join(parts)


#: What the header says of the bytecode caches: pytest rewrites the asserts of a plugin's modules (the whole
#: package of an entry-point plugin) and caches the result beside the bytecode. Where it cannot write it
#: (``PYTHONDONTWRITEBYTECODE``, a read-only install), every run parses and compiles again each module of the
#: plugin it imports, and the marked runs import about a hundred more than the unmarked ones.
CACHES_WRITTEN = "written (the warm-up round writes them; the timed rounds read them)"
CACHES_NOT_WRITTEN = (
    "not written (PYTHONDONTWRITEBYTECODE is set: each run compiles the plugin's modules it imports again, "
    "with pytest's assertion rewriting; unset it to time what a run with warm caches pays)"
)


def write_suite(directory: str, tests: int) -> None:
    with open(os.path.join(directory, "test_suite.py"), "w") as f:
        f.write(suite_source(tests))
    with open(os.path.join(directory, "conftest.py"), "w") as f:
        f.write(_CONFTEST)
    with open(os.path.join(directory, "pytest.ini"), "w") as f:
        f.write("[pytest]\n")  # the rootdir: no pyproject of an enclosing repository


def quartiles(values: list[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile) of ``values``."""
    if len(values) < 2:
        return (values[0], values[0], values[0])
    q = statistics.quantiles(values, n=4, method="inclusive")
    return (q[0], statistics.median(values), q[2])


_OUTCOMES = re.compile(r"(\d+) (passed|failed|skipped)")


def timed(directory: str, marked: bool, root: str | None = None) -> tuple[float, float, dict[str, int]]:
    """Wall seconds, CPU seconds (user + system of pytest and its children) and the outcome counts (``root``: the
    checkout of pytest-torchperf to import, first on ``PYTHONPATH``; None: whichever is importable)."""
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.path.abspath(root) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("PYTEST_ADDOPTS", None)
    env["BENCH_SUITE_MARKED"] = "1" if marked else "0"
    env.setdefault("OMP_NUM_THREADS", "1")  # one torch thread: the figure is the plugin's, not the pool's
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--torchperf-report-only", "-W", "ignore"]
    start = time.perf_counter()
    process = subprocess.Popen(
        args, cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert process.stdout is not None
    output = process.stdout.read()
    _, status, usage = os.wait4(process.pid, 0)
    elapsed = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode not in (0, 1):  # 1: the suite's own unittest failures
        raise SystemExit(f"bench_suite: pytest ({'marked' if marked else 'unmarked'}) failed:\n{output}")
    last = output.strip().splitlines()[-1]
    outcomes = {word: int(n) for n, word in _OUTCOMES.findall(last)}
    return elapsed, usage.ru_utime + usage.ru_stime, outcomes


def measure(
    directory: str, rounds: int, warmup: bool, roots: dict[str, str | None] | None = None
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Wall and CPU seconds per round of ``U`` (unmarked) and ``M`` (marked), in A B B A order; with ``roots``
    (a suffix -> a checkout), of ``U<suffix>`` and ``M<suffix>`` for each checkout."""
    roots = roots or {"": None}
    names = [f"{variant}{suffix}" for suffix in roots for variant in ("U", "M")]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    seen: dict[str, dict[str, int]] = {}
    for r in range(rounds + int(warmup)):
        order = names if r % 2 == 0 else names[::-1]
        for name in order:
            elapsed, used, outcomes = timed(directory, marked=name[0] == "M", root=roots[name[1:]])
            if seen.setdefault(name, outcomes) != outcomes:
                raise SystemExit(f"bench_suite: {name} gave {outcomes}, then {seen[name]}")
            if r >= int(warmup):
                wall[name].append(elapsed)
                cpu[name].append(used)
    for name in names:
        if seen[name] != seen["U"]:
            raise SystemExit(f"bench_suite: {name} changed the outcomes: {seen['U']} unmarked, {seen[name]} in {name}")
    print(f"  outcomes (every variant): {', '.join(f'{n} {w}' for w, n in seen['U'].items())}")
    return wall, cpu


def report(wall: dict[str, list[float]], cpu: dict[str, list[float]], suffix: str = "") -> None:
    """Each variant's median and spread, and the per-round ratios marked / unmarked."""
    for label, times in (("wall", wall), ("CPU", cpu)):
        for name, title in (("U", "unmarked"), ("M", "marked  ")):
            lo, mid, hi = quartiles(times[name + suffix])
            print(f"  {title} {label:4}: median {mid:6.2f} s [IQR {lo:.2f}-{hi:.2f}]")
        ratios = [m / u for m, u in zip(times["M" + suffix], times["U" + suffix])]
        lo, mid, hi = quartiles(ratios)
        print(f"  M/U {label:4}: median x{mid:.3f} [IQR x{lo:.3f}-x{hi:.3f}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tests", type=int, default=60, help="tests in the synthetic suite (at least 12)")
    parser.add_argument("--rounds", type=int, default=6, help="timed rounds (after one warm-up round)")
    parser.add_argument("--smoke", action="store_true", help="12 tests, one round, no warm-up (for CI)")
    parser.add_argument("--write", metavar="DIR", default="", help="only write the suite into DIR")
    parser.add_argument("--against", metavar="CHECKOUT", default="",
                        help="also run another checkout of pytest-torchperf, interleaved in every round")
    args = parser.parse_args()
    if args.write:
        os.makedirs(args.write, exist_ok=True)
        write_suite(args.write, args.tests)
        print(f"bench_suite: wrote {args.tests} tests to {args.write}")
        return 0
    tests, rounds = (12, 1) if args.smoke else (args.tests, args.rounds)
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots: dict[str, str | None] = {"": here, "'": args.against} if args.against else {"": None}
    with tempfile.TemporaryDirectory(prefix="torchperf-suite-") as directory:
        write_suite(directory, tests)
        print(f"{sys.executable} -m pytest, a synthetic suite of {tests} tests, {rounds} rounds"
              f"{'' if args.smoke else ' (+1 warm-up)'}, {' '.join(f'U{s} M{s}' for s in roots)} interleaved"
              " (the order reversed every other round)")
        caches = CACHES_NOT_WRITTEN if os.environ.get("PYTHONDONTWRITEBYTECODE") else CACHES_WRITTEN
        print(f"  bytecode caches: {caches}")
        wall, cpu = measure(directory, rounds, warmup=not args.smoke, roots=roots)
    if not args.against:
        report(wall, cpu)
        return 0
    for suffix, root in roots.items():
        print(f"this checkout, {root}:" if not suffix else f"the other checkout (') {root}:")
        report(wall, cpu, suffix)
    ratios = [m / other for m, other in zip(cpu["M"], cpu["M'"])]
    lo, mid, hi = quartiles(ratios)
    print(f"  M/M' CPU (this checkout's marked suite against the other's): median x{mid:.3f} [IQR x{lo:.3f}-x{hi:.3f}]")
    extra = [(m - u) / ((m2 - u2) or float("nan")) for m, u, m2, u2 in zip(cpu["M"], cpu["U"], cpu["M'"], cpu["U'"])]
    lo, mid, hi = quartiles(extra)
    print(f"  (M-U)/(M'-U') CPU (the extra of marking, this checkout's over the other's): median x{mid:.3f} "
          f"[IQR x{lo:.3f}-x{hi:.3f}]")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
