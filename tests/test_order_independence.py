"""A watched test's verdicts do not depend on which tests ran before it (alone, forward, reversed, ``-n 2``).

Dynamo keeps what it compiled on the code objects of the user's functions: a
second test that compiles a fresh instance of the same module class reuses the
first one's compiled code and never compiles. Its verdicts must still be the
ones it gets alone.

An in-process pytest session (pytester's ``runpytest``) takes out of
``sys.modules`` every module first imported during it: torchperf's modules must
stay one copy per process, so that the next session and the next watch judge
as the first did.
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


#: Sessions run one after another in one process (pytester, in-process), then a watch in that process. Only the
#: plug-in is loaded before the sessions: torchperf's engine, probes and checks are first imported during the
#: first session, which takes them out of ``sys.modules`` when it ends.
IN_PROCESS = """
import json

import torch

pytest_plugins = ["pytester"]

COUNTED = '''
import torch


def test_counted(torchperf):
    with torchperf.watch(max_ops_per_step=10_000, count_warmup_steps=0, no_host_sync=False) as run:
        for _ in range(3):
            with run.step():
                torch.ones(3).add(1)
'''

SYNCED = '''
import torch


def test_synced(torchperf):
    model = torch.nn.Linear(8, 1)
    with torchperf.watch() as run:
        for _ in range(5):
            with run.step():
                loss = model(torch.ones(4, 8)).sum()
                loss.backward()
                print(loss.item())
'''


def session(pytester, path, **outcomes):
    pytester.runpytest(path, "--torchperf-json=out.json").assert_outcomes(**outcomes)
    doc = json.loads((pytester.path / "out.json").read_text())
    return {t["nodeid"]: {n: (c["status"], c["summary"]) for n, c in t["checks"].items()} for t in doc["tests"]}


def test_sessions_in_one_process(pytester):
    pytester.makepyfile(test_counted=COUNTED, test_synced=SYNCED)
    counted = [session(pytester, "test_counted.py", passed=1) for _ in range(3)]
    synced = [session(pytester, "test_synced.py", failed=1) for _ in range(2)]
    counted.append(session(pytester, "test_counted.py", passed=1))
    print("COUNTED", counted[0]["test_counted.py::test_counted"]["max_ops_per_step"])
    print("SYNCED", synced[0]["test_synced.py::test_synced"]["no_host_sync"])
    assert all(c == counted[0] for c in counted), counted
    assert synced[1] == synced[0], synced

    from pytest_torchperf import watch  # and in this process, after the sessions

    with watch(max_ops_per_step=10_000, count_warmup_steps=0) as run:
        for _ in range(3):
            with run.step():
                torch.ones(3).add(1)
    check = run.report["max_ops_per_step"]
    assert check.status == "passed", check.summary
    assert check.figures["ops"] == {"cpu:aten::add": 1.0, "cpu:aten::ones": 1.0}
"""


def test_in_process_sessions_and_a_watch_after_them_judge_as_the_first_session(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_in_process=IN_PROCESS)
    result = pytester.runpytest_subprocess("-p", "no:randomly", "-s")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines([
        "COUNTED ('passed', 'at most 2 ATen ops per step over 3 counted steps*",
        "SYNCED ('failed', '5 syncs at test_synced.py:*: 1 per step over 5 steps')",
    ])
