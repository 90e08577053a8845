"""An unmarked session pays nothing: the plugin loads only its pytest glue (torch-free; timing in benchmarks/)."""

from __future__ import annotations

import pytest

UNMARKED = """
    import sys

    def test_plain():
        loaded = sorted(m for m in sys.modules if m.startswith("pytest_torchperf"))
        heavy = [m for m in loaded if "." in m and m.split(".")[1] in (
            "registry", "invariants", "probes", "engine", "watch", "core", "report", "timing", "ranks",
            "options", "arguments", "stacks", "baseline", "results", "lightning",
        )]
        assert heavy == [], heavy
        assert "torch" not in sys.modules
"""


def test_an_unmarked_session_loads_no_registry_probe_or_timing_module(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain=UNMARKED)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)


def test_the_package_names_load_on_first_use() -> None:
    import pytest_torchperf

    assert pytest_torchperf.Status.FAILED == "failed" and callable(pytest_torchperf.watch)
    assert "watch" in dir(pytest_torchperf) and "Invariant" in dir(pytest_torchperf)
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'"):
        pytest_torchperf.no_such_name  # noqa: B018
    import sys

    import pytest_torchperf.watch  # noqa: F401 - the submodule does not replace the function on the package

    module = sys.modules["pytest_torchperf.watch"]

    assert pytest_torchperf.watch is module.watch
