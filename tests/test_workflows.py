"""The GitHub Actions workflows: this project's CI and release, and the one the CI guide gives users.

Each is checked against GitHub's workflow schema (``check-jsonschema --builtin-schema
vendor.github-workflows``, which ships the schema: no download) and by ``zizmor --offline`` (workflow
security: credentials persisted by checkout, template injection, unpinned actions, excessive
permissions...). Both tools are pinned in the test extras.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = sorted((ROOT / ".github" / "workflows").glob("*.yml"))
CI_GUIDE = ROOT / "docs" / "guides" / "ci.md"


def _tool(name: str) -> str:
    """The tool installed beside this interpreter (the test extras), else on PATH; skip where neither is."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed (it is in the test extras: pip install -e '.[test]')")
    return found


def _check(*paths: Path) -> None:
    schema = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", *map(str, paths)],
        capture_output=True, text=True, timeout=120,
    )
    assert schema.returncode == 0, schema.stdout + schema.stderr
    audit = subprocess.run(
        [_tool("zizmor"), "--offline", "--no-progress", *map(str, paths)], capture_output=True, text=True, timeout=120
    )
    assert audit.returncode == 0, audit.stdout + audit.stderr
    assert "No findings" in audit.stdout + audit.stderr


def _guide_workflow() -> str:
    """The complete workflow in the CI guide (the YAML block that starts with ``name:``)."""
    blocks = re.findall(r"^```yaml\n(.*?)^```$", CI_GUIDE.read_text(encoding="utf-8"), flags=re.M | re.S)
    workflows = [block for block in blocks if block.startswith("name:")]
    assert len(workflows) == 1, f"expected one complete workflow in {CI_GUIDE.name}, found {len(workflows)}"
    return workflows[0]


def test_the_project_has_a_ci_and_a_release_workflow() -> None:
    assert [path.name for path in WORKFLOWS] == ["ci.yml", "release.yml"]
    release = (ROOT / ".github" / "workflows" / "release.yml").read_text(encoding="utf-8")
    # Trusted publishing: the token permission on the publishing job only, and no stored password.
    assert release.count("id-token: write") == 1 and "password:" not in release
    assert "pypa/gh-action-pypi-publish@" in release and "nox -s build package" in release


def test_the_project_workflows_are_valid_and_zizmor_finds_nothing() -> None:
    _check(*WORKFLOWS)


def test_every_session_the_workflows_run_is_declared_in_the_noxfile() -> None:
    noxfile = (ROOT / "noxfile.py").read_text(encoding="utf-8")
    declared = set(re.findall(r'name="([\w.-]+)"', noxfile)) | set(re.findall(r"^def (\w+)\(session", noxfile, re.M))
    declared |= {f"compat-torch-free-{v}" for v in ("3.9", "3.10", "3.12", "3.13")}  # parametrized by Python
    used = set()
    for path in WORKFLOWS:
        text = path.read_text(encoding="utf-8")
        used |= set(re.findall(r"\{session: ([\w.-]+)", text))
        used |= {s.strip() for line in re.findall(r"session: \[(.*?)\]", text) for s in line.split(",")}
        used |= {s for line in re.findall(r"nox -s ([\w. -]+)", text) for s in line.split()}
    used.discard('"$SESSION"')
    assert used and used <= declared, sorted(used - declared)


def test_the_ci_guide_s_workflow_is_valid_and_zizmor_finds_nothing(tmp_path: Path) -> None:
    workflow = tmp_path / ".github" / "workflows" / "tests.yml"
    workflow.parent.mkdir(parents=True)
    workflow.write_text(_guide_workflow(), encoding="utf-8")
    _check(workflow)
    assert "download.pytorch.org/whl/cpu" in workflow.read_text(encoding="utf-8")  # no CUDA build on a CPU runner
