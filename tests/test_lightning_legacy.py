"""The seed bug for real: pytorch-lightning 1.5.0 fails ``no_iterator_reset``, 1.5.1 passes.

Runs ``examples/seed_bug`` in the environments of the nox sessions ``pytorch-lightning-1.5.0`` and
``-1.5.1`` (in ``TORCHPERF_LEGACY_ENVS``, default ``.nox/``, where nox names them
``pytorch-lightning-1-5-0``...). Without them the tests skip, unless ``TORCHPERF_REQUIRE_LEGACY=1``
(set by ``nox -s tests``), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENVS = Path(os.environ.get("TORCHPERF_LEGACY_ENVS", ROOT / ".nox"))
EXAMPLE = ROOT / "examples" / "seed_bug" / "test_seed_bug.py"


def _python(version: str) -> Path:
    env = ENVS / f"pytorch-lightning-{version.replace('.', '-')}"
    python = env / "bin" / "python"
    # The session marks an environment built to the end; one without the mark is half-built.
    if not (python.exists() and (env / ".torchperf-complete").exists()):
        message = f"no complete pytorch-lightning {version} environment at {env}"
        message += f"; run `nox -s pytorch-lightning-{version}`"
        if os.environ.get("TORCHPERF_REQUIRE_LEGACY") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


def _run(version: str, *args: str) -> subprocess.CompletedProcess:
    python = _python(version)
    return subprocess.run(
        [str(python), "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings", str(EXAMPLE), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_pytorch_lightning_1_5_0_fails_with_the_stack_that_dropped_the_iterator() -> None:
    result = _run("1.5.0")
    out = result.stdout
    assert result.returncode == 1, out + result.stderr
    assert "torchperf: 1 invariant broken: no_iterator_reset (7 extra worker pools in 2 loaders)" in out
    # The train loader: one pool per epoch instead of one for the fit.
    assert (
        "DataLoader(dataset=SlowToOpenDataset, num_workers=2, persistent_workers=True) (built at "
        "examples/seed_bug/test_seed_bug.py:61, called from examples/seed_bug/test_seed_bug.py:81, the first built "
        "there) started 4 worker pools" in out
    )
    assert "worker pools started in: epoch 0 (train), epoch 1 (train), epoch 2 (train), epoch 3 (train)" in out
    # The frame the seed's author found by hand, with the stack that led there.
    assert (
        "iterator set to None (3x) at pytorch_lightning/trainer/supporters.py:498 "
        "in _shutdown_workers_and_reset_iterator [framework code]" in out
    )
    assert "dataloader._iterator = None" in out
    assert "pytorch_lightning/utilities/fetching.py:210 in reset" in out
    assert "> examples/seed_bug/test_seed_bug.py:" in out
    assert "trainer.fit(Regressor(), loader(shuffle=True), loader(shuffle=False))" in out
    # The validation loader too, its sanity-check pool included.
    assert "worker pools started in: sanity check, epoch 0 (validate), epoch 1 (validate)" in out
    assert "fixed in 1.5.1" in out
    # What each rebuilt pool cost: the seed's workers open their shards (0.2 s) again every epoch.
    lost = re.search(r"4 worker pools started; 3 rebuilt, ([\d.]+) (m?s) each \((\d+)% of the fit\)", out)
    assert lost, out
    each = float(lost.group(1)) * (1e-3 if lost.group(2) == "ms" else 1.0)
    assert 0.19 <= each < 20
    assert 1 <= int(lost.group(3)) <= 100
    assert "time from the start of each pass to its first batch: " in out


def test_pytorch_lightning_1_5_1_passes(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    result = _run("1.5.1", f"--torchperf-json={report}", "-v")  # -v: a clean test's verdicts
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "no_iterator_reset: passed (2 loaders with workers, 2 worker pools started)" in out
    # No pool rebuilt, no second lost: only each loader's first pass waits for its workers to open their shards.
    figures = json.loads(report.read_text())["tests"][0]["runs"][0]["checks"]["no_iterator_reset"]["figures"]
    assert figures["rebuilt_pools_lost_s"] == 0.0
    for loader in figures["loaders"]:
        first, *reused = loader["first_batch_s"]
        assert first >= 0.19 and reused and max(reused) < first
