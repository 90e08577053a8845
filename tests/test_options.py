"""Every marker and fixture argument is validated, with a message that says what is allowed."""

from __future__ import annotations

import pytest

from pytest_torchperf import Options, UsageError, parse_options


def test_bare_marker_means_the_defaults() -> None:
    options = parse_options({})
    assert options == Options()
    assert options.scope == "training_step"
    assert options.max_overhead is None
    assert options.enabled_checks == (
        "no_host_sync", "on_device", "no_iterator_reset", "no_data_parallel", "no_graph_breaks", "no_debug_modes"
    )


def test_max_overhead_enables_its_check_and_is_stored_as_float() -> None:
    options = parse_options({"max_overhead": 1})
    assert options.max_overhead == 1.0 and isinstance(options.max_overhead, float)
    assert "max_overhead" in options.enabled_checks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"no_iterater_reset": True}, "unknown argument 'no_iterater_reset' (did you mean 'no_iterator_reset'?)"),
        ({"max_overheads": 0.1}, "unknown argument 'max_overheads' (did you mean 'max_overhead'?)"),
        ({"frobnicate": 1}, "unknown argument 'frobnicate'; allowed arguments: no_host_sync, on_device"),
        ({"no_host_sync": 1}, "no_host_sync must be True or False, got 1 (int)"),
        ({"on_device": "yes"}, "on_device must be True or False, got 'yes' (str)"),
        ({"max_overhead": "ten%"}, "max_overhead must be a number > 0 and at most 10 (a fraction: 0.10 means 10%, 2.5 "
         "means 250%), or a percentage such as '10%' (at most 10000%) or None, got 'ten%'"),
        ({"max_overhead": 50}, "max_overhead=50 reads as a percentage typed without its % sign: did you mean "
         "max_overhead=0.5 or max_overhead=\"50%\"?"),
        ({"max_overhead": True}, "max_overhead must be a number > 0"),
        ({"max_overhead": 0}, "max_overhead must be a finite number > 0"),
        ({"max_overhead": -0.1}, "max_overhead must be a finite number > 0"),
        ({"max_overhead": float("nan")}, "max_overhead must be a finite number > 0"),
        ({"scope": "bacth"}, "scope must be one of 'training_step', 'batch', 'test', got 'bacth' (did you mean "
                             "'batch'?)"),
        ({"scope": 3}, "scope must be one of 'training_step', 'batch', 'test', got 3"),
    ],
)
def test_bad_arguments_are_named_with_what_is_allowed(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError) as excinfo:
        parse_options(kwargs, where="@pytest.mark.torchperf")
    assert message in str(excinfo.value)
    assert str(excinfo.value).startswith("@pytest.mark.torchperf")


def test_positional_arguments_are_refused() -> None:
    with pytest.raises(UsageError, match=r"takes keyword arguments only, got positional 0\.1"):
        parse_options({}, args=(0.1,))


def test_usage_error_is_a_value_error() -> None:
    assert issubclass(UsageError, ValueError)


@pytest.mark.parametrize(
    "marker, message",
    [
        ("torchperf(scope='bacth')", "*scope must be one of*got 'bacth' (did you mean 'batch'?)*"),
        ("torchperf(no_iterater_reset=False)", "*unknown argument 'no_iterater_reset' (did you mean "
                                               "'no_iterator_reset'?)*"),
        ("torchperf(0.1)", "*takes keyword arguments only*"),
        ("torchperf(max_overhead='10')", "*max_overhead must be a number*"),
        ("torchperf(max_overhead=50)", "*did you mean max_overhead=0.5 or max_overhead=\"50%\"?*"),
    ],
)
def test_bad_marker_is_a_setup_error_not_an_internal_error(
    pytester: pytest.Pytester, marker: str, message: str
) -> None:
    pytester.makepyfile(
        f"""
        import pytest

        @pytest.mark.{marker}
        def test_body():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines([f"pytest-torchperf: @pytest.mark.torchperf{message}"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")
    # A clean message: no traceback of the plugin, no chained exception.
    result.stdout.no_fnmatch_line("*During handling of the above exception*")
    result.stdout.no_fnmatch_line("*pytest_torchperf/options.py*")


def test_module_marker_is_merged_with_the_test_marker(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        pytestmark = pytest.mark.torchperf(scope="batch", no_host_sync=False)

        @pytest.mark.torchperf(scope="test")
        def test_body(request):
            pass

        def test_module_only():
            pass
        """
    )
    result = pytester.runpytest("-p", "no:randomly", "-v")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines([
        "PASSED  *::test_body",
        "        marker: on_device: passed (*) | no_iterator_reset: passed*",  # scope="test": the body is the step
        "PASSED  *::test_module_only (ran no training: nothing to watch)",
    ])
    result.stdout.no_fnmatch_line("*no_host_sync*")


def test_bad_fixture_argument_raises_in_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_loop(torchperf):
            with torchperf.watch(scop="batch"):
                pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["E*UsageError: torchperf.watch() got an unknown argument 'scop' (did you mean 'scope'?)*"]
    )


def test_marker_is_registered_with_its_signature(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.torchperf(no_host_sync=True, on_device=True, no_iterator_reset=True, "
            "max_overhead=None, *scope='training_step'*"
        ]
    )


def test_marker_works_under_strict_markers_and_warnings_as_errors(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.torchperf
        def test_body():
            pass
        """
    )
    # An empty body trains nothing: its "not checked" warning is not what this test is about.
    result = pytester.runpytest("--strict-markers", "-W", "error", "--torchperf-not-checked=pass")
    result.assert_outcomes(passed=1)
