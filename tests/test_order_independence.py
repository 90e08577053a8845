"""A watched test's verdicts do not depend on which tests ran before it (alone, forward, reversed, ``-n 2``).

Dynamo keeps what it compiled on the code objects of the user's functions: a
second test that compiles a fresh instance of the same module class reuses the
first one's compiled code and never compiles. Its verdicts must still be the
ones it gets alone.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

#: Compile cases (a break compiled before the first automatic step; two tests compiling the same class; a
#: clean compiled step), a sync per step and a clean loop.
SUITE = """
import pytest
import torch


class Printing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x):
        out = self.linear(x)
        print("forward")
        return out


class Clean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x):
        return torch.relu(self.linear(x))


def fit(model, steps=4):
    compiled = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(compiled(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.torchperf
def test_compile_then_loop():
    fit(Printing())


@pytest.mark.torchperf
def test_compile_then_loop_again():
    fit(Printing())


@pytest.mark.torchperf(no_recompiles=True)
def test_compiled_clean():
    fit(Clean())


@pytest.mark.torchperf
def test_sync_each_step():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    for _ in range(4):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(loss.item())


@pytest.mark.torchperf
def test_clean_loop():
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    for _ in range(4):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
"""

CONFTEST = """
import os


def pytest_collection_modifyitems(config, items):
    if os.environ.get("REVERSE_ORDER"):
        items.reverse()
"""

TESTS = ("test_compile_then_loop", "test_compile_then_loop_again", "test_compiled_clean", "test_sync_each_step",
         "test_clean_loop")


def _verdicts(path: Any) -> dict[str, dict[str, str]]:
    doc = json.loads(path.read_text())
    return {
        t["nodeid"].rpartition("::")[2]: {name: check["status"] for name, check in t["checks"].items()}
        for t in doc["tests"]
    }


@pytest.mark.slow
def test_every_watched_tests_verdicts_are_the_same_alone_forward_reversed_and_under_xdist(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    pytester.makeconftest(CONFTEST)
    alone: dict[str, dict[str, str]] = {}
    for name in TESTS:
        pytester.runpytest_subprocess("-p", "no:randomly", f"test_suite.py::{name}", f"--torchperf-json={name}.json")
        alone.update(_verdicts(pytester.path / f"{name}.json"))
    pytester.runpytest_subprocess("-p", "no:randomly", "--torchperf-json=forward.json")
    monkeypatch.setenv("REVERSE_ORDER", "1")
    pytester.runpytest_subprocess("-p", "no:randomly", "--torchperf-json=reversed.json")
    monkeypatch.delenv("REVERSE_ORDER")
    pytester.runpytest_subprocess("-p", "no:randomly", "-n", "2", "--torchperf-json=xdist.json")
    table = {
        "alone": alone,
        "forward": _verdicts(pytester.path / "forward.json"),
        "reversed": _verdicts(pytester.path / "reversed.json"),
        "-n 2": _verdicts(pytester.path / "xdist.json"),
    }
    for name in TESTS:
        rows = {order: verdicts[name] for order, verdicts in table.items()}
        assert all(row == rows["alone"] for row in rows.values()), (name, rows)
    # And the verdicts are the right ones: the break is judged wherever it was compiled.
    for name in ("test_compile_then_loop", "test_compile_then_loop_again"):
        assert alone[name]["no_graph_breaks"] == "failed"
    assert alone["test_compiled_clean"]["no_graph_breaks"] == "passed"
    assert alone["test_compiled_clean"]["no_recompiles"] == "passed"
    assert alone["test_sync_each_step"]["no_host_sync"] == "failed"
    assert "failed" not in alone["test_clean_loop"].values()
