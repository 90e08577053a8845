"""Smoke test of an installed pytest-torchperf (run by the nox sessions `package`, outside the repository).

Checks the installed distribution (version in one place, license, type marker, the pytest entry
point) and runs a small suite through pytest: a buggy test fails with the torchperf report, its
fixed twin passes, and the JSON report says the same.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap
from importlib import metadata

SUITE = textwrap.dedent(
    """
    import pytest
    import torch

    def train(run, read_loss):
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            with run.step():
                loss = model(torch.randn(8, 4)).pow(2).mean()
                if read_loss:
                    print(loss.item())
                loss.backward()
                opt.step()
                opt.zero_grad()

    def test_buggy(torchperf):
        with torchperf.watch() as run:
            train(run, read_loss=True)

    def test_fixed(torchperf):
        with torchperf.watch() as run:
            train(run, read_loss=False)
    """
)


def main() -> int:
    kind = sys.argv[1] if len(sys.argv) > 1 else "installed"
    import pytest_torchperf

    dist = metadata.distribution("pytest-torchperf")
    here = os.path.dirname(pytest_torchperf.__file__)
    assert "site-packages" in here, f"pytest_torchperf imported from {here}, not from the installed package"
    assert pytest_torchperf.__version__ == dist.version, (pytest_torchperf.__version__, dist.version)
    assert any(str(f).endswith("LICENSE") for f in dist.files or []), "no LICENSE in the distribution"
    assert os.path.exists(os.path.join(here, "py.typed")), "no py.typed"
    entry = [e for e in dist.entry_points if e.group == "pytest11"]
    assert [e.value for e in entry] == ["pytest_torchperf.glue.plugin"], entry
    with tempfile.TemporaryDirectory() as tmp:
        with open(os.path.join(tmp, "test_smoke.py"), "w") as fh:
            fh.write(SUITE)
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--torchperf-json=report.json"],
            cwd=tmp, capture_output=True, text=True,
        )
        assert out.returncode == 1, out.stdout + out.stderr
        assert "torchperf: 1 invariant broken: no_host_sync" in out.stdout, out.stdout
        with open(os.path.join(tmp, "report.json")) as fh:
            doc = json.load(fh)
    outcomes = {t["nodeid"]: t["outcome"] for t in doc["tests"]}
    assert outcomes == {"test_smoke.py::test_buggy": "failed", "test_smoke.py::test_fixed": "passed"}, outcomes
    assert doc["environment"]["pytest_torchperf"] == dist.version
    print(
        f"smoke test ({kind}): pytest-torchperf {dist.version} works: the buggy test failed with its report, the fixed "
        "one did not"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
