"""Run example suites and check each test ended the way the example says it should.

The failure reports are the point of the examples, so pytest's output is shown
as it is; this script then exits non-zero only if a test did not end as
expected:

- ``--expect by-name``: a test whose name ends in ``_buggy`` must fail with a
  torchperf report, one ending in ``_fixed`` must pass;
- ``--expect failed`` / ``--expect passed``: every test must end that way (the
  seed example fails under pytorch-lightning 1.5.0 and passes from 1.5.1 on).

A test the example itself skips (a GPU tip on a machine without one) is listed
as skipped, not counted as an unexpected outcome.

    python examples/run.py --expect by-name examples/dataloaders
    python examples/run.py --python ENV/bin/python --expect failed examples/seed_bug
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path


def expected_outcome(name: str, expect: str) -> str:
    if expect != "by-name":
        return expect
    base = name.split("[", 1)[0]
    if base.endswith("_buggy"):
        return "failed"
    if base.endswith("_fixed"):
        return "passed"
    return "passed"


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, failure message)}`` from a JUnit XML file."""
    result = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        failure = case.find("failure")
        error = case.find("error")
        if failure is not None:
            result[test_id] = ("failed", failure.get("message", ""))
        elif error is not None:
            result[test_id] = ("error", error.get("message", ""))
        elif case.find("skipped") is not None:
            result[test_id] = ("skipped", "")
        else:
            result[test_id] = ("passed", "")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="example directories or files")
    parser.add_argument("--python", default=sys.executable, help="interpreter of the environment to run in")
    parser.add_argument("--expect", choices=("by-name", "failed", "passed"), default="by-name")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="extra pytest arguments after --")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "junit.xml"
        command = [args.python, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", *args.paths]
        command += [a for a in args.pytest_args if a != "--"]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=False)
        if not junit.exists():
            print("examples: pytest wrote no JUnit report (it did not run)", file=sys.stderr)
            return 2
        seen = outcomes(junit)

    problems = []
    skipped = []
    for test_id, (outcome, message) in sorted(seen.items()):
        if outcome == "skipped":
            skipped.append(test_id)
            continue
        want = expected_outcome(test_id.rsplit("::", 1)[-1], args.expect)
        if outcome != want:
            problems.append(f"{test_id}: expected {want}, got {outcome}")
        elif outcome == "failed" and not message.startswith("torchperf:"):
            problems.append(f"{test_id}: failed, but not with a torchperf report: {message}")
    if len(skipped) == len(seen):
        problems.append("no test ran")
    print()
    if problems:
        print("examples: UNEXPECTED OUTCOMES")
        for line in problems:
            print("  " + line)
        return 1
    ran = len(seen) - len(skipped)
    note = f"; {len(skipped)} skipped by the example itself (see the reasons above)" if skipped else ""
    print(f"examples: all {ran} tests that ran ended as expected ({args.expect}){note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
