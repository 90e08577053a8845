"""What works without torch: the plugin loads, unmarked suites run, options and markers are checked.

These run in every environment, and are the suite of the torch-free compatibility runs
(the oldest and newest Python, the oldest pytest: the nox sessions `compat-torch-free-*`), where
``TORCHPERF_EXPECT_NO_TORCH=1`` asserts torch is really absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import pytest_torchperf

NO_TORCH = os.environ.get("TORCHPERF_EXPECT_NO_TORCH") == "1"


def test_this_environment_is_the_one_it_claims_to_be() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        has_torch = False
    else:
        has_torch = True
    assert has_torch is not NO_TORCH


def test_importing_the_plugin_does_not_import_torch() -> None:
    code = (
        "import sys, pytest_torchperf.glue.plugin; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


UNMARKED = """
    import sys

    def test_plain():
        assert "torch" not in sys.modules

    def test_another():
        pass
"""


def test_an_unmarked_suite_runs_with_the_plugin_and_every_report_option(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=UNMARKED)
    result = pytester.runpytest_subprocess(
        "--torchperf-json=out.json", "--torchperf-annotations=on", "--torchperf-trace=traces",
        "--torchperf-baseline=b.json", "--torchperf-baseline-update", "--torchperf-threads=1",
    )
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["plugins:*torchperf*"])
    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["tests"] == [] and doc["environment"]["pytest_torchperf"] == pytest_torchperf.__version__
    assert json.loads((pytester.path / "b.json").read_text())["tests"] == {}
    assert not (pytester.path / "traces").exists()
    assert not [line for line in result.stdout.lines if line.startswith("::")]


def test_help_and_markers_document_the_plugin(pytester: pytest.Pytester) -> None:
    help_text = pytester.runpytest("--help")
    help_text.stdout.fnmatch_lines(
        [
            "*PyTorch/Lightning performance invariants (pytest-torchperf)*",
            "*--torchperf-json=PATH*",
            "*--torchperf-baseline=PATH*",
            "*--torchperf-annotations=WHEN*",
            "*--torchperf-trace=DIR*",
        ]
    )
    markers = pytester.runpytest("--markers")
    markers.stdout.fnmatch_lines(["@pytest.mark.torchperf(*no_host_sync=True*scope='training_step'*"])


@pytest.mark.parametrize(
    "marker, message",
    [
        ("torchperf(scope='bacth')", "*scope must be one of*got 'bacth' (did you mean 'batch'?)*"),
        (
            "torchperf(no_iterater_reset=False)",
            "*unknown argument 'no_iterater_reset' (did you mean 'no_iterator_reset'?)*",
        ),
        ("torchperf(min_workers=-1)", "*min_workers*"),
    ],
)
def test_a_bad_marker_argument_is_an_error_at_setup(pytester: pytest.Pytester, marker: str, message: str) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_fit():
            pass
        """
    )
    result = pytester.runpytest("--strict-markers", "-W", "error")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"pytest-torchperf: @pytest.mark.torchperf{message}"])


@pytest.mark.parametrize(
    "args, ini, message",
    [
        (["--torchperf-scope=bacth"], "", "*--torchperf-scope: must be one of*(did you mean 'batch'?)*"),
        (["--torchperf-annotations=yes"], "", "*--torchperf-annotations: must be one of auto, on, off, got 'yes'*"),
        ([], "torchperf_annotations = yes", "*ini option torchperf_annotations must be one of auto, on, off*"),
        (["--torchperf-baseline-update"], "", "*--torchperf-baseline-update needs the file*"),
        (["--torchperf-baseline=none.json"], "", "*no baseline file at *none.json*"),
    ],
)
def test_bad_options_are_usage_errors(pytester: pytest.Pytester, args: list, ini: str, message: str) -> None:
    pytester.makepyfile(test_plain=UNMARKED)
    if ini:
        pytester.makeini(f"[pytest]\n{ini}\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


@pytest.mark.skipif(not NO_TORCH, reason="checks the message given when torch is missing")
def test_a_marked_test_without_torch_fails_saying_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.torchperf
        def test_marked():
            pass

        def test_fixture(torchperf):
            with torchperf.watch():
                pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*pytest-torchperf: watching a test needs torch, which is not installed*"])
