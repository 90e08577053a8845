"""The torchperf summary: a few session lines at default verbosity, per-test detail under -v, the same under xdist."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_torchperf.glue.summary import session_lines

#: A suite like a foreign project's, every test marked: configuration tests that never train, unittest classes
#: whose tests unittest skips or fails, tiny real training loops, a DataParallel built only to unwrap it, and
#: two real findings.
SYNTHETIC = '''
import unittest

import pytest
import torch

pytestmark = pytest.mark.torchperf


def train(steps=3, sync=False):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(steps):
        loss = model(torch.ones(2, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sync:
            print(loss.item())  # FINDING


@pytest.mark.parametrize("size", range(8))
def test_config_round_trips(size):
    assert dict(hidden=size)["hidden"] == size


@pytest.mark.parametrize("seed", range(4))
def test_trains(seed):
    torch.manual_seed(seed)
    train()


def test_logs_the_loss_every_step():
    train(sync=True)


def test_unwraps_a_data_parallel_model():
    inner = torch.nn.Linear(2, 2)
    assert torch.nn.DataParallel(inner).module is inner


@pytest.mark.skip(reason="needs a GPU")
def test_skipped_by_pytest():
    train()


class TestTokenizer(unittest.TestCase):
    def test_encodes(self):
        self.assertEqual("ab".upper(), "AB")

    @unittest.skip("slow")
    def test_skipped_by_decorator(self):
        train()

    def test_skipped_inside(self):
        self.skipTest("no network")

    def test_fails(self):
        self.assertEqual(1, 2)

    def test_trains(self):
        train()


@unittest.skip("needs a GPU")
class TestSkippedClass(unittest.TestCase):
    def test_one(self):
        train()
'''


def _block(text: str) -> list[str]:
    """The lines of the torchperf summary: from its title to the next separator."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if "= torchperf summary =" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("====="))
    return lines[start:end]


def test_a_marked_suite_gets_a_few_session_lines_and_no_warning_for_tests_that_never_train(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    result = pytester.runpytest("-p", "no:cacheprovider", "--torchperf-json=out.json")
    result.assert_outcomes(passed=15, failed=2, skipped=4, warnings=0)
    block = _block(result.stdout.str())
    assert block[1:] == [
        "torchperf: 19 watched tests (2 skipped), broken invariants: no_host_sync in 1",
        "torchperf: held: no_host_sync in 5, on_device in 6, no_iterator_reset in 6, no_data_parallel in 6, "
        "no_debug_modes in 6",
        "torchperf: 10 marked tests ran no training (nothing to watch)",
        "FAILED  test_synthetic.py::test_logs_the_loss_every_step: no_host_sync failed "
        "(3 syncs at test_synthetic.py:18: 1 per step over 3 steps)",
        f"torchperf: JSON report written to {pytester.path / 'out.json'}",
    ]
    result.stdout.no_fnmatch_line("*NotCheckedWarning*")
    assert not [line for line in block if "not checked" in line]
    # unittest recorded its own outcomes: the plugin reports them as unittest decided.
    doc = json.loads((pytester.path / "out.json").read_text())
    outcomes = {t["nodeid"].split("::", 1)[1]: t["outcome"] for t in doc["tests"]}
    assert outcomes["TestTokenizer::test_skipped_inside"] == "skipped"
    assert outcomes["TestTokenizer::test_skipped_by_decorator"] == "skipped"
    assert outcomes["TestTokenizer::test_fails"] == "failed"
    # The DataParallel built to be unwrapped is a note in the JSON, not a finding.
    unwrap = next(t for t in doc["tests"] if t["nodeid"].endswith("test_unwraps_a_data_parallel_model"))
    assert unwrap["outcome"] == "passed"
    assert unwrap["checks"]["no_data_parallel"]["status"] == "passed"
    assert unwrap["checks"]["no_data_parallel"]["findings"][0]["title"].startswith("note: ")


def test_verbose_shows_each_test_s_verdicts_without_the_invariants_that_did_not_apply(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    for flags in (["-v"], ["-rA"]):
        result = pytester.runpytest("-p", "no:cacheprovider", *flags)
        result.assert_outcomes(passed=15, failed=2, skipped=4, warnings=0)
        block = _block(result.stdout.str())
        assert "PASSED  test_synthetic.py::test_config_round_trips[0] (ran no training: nothing to watch)" in block
        assert "SKIPPED test_synthetic.py::TestTokenizer::test_skipped_inside" in block
        assert "FAILED  test_synthetic.py::TestTokenizer::test_fails" in block
        trained = block.index("PASSED  test_synthetic.py::test_trains[0]")
        steps = "        marker (steps: 3, found at optimizer.step()): "
        assert block[trained + 1].startswith(steps + "no_host_sync: passed")
        assert "no_graph_breaks" not in "\n".join(block)  # nothing was compiled: not listed on every test
        assert "torchperf: 10 marked tests ran no training (nothing to watch)" in block


@pytest.mark.slow
def test_under_xdist_the_controller_prints_the_same_session_block(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_synthetic=SYNTHETIC)
    serial = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    parallel = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    parallel.assert_outcomes(passed=15, failed=2, skipped=4, warnings=0)
    assert parallel.stdout.str().count("= torchperf summary =") == 1
    assert _block(parallel.stdout.str()) == _block(serial.stdout.str())


@pytest.mark.slow
def test_framework_notes_are_one_line_per_site_for_the_whole_session(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fits="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        @pytest.mark.parametrize("epochs", [1, 2, 3])
        def test_fit(tmp_path, epochs):
            make_trainer(tmp_path, max_epochs=epochs).fit(TinyModule(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(passed=3)
    notes = [line for line in _block(result.stdout.str()) if line.startswith("torchperf: noted in")]
    assert notes, result.stdout.str()
    sites = [line.split(" at ")[1].split(" in ")[0] for line in notes]
    assert len(sites) == len(set(sites))  # one line per site, however many tests made it
    assert all(line.startswith("torchperf: noted in 3 tests: ") for line in notes), notes
    assert all("pytorch_lightning/" in site for site in sites)


def _entry(i: int, status: str = "passed", steps: int = 4) -> dict[str, Any]:
    checks = {
        "no_host_sync": {"status": status, "summary": "3 syncs at a.py:1" if status == "failed" else "no sync"},
        "on_device": {"status": "passed", "summary": "no copy"},
        "no_graph_breaks": {"status": "not checked", "summary": "nothing was compiled"},
    }
    for check in checks.values():
        check["findings"] = []
    run = {"source": "marker", "steps": steps, "checks": checks}
    outcome = "failed" if status == "failed" else "passed"
    return {"nodeid": f"test_big.py::test_{i}", "outcome": outcome, "report_only": False, "runs": [run],
            "checks": checks}


def test_a_300_test_suite_with_three_findings_adds_about_ten_lines_plus_a_few_per_finding() -> None:
    tests = [_entry(i, "failed" if i in (7, 70, 170) else "passed") for i in range(300)]
    lines = session_lines(tests)
    assert len(lines) <= 10 + 3 * 3
    assert [line.text for line in lines if line.text.startswith("FAILED")] == [
        f"FAILED  test_big.py::test_{i}: no_host_sync failed (3 syncs at a.py:1)" for i in (7, 70, 170)
    ]
    assert lines[0].text == "torchperf: 300 watched tests, broken invariants: no_host_sync in 3"
    assert lines[0].colour is None and lines[-1].colour == "red"
    assert len(session_lines(tests, detail=True)) > 600  # two lines per test under -v
