"""Helpers shared by the step-check tests (``no_host_sync`` and ``on_device``)."""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pytest_torchperf import InvariantViolation
from pytest_torchperf.report import Report

#: The default invariants off (a test that checks only what it names).
OFF = {"no_host_sync": False, "on_device": False, "no_iterator_reset": False, "no_data_parallel": False}


def write_module(tmp_path: Path, name: str, source: str) -> tuple[ModuleType, int]:
    """Import ``source`` from ``tmp_path/name.py``; returns the module and the line marked ``# HERE``."""
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "# HERE" in text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module, line


def batches(n: int = 3) -> list[tuple[Any, Any]]:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4 * n, 8), torch.randn(4 * n, 1))
    return list(DataLoader(data, batch_size=4))


def report_of(fn: Any, *args: Any, **kwargs: Any) -> Report:
    """Run ``fn`` (which watches) and return the report, failed or not."""
    try:
        run = fn(*args, **kwargs)
    except InvariantViolation as exc:
        return exc.report
    return run.report


def needs_transformers() -> None:
    """Skip without transformers; with ``TORCHPERF_REQUIRE_TRANSFORMERS=1`` (the side environment the test
    command runs those tests in, the nox session ``compat-transformers``) fail instead. It is not in the test
    extras: with it installed, every ``import pytorch_lightning`` imports it too (torchmetrics' BERTScore),
    1.5 s a process."""
    if importlib.util.find_spec("transformers") is None:
        message = "transformers is not installed (pip install -e '.[test-transformers]')"
        if os.environ.get("TORCHPERF_REQUIRE_TRANSFORMERS") == "1":
            pytest.fail(message)
        pytest.skip(message)
