"""CI output: the JSON report, JUnit properties, options and their precedence, xdist, verbosity."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET

import pytest

from pytest_torchperf.glue.results import SCHEMA_VERSION
from pytest_torchperf.report import FAILED, CheckResult, Finding, Report, Site

SUITE = """
    import pytest
    from torchperf_models import make_loader

    def epochs(loader, n, run=None):
        for _ in range(n):
            for batch in loader:
                pass

    @pytest.mark.torchperf
    def test_marker_clean():
        epochs(make_loader(persistent_workers=True), 2)

    @pytest.mark.torchperf
    def test_marker_respawns():
        epochs(make_loader(persistent_workers=False), 3)

    def test_fixture_respawns(torchperf):
        with torchperf.watch():
            epochs(make_loader(persistent_workers=False), 2)

    def test_not_watched():
        pass
"""


def _load(path) -> dict:
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def _verdicts(doc: dict) -> dict:
    return {
        t["nodeid"]: (t["outcome"], {name: c["status"] for name, c in t["checks"].items()}) for t in doc["tests"]
    }


#: Two parametrized tests, one failing: their verdicts and the one summary under xdist.
MANY = """
    import pytest
    from torchperf_models import make_loader

    @pytest.mark.parametrize("persistent", [True, False])
    def test_loop(torchperf, persistent):
        loader = make_loader(persistent_workers=persistent)
        with torchperf.watch():
            for epoch in range(2):
                for batch in loader:
                    pass
"""


@pytest.mark.slow
def test_xdist_gives_the_serial_verdicts_one_summary_and_the_same_json_report(user_models: pytest.Pytester) -> None:
    # One xdist session for all three (an xdist session is three processes that import Lightning); the
    # serial one runs in this process.
    user_models.makepyfile(test_suite=SUITE, test_many=MANY)
    serial = user_models.runpytest("--torchperf-json=serial.json")
    serial.assert_outcomes(passed=3, failed=3)
    serial.stdout.fnmatch_lines(
        [
            "torchperf: 5 watched tests, broken invariants: no_iterator_reset in 3",
            "torchperf: 2 marked tests ran no training (nothing to watch)",
            "torchperf: JSON report written to *serial.json",
        ]
    )
    parallel = user_models.runpytest_subprocess("-n", "2", "--torchperf-json=parallel.json")
    parallel.assert_outcomes(passed=3, failed=3)
    assert parallel.stdout.str().count("= torchperf summary =") == 1
    parallel.stdout.fnmatch_lines_random(
        [
            "torchperf: 5 watched tests, broken invariants: no_iterator_reset in 3",
            "torchperf: 2 marked tests ran no training (nothing to watch)",
            "FAILED  test_many.py::test_loop[[]False[]]: no_iterator_reset failed (1 extra worker pool in 1 loader)",
        ]
    )
    parallel.stdout.fnmatch_lines(["FAILED test_many.py::test_loop[[]False[]]*"])

    doc = _load(user_models.path / "serial.json")
    assert doc["schema_version"] == SCHEMA_VERSION
    env = doc["environment"]
    assert env["torch"].startswith("2.") and env["pytest_torchperf"] and env["python"]
    assert env["cuda_available"] in (True, False) and env["device"]
    assert doc["summary"] == {
        "tests": 5,
        "failed": 3,
        "checks_failed": {"no_iterator_reset": 3},
        "checks_inconclusive": {},
    }
    by_id = {t["nodeid"]: t for t in doc["tests"]}
    respawn = by_id["test_suite.py::test_marker_respawns"]
    assert respawn["outcome"] == "failed" and respawn["report_only"] is False
    check = respawn["checks"]["no_iterator_reset"]
    assert check["passed"] is False and check["count"] == 2
    assert check["figures"]["pools_started"] == 3
    assert check["findings"][0]["sites"][0]["site"] == "test_suite.py:6"
    assert respawn["runs"][0]["source"] == "marker"
    assert respawn["runs"][0]["options"]["scope"] == "training_step"
    assert by_id["test_suite.py::test_fixture_respawns"]["runs"][0]["source"] == "fixture"
    assert by_id["test_suite.py::test_marker_clean"]["checks"]["no_iterator_reset"]["passed"] is True

    pdoc = _load(user_models.path / "parallel.json")
    assert _verdicts(pdoc) == _verdicts(doc)
    assert pdoc["environment"]["xdist_workers"] == 2


@pytest.mark.slow
def test_junit_xml_carries_figures_as_properties(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_suite=SUITE)
    user_models.runpytest("--junitxml=out.xml", "-k", "marker")
    root = ET.parse(user_models.path / "out.xml").getroot()
    props = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in root.iter("testcase")
    }
    assert props["test_marker_respawns"]["torchperf.no_iterator_reset.status"] == "failed"
    assert props["test_marker_respawns"]["torchperf.no_iterator_reset.count"] == "2"
    assert props["test_marker_respawns"]["torchperf.no_iterator_reset.pools_started"] == "3"
    assert props["test_marker_clean"]["torchperf.no_iterator_reset.status"] == "passed"


@pytest.mark.slow
def test_report_only_reports_without_failing(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_suite=SUITE)
    result = user_models.runpytest("--torchperf-report-only", "--torchperf-json=out.json")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "PASSED  test_suite.py::test_marker_respawns (report only: broken invariants did not fail it): "
            "no_iterator_reset failed (2 extra worker pools in 1 loader)",
        ]
    )
    verbose = user_models.runpytest("--torchperf-report-only", "-rA")
    verbose.stdout.fnmatch_lines(
        [
            "PASSED  test_suite.py::test_marker_respawns (report only: broken invariants did not fail it)",
            "*marker: *no_iterator_reset: failed (2 extra worker pools in 1 loader)*",
        ]
    )
    doc = _load(user_models.path / "out.json")
    respawn = {t["nodeid"]: t for t in doc["tests"]}["test_suite.py::test_marker_respawns"]
    assert respawn["report_only"] is True and respawn["outcome"] == "passed"
    assert respawn["checks"]["no_iterator_reset"]["status"] == FAILED


@pytest.mark.slow
def test_report_only_from_the_ini_file(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_suite=SUITE)
    user_models.makeini("[pytest]\ntorchperf_report_only = true\ntorchperf_json = from-ini.json\n")
    user_models.runpytest().assert_outcomes(passed=4)
    assert (user_models.path / "from-ini.json").exists()


SCOPE_PROBE = """
    import pytest

    @pytest.mark.torchperf
    def test_marker_default(torchperf):
        with torchperf.watch() as run:
            pass
        print("fixture scope:", run.options.scope)

    @pytest.mark.torchperf(scope="training_step")
    def test_marker_own_scope():
        pass

    def test_fixture_own_scope(torchperf):
        with torchperf.watch(scope="training_step") as run:
            pass
        assert run.options.scope == "training_step"
