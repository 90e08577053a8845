"""``scripts/gpu-check.sh``: it refuses clearly without a GPU, and selects exactly the CUDA-gated tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(subprocess.run("command -v nvidia-smi", shell=True).returncode == 0, reason="nvidia-smi is present here: the refusal is for machines without it")
def test_without_a_gpu_it_says_so_and_exits_2() -> None:
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "gpu-check: no CUDA GPU on this machine" in done.stderr
    assert not (ROOT / ".venv-gpu").exists() or os.environ.get("TORCHPERF_GPU_VENV")  # nothing was set up


def test_the_selection_keeps_the_tests_that_skip_for_want_of_cuda(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_mixed="""
        import pytest
        import torch

        cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

        @cuda
        def test_on_cuda():
            pass

        @pytest.mark.skipif(True, reason="a GPU tip: needs one")
        def test_gpu_tip():
            pass

        @pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only verdict")
        def test_cpu_only():
            pass

        def test_plain():
            pass
        """
    )
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    result = pytester.runpytest("-p", "cuda_gated", "--cuda-gated", "--collect-only", "-q")
    result.stdout.fnmatch_lines(["test_mixed.py::test_on_cuda", "test_mixed.py::test_gpu_tip", "*2/4 tests collected (2 deselected)*"])
    result.stdout.no_fnmatch_line("*test_cpu_only*")
    assert "test_plain" not in result.stdout.str()
