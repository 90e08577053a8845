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
    assert "watch" in dir(pytest_torchperf) and set(pytest_torchperf.__all__) <= set(dir(pytest_torchperf))
    with pytest.raises(AttributeError, match="no attribute 'no_such_name'$"):
        pytest_torchperf.no_such_name  # noqa: B018


def test_watch_is_the_function_and_no_module_shares_its_name() -> None:
    import pkgutil

    import pytest_torchperf
    from pytest_torchperf import watch
    from pytest_torchperf.watching import watch as defined

    assert watch is defined and pytest_torchperf.watch is defined
    assert "watch" not in {m.name for m in pkgutil.iter_modules(pytest_torchperf.__path__)}


def test_each_name_lives_in_one_front_door_but_the_seam_types() -> None:
    import pytest_torchperf
    from pytest_torchperf import extend

    both = set(pytest_torchperf.__all__) & set(extend.__all__)
    assert both == {"Run", "CheckResult", "Finding", "Site", "Status", "UsageError"}
    for name in both:  # one object, two doors
        assert getattr(pytest_torchperf, name) is getattr(extend, name)


def test_a_plugin_name_read_from_the_users_front_door_names_the_plugin_api() -> None:
    import pytest_torchperf
    from pytest_torchperf import extend

    assert "Invariant" not in dir(pytest_torchperf) and pytest_torchperf._MOVED_TO_EXTEND <= set(extend.__all__)
    with pytest.raises(AttributeError, match="from pytest_torchperf.extend import it"):
        pytest_torchperf.Invariant  # noqa: B018
