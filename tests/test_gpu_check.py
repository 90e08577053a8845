"""``scripts/gpu_check.py``: it refuses clearly without a GPU, selects exactly the CUDA-gated tests, and its
CPU dry run writes the summary (the cross-check's CPU column filled, the CUDA columns "no CUDA")."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_check  # noqa: E402
import gpu_corpus  # noqa: E402


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.skipif(
    shutil.which("nvidia-smi") is not None, reason="nvidia-smi is present here: the refusal is for machines without it"
)
def test_without_a_gpu_it_says_so_and_exits_2_before_anything_else(tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--out", str(out)], capture_output=True,
                          text=True, timeout=60, env=_env())
    assert done.returncode == 2
    assert "gpu-check: no CUDA GPU on this machine" in done.stderr and "--cpu-dry-run" in done.stderr
    assert not out.exists()  # nothing was set up or written


def test_an_unknown_part_is_refused_with_the_parts_there_are(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_check.py"), "--out", str(tmp_path), "--parts", "corpus,tset"],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert done.returncode == 2
    assert "--parts: unknown tset; choose from info, corpus, invariants, tests, examples, crosschecks" in done.stderr


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
    monkeypatch.syspath_prepend(str(SCRIPTS))
    result = pytester.runpytest("-p", "cuda_gated", "--cuda-gated", "--collect-only", "-q")
    result.stdout.fnmatch_lines(
        ["test_mixed.py::test_on_cuda", "test_mixed.py::test_gpu_tip", "*2/4 tests collected (2 deselected)*"]
    )
    result.stdout.no_fnmatch_line("*test_cpu_only*")
    assert "test_plain" not in result.stdout.str()


def test_every_pattern_of_the_corpus_marks_one_line_of_its_own() -> None:
    lines = {p.name: p.line for p in gpu_corpus.PATTERNS}
    assert lines.pop("clean") == 0
    assert all(line > 0 for line in lines.values())
    assert len(set(lines.values())) == len(lines)
    source = (SCRIPTS / "gpu_corpus.py").read_text().splitlines()
    assert source[lines["item"] - 1].strip() == "return loss.item()  # <- the pattern"


def test_the_metadata_stub_declares_the_plugin_from_the_working_tree(tmp_path: Path) -> None:
    stub = gpu_check.make_stub(tmp_path)
    probe = ("import importlib.metadata as md; d = md.distribution('pytest-torchperf'); "
             "print(d._path); print([e.value for e in d.entry_points if e.group == 'pytest11'])")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(stub)])}
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, env=env,
                          cwd=tmp_path)
    path, points = done.stdout.splitlines()
    # Found before any installed copy: the stub, or the tree's own metadata where an editable install left it.
    assert Path(path).parent in (stub, ROOT)
    assert points == "['pytest_torchperf.glue.plugin']"


def _record(where: str, label: str = "`.item()`", status: str = "failed", confirmed: bool = False) -> dict:
    site = {
        "where": where,
        "label": label,
        "count": 6,
        "finding": "",
        "confirmed": ["confirmed 6x"] if confirmed else [],
    }
    return {"checks": {"no_host_sync": {"status": status, "summary": "", "sites": [site]},
                       "pin_memory": {"status": "not checked", "summary": "", "sites": []}}}


def test_a_sync_only_cuda_sees_is_a_defect_unless_the_pattern_names_the_gap() -> None:
    item, pinned = gpu_corpus.BY_NAME["item"], gpu_corpus.BY_NAME["loader_pinned"]
    assert gpu_check.agreement(True, True, item) == ("yes", "")
    assert gpu_check.agreement(False, True, item)[1].startswith("DEFECT")
    assert gpu_check.agreement(False, True, pinned) == ("no: CUDA only", gpu_corpus.PINNED_BLOCKING)
    assert gpu_check.agreement(True, False, item)[0] == "no: plugin only"
    assert gpu_check.agreement(None, True, item) == ("—", "")


def test_the_cells_say_what_each_side_blamed_at_the_patterns_line_and_elsewhere() -> None:
    text, flagged = gpu_check.plugin_cell(_record("gpu_corpus.py:67", confirmed=True), "gpu_corpus.py:67")
    assert flagged and text == "no_host_sync failed: `.item()` ×6 (CUDA-confirmed)"
    text, flagged = gpu_check.plugin_cell(_record("gpu_corpus.py:12"), "gpu_corpus.py:67")
    assert not flagged and text == "no_host_sync failed elsewhere; also no_host_sync `.item()` @ gpu_corpus.py:12"
    warned = {"warnings": [{"where": "gpu_corpus.py:67", "count": 6}, {"where": "torch/optim/sgd.py:3", "count": 1}]}
    assert gpu_check.cuda_cell(warned, "gpu_corpus.py:67") == ("warns ×6 (also torch/optim/sgd.py:3 ×1)", True)
    assert gpu_check.cuda_cell({"warnings": []}, "gpu_corpus.py:67") == ("silent", False)


@pytest.mark.slow
def test_the_cpu_dry_run_writes_the_summary_with_the_cuda_columns_saying_no_cuda(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "gpu_check.py"), "--out", str(tmp_path), "--cpu-dry-run", "--budget", "150",
         "--parts", "info,corpus,invariants", "--patterns", "clean,item,host_built_to,loader_pageable",
         "--invariants", "no_empty_cache,mixed_precision"],
        capture_output=True, text=True, timeout=200, env=_env(),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = (tmp_path / "summary.md").read_text()
    item, built = gpu_corpus.BY_NAME["item"].line, gpu_corpus.BY_NAME["host_built_to"].line
    assert (
        f"| `item` (no_host_sync) | :{item} | no_host_sync failed: `.item()` ×6 | no CUDA | no CUDA | — / — |"
        in summary
    )
    assert (
        f"| `host_built_to` (on_device) | :{built} | on_device failed: torch.randn then .to(...) ×6 | no CUDA |"
        in summary
    )
    assert "| `clean` (clean) | :0 | passed | no CUDA | no CUDA | — / — |" in summary
    assert "| `float_of`" not in summary  # only the patterns asked for
    assert "| no_empty_cache | buggy | cpu | failed | failed | yes |" in summary
    assert "| mixed_precision | fixed | cpu | not checked | not checked | yes |" in summary
    assert "| GPU | no CUDA |" in summary
    assert {p.name for p in tmp_path.iterdir()} == {"summary.md", "results.json", "log.txt"}
