"""The examples are part of the suite: every ``*_buggy`` example fails with a report, every ``*_fixed`` passes.

``examples/run.py`` runs an example suite in a subprocess and checks each
test's outcome against its name; the seed bug's suite needs pytorch-lightning
1.5, so it is run by ``test_lightning_legacy.py``. The custom-invariant example
is installed (as a user would, from its own ``pyproject.toml``) into a
temporary directory first, so its entry point is what plugs it in.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def run_examples(
    paths: list[Path], *pytest_args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    command = [sys.executable, str(EXAMPLES / "run.py"), "--expect", "by-name", *map(str, paths)]
    command += ["--", "-p", "no:warnings"]
    return subprocess.run(
        command + list(pytest_args), capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )


#: The example suites of the current Lightning (the seed bug's needs 1.5, the custom invariant's an install).
SUITES = ["dataloaders", "step_checks", "seed_tips"]


@pytest.mark.slow
def test_every_example_suite_ends_as_its_test_names_say() -> None:
    # One pytest session for all of them (each session's process imports Lightning); run.py names each
    # test that ended otherwise, with its suite's path.
    done = run_examples([EXAMPLES / suite for suite in SUITES])
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "ended as expected (by-name)" in done.stdout  # every _buggy test failed with a torchperf report
    assert "torchperf: 1 invariant broken" in done.stdout  # shown
    for suite in SUITES:  # and each suite ran
        assert re.search(rf"^FAILED examples/{suite}/\S+::\S+_buggy", done.stdout, re.M), suite


@pytest.fixture(scope="module")
def acme(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The custom-invariant example installed into a directory of its own; the environment that sees it."""
    target = tmp_path_factory.mktemp("acme")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(EXAMPLES / "custom_invariant")],
        check=True, timeout=300,
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(target), env.get("PYTHONPATH", "")]))
    return env


@pytest.mark.slow
def test_a_third_party_invariant_works_like_a_built_in_one(acme: dict[str, str], tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    done = run_examples([EXAMPLES / "custom_invariant" / "tests"], f"--torchperf-json={report}", env=acme)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert "torchperf: no_host_to_device_in_forward" in done.stdout  # its own report section
    assert "hint: build it on the device" in done.stdout
    tests = {t["nodeid"].split("::")[-1]: t for t in json.loads(report.read_text())["tests"]}
    check = tests["test_position_ids_buggy"]["checks"]["no_host_to_device_in_forward"]
    assert check["status"] == "failed" and check["figures"]["copies_in_forward"] == 4


@pytest.mark.slow
def test_a_third_party_invariant_is_in_the_marker_signature_and_under_xdist(
    acme: dict[str, str], tmp_path: Path
) -> None:
    markers = subprocess.run([sys.executable, "-m", "pytest", "--markers"], capture_output=True, text=True,
                             cwd=tmp_path, env=acme, timeout=120)
    signature = next(line for line in markers.stdout.splitlines() if line.startswith("@pytest.mark.torchperf("))
    # after every built-in invariant, before the settings
    assert "no_host_to_device_in_forward=False, scope='training_step'" in signature
    assert signature.index("mixed_precision=False") < signature.index("no_host_to_device_in_forward")
    assert signature.split("): ")[0].endswith("max_forward_copies=None")
    report = tmp_path / "report.json"
    done = run_examples([EXAMPLES / "custom_invariant" / "tests"], "-n", "2", f"--torchperf-json={report}", env=acme)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = json.loads(report.read_text())["summary"]
    assert summary["checks_failed"] == {"no_host_to_device_in_forward": 1}
