"""What people look at in CI: the header line, the progress letter, the GitHub Actions job summary."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

import pytest_torchperf
from pytest_torchperf import registry

SUITE = """
    import torch


    def train(run, syncs=1):
        model = torch.nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            with run.step():
                loss = model(torch.randn(8, 4)).pow(2).mean()
                for _ in range(syncs):
                    value = loss.item()  # a sync
                loss.backward()
                opt.step()
                opt.zero_grad()


    def test_sync(torchperf):
        with torchperf.watch() as run:
            train(run)


    def test_clean(torchperf):
        with torchperf.watch() as run:
            train(run, syncs=0)


    def test_own_failure():
        assert 1 == 2
"""
SYNC_LINE = 11  # `value = loss.item()` in SUITE

ACME = """
from pytest_torchperf.extend import Check, CheckResult, Invariant, Status


class Nothing(Check):
    def result(self):
        return CheckResult("acme_nothing", Status.PASSED, "nothing to see", 0, [], {})


INVARIANT = Invariant(name="acme_nothing", doc="checks nothing", check=Nothing, default=False)
"""


def _acme_site(pytester: pytest.Pytester) -> str:
    site = pytester.path / "site"
    dist = site / "acme_torchperf-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-torchperf\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[pytest_torchperf.invariants]\nacme_nothing = acme_nothing:INVARIANT\n")
    (site / "acme_nothing.py").write_text(ACME)
    return str(site)


def test_the_header_counts_built_in_and_third_party_invariants_and_names_the_baseline(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    plain = pytester.runpytest_subprocess()
    assert f"torchperf 0.1.0: {len(registry.BUILTIN)} invariants" in plain.stdout.lines
    monkeypatch.setenv("PYTHONPATH", _acme_site(pytester))
    result = pytester.runpytest_subprocess(
        "--torchperf-baseline=torchperf-baseline.json", "--torchperf-baseline-update", "--torchperf-report-only"
    )
    result.stdout.fnmatch_lines([
        f"torchperf 0.*: {len(registry.BUILTIN)} invariants (+1 from acme-torchperf); "
        "baseline torchperf-baseline.json (updating it); report only"
    ])


#: The package under test (ahead of an installed copy in the subprocess).
_CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(pytest_torchperf.__file__)))


def test_the_header_is_computed_without_importing_an_invariant_module(pytester: pytest.Pytester) -> None:
    site = _acme_site(pytester)
    code = textwrap.dedent(
        """
        import sys
        from pytest_torchperf.glue import ci
        print(ci.header_line(ci.entry_point_names(), baseline_path="b.json"))
        print(sorted(m for m in sys.modules if m.startswith(("pytest_torchperf.invariants", "acme_nothing", "torch"))))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"PYTHONPATH": os.pathsep.join((site, _CHECKOUT)), "PATH": ""})
    assert done.stdout.splitlines() == [
        f"torchperf 0.1.0: {len(registry.BUILTIN)} invariants (+1 from acme-torchperf); baseline b.json", "[]"
    ], done.stderr


def test_a_test_failed_by_torchperf_has_its_own_letter_and_still_counts_and_reads_as_failed(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest()
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["test_suite.py T.F *"])
    result.stdout.fnmatch_lines(["FAILED test_suite.py::test_sync - torchperf: 1 invariant broken: *"])
    verbose = pytester.runpytest("-v")
    verbose.stdout.fnmatch_lines([
        "test_suite.py::test_sync FAILED *",
        "test_suite.py::test_clean PASSED *",
        "test_suite.py::test_own_failure FAILED *",
    ])
    # Report only: nothing fails, so no letter.
    pytester.runpytest("--torchperf-report-only").stdout.fnmatch_lines(["test_suite.py ..F *"])


def test_the_github_job_summary_has_every_watched_test_and_links_the_worst_findings(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    summary = pytester.path / "summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.setenv("GITHUB_WORKSPACE", str(pytester.path))
    monkeypatch.setenv("GITHUB_REPOSITORY", "acme/trainer")
    monkeypatch.setenv("GITHUB_SHA", "0123abc")
    monkeypatch.delenv("GITHUB_SERVER_URL", raising=False)
    pytester.makepyfile(test_suite=SUITE)
    pytester.runpytest().assert_outcomes(passed=1, failed=2)
    text = summary.read_text()
    assert text.startswith(
        "earlier step\n### torchperf: 2 watched tests, 1 failed; broken invariants: `no_host_sync` in 1"
    )
    assert (
        f"- **no_host_sync** (error) at [`test_suite.py:{SYNC_LINE}`]"
        f"(https://github.com/acme/trainer/blob/0123abc/test_suite.py#L{SYNC_LINE}): "
        "`.item()` in train: 1 per step over 4 steps (`test_suite.py::test_sync`)"
    ) in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [row.split(" | ")[:2] for row in rows] == [
        ["| `test_suite.py::test_sync`", "failed"], ["| `test_suite.py::test_clean`", "passed"]
    ]
    assert f"❌ `no_host_sync` **failed**: 4 syncs at test_suite.py:{SYNC_LINE}: 1 per step over 4 steps" in rows[0]
    assert "✅ `no_host_sync`" in rows[1]
    # Off with the annotations, and outside GitHub Actions.
    summary.write_text("")
    pytester.runpytest("--torchperf-annotations=off")
    monkeypatch.delenv("GITHUB_ACTIONS")
    pytester.runpytest()
    assert summary.read_text() == ""


@pytest.mark.slow
def test_under_xdist_the_letter_shows_and_the_controller_alone_writes_the_job_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One session for both (an xdist session is three processes that import torch).
    summary = pytester.path / "summary.md"
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    monkeypatch.delenv("GITHUB_REPOSITORY", raising=False)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=2)
    progress = [line for line in result.stdout.lines if line.endswith("[100%]")]
    assert len(progress) == 1 and sorted(progress[0].split()[0]) == [".", "F", "T"], result.stdout.lines
    text = summary.read_text()
    assert text.count("### torchperf:") == 1
    assert f"at `test_suite.py:{SYNC_LINE}`:" in text  # no commit known: the place, without a link
    assert text.count("| `test_suite.py::") == 2