"""


@pytest.mark.parametrize(
    "ini, args, expected",
    [
        (None, [], "training_step"),  # the default
        ("batch", [], "batch"),  # ini
        ("batch", ["--torchperf-scope=test"], "test"),  # command line beats ini
        (None, ["--torchperf-scope=test"], "test"),
    ],
)
def test_scope_precedence_marker_then_command_line_then_ini_then_default(
    pytester: pytest.Pytester, ini: str, args: list, expected: str
) -> None:
    pytester.makepyfile(test_scope=SCOPE_PROBE)
    if ini:
        pytester.makeini(f"[pytest]\ntorchperf_scope = {ini}\n")
    result = pytester.runpytest("-s", "--torchperf-json=out.json", *args)
    result.assert_outcomes(passed=3)
    result.stdout.fnmatch_lines([f"*fixture scope: {expected}"])
    doc = _load(pytester.path / "out.json")
    scopes = {t["nodeid"].split("::")[1]: [r["options"]["scope"] for r in t["runs"]] for t in doc["tests"]}
    assert scopes["test_marker_default"] == [expected, expected]  # the marker's run, the fixture's run
    assert scopes["test_marker_own_scope"] == ["training_step"]  # a marker argument beats everything
    assert scopes["test_fixture_own_scope"] == ["training_step"]


def test_bad_ini_value_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_x(): pass")
    pytester.makeini("[pytest]\ntorchperf_scope = bacth\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*pytest-torchperf: ini option torchperf_scope must be one of training_step, batch, test, "
         "got 'bacth' (did you mean 'batch'?)*"]
    )
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize(
    "arg, message",
    [
        ("--torchperf-scope=bacth", "*--torchperf-scope: must be one of*got 'bacth' (did you mean 'batch'?)*"),
        ("--torchperf-threads=lots", "*--torchperf-threads: must be 'auto', 'off' or a positive integer, got 'lots'*"),
    ],
)
def test_bad_command_line_value_is_a_usage_error(pytester: pytest.Pytester, arg: str, message: str) -> None:
    pytester.makepyfile("def test_x(): pass")
    result = pytester.runpytest(arg)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


def test_options_are_documented_in_help(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(
        [
            "*PyTorch/Lightning performance invariants (pytest-torchperf)*",
            "*--torchperf-json=PATH*",
            "*--torchperf-scope=SCOPE*",
            "*--torchperf-report-only*",
            "*--torchperf-threads=N*",
            "*torchperf_json (string)*",
            "*torchperf_report_only (bool)*",
        ]
    )


THREADS_PROBE = """
    import os

    def test_threads(torchperf, request):
        with torchperf.watch():
            import torch
            lock = os.environ.get("PYTEST_TORCHPERF_TIMING_LOCK")
            # xdist workers' output is not shown: leave the figures in a file.
            (request.config.rootpath / "probe.txt").write_text(f"threads: {torch.get_num_threads()} lock: {lock}")
