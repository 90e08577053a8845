"""pytest plugin for ``scripts/gpu_check.py``: ``-p cuda_gated --cuda-gated`` keeps only the CUDA-gated tests.

A test is CUDA-gated when a ``skip``/``skipif`` marker on it gives a reason
that names CUDA or a GPU (``@pytest.mark.skipif(not torch.cuda.is_available(),
reason="needs a CUDA device")``): exactly the tests that skip on a CPU-only
machine, wherever they are and however many get added, without a marker of
their own. Load it with ``PYTHONPATH=scripts``.
"""

from __future__ import annotations

import re
from typing import Any

import pytest

GATE = re.compile(r"\b(cuda|gpus?|nccl)\b", re.IGNORECASE)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cuda-gated", action="store_true", default=False, help="run only the CUDA-gated tests")


def is_cuda_gated(item: pytest.Item) -> bool:
    for name in ("skipif", "skip"):
        for mark in item.iter_markers(name):
            reason: Any = mark.kwargs.get("reason")
            if reason is None and name == "skip" and mark.args:
                reason = mark.args[0]
            if isinstance(reason, str) and GATE.search(reason):
                return True
    return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("cuda_gated"):
        return
    keep = [item for item in items if is_cuda_gated(item)]
    dropped = [item for item in items if not is_cuda_gated(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