"""


@pytest.mark.slow
def test_xdist_workers_share_the_cores_and_a_timing_lock(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.delenv("PYTEST_TORCHPERF_TIMING_LOCK", raising=False)
    pytester.makepyfile(test_threads=THREADS_PROBE)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=1)
    expected = max(1, (os.cpu_count() or 1) // 2)
    probe = (pytester.path / "probe.txt").read_text()
    assert probe.startswith(f"threads: {expected} lock: ") and probe.endswith("timing.lock"), probe


@pytest.mark.slow
def test_user_thread_settings_are_respected(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    auto = max(1, (os.cpu_count() or 1) // 2)
    mine = 2 if auto != 2 else 1  # anything but what "auto" would pick (torch caps it at the cores)
    monkeypatch.setenv("OMP_NUM_THREADS", str(mine))
    pytester.makepyfile(test_threads=THREADS_PROBE)
    pytester.runpytest_subprocess("-n", "2").assert_outcomes(passed=1)
    assert (pytester.path / "probe.txt").read_text().startswith(f"threads: {mine} lock: ")


@pytest.mark.slow
def test_threads_option_pins_a_serial_run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # This suite may itself run under xdist, whose workers carry the session's lock: a serial run has none.
    monkeypatch.delenv("PYTEST_TORCHPERF_TIMING_LOCK", raising=False)
    pytester.makepyfile(test_threads=THREADS_PROBE)
    pytester.runpytest_subprocess("--torchperf-threads=1").assert_outcomes(passed=1)
    assert (pytester.path / "probe.txt").read_text() == "threads: 1 lock: None"


def _report_with(findings: int, sites: int) -> Report:
    stack = ()
    check = CheckResult(
        "no_iterator_reset",
        FAILED,
        f"{findings} findings",
        findings,
        [
            Finding(f"finding {i}", [], [Site(f"site {j}", stack) for j in range(sites)], "hint")
            for i in range(findings)
        ],
    )
    return Report(checks={"no_iterator_reset": check})


def test_default_output_is_capped_and_verbose_shows_everything() -> None:
    report = _report_with(findings=8, sites=6)
    short = report.render(verbose=False)
    assert "finding 4" in short and "finding 5" not in short
    assert "... 3 more findings (-v shows all)" in short
    assert "site 2" in short and "site 3" not in short
    assert "... 3 more sites (-v shows all)" in short
    full = report.render(verbose=True)
    assert "finding 7" in full and "site 5" in full and "more" not in full


def test_a_figure_named_like_the_process_merge_is_an_ordinary_junit_property() -> None:
    from pytest_torchperf.glue.results import junit_properties

    # no_oversubscription counts "ranks"; the per-process merge lives in "processes", never in the figures.
    alone = CheckResult("no_oversubscription", "passed", "ok", 0, [], {"ranks": 1, "workers": 2}).to_dict()
    merged = CheckResult(
        "no_host_sync", FAILED, "rank 1: 4 syncs", 4, [], {"syncs": 4},
        {"rank1": {"status": FAILED, "summary": "4 syncs", "figures": {"syncs": 4, "stack": [1]}}},
    ).to_dict()
    props = dict(junit_properties({"no_oversubscription": alone, "no_host_sync": merged}))
    assert props["torchperf.no_oversubscription.ranks"] == 1
    assert props["torchperf.no_host_sync.rank1.status"] == FAILED
    assert props["torchperf.no_host_sync.rank1.syncs"] == 4
    assert "torchperf.no_host_sync.rank1.stack" not in props and "processes" not in alone
