"""Each invariant is declared once: the registry drives validation, the marker, the README and the schema."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pytest_torchperf import Options, UsageError, parse_options, registry, watch
from pytest_torchperf.extend import Argument, Check, CheckResult, Flag, Integer, Invariant, register, unregister
from pytest_torchperf.options import describe_options
from pytest_torchperf.report import PASSED

ROOT = Path(__file__).resolve().parent.parent


def test_the_reference_argument_tables_are_the_registry_s() -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "readme_tables.py"), "--check"],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
    reference = (ROOT / "docs" / "reference" / "invariants.md").read_text()
    for name, (arg, _) in registry.all_arguments().items():
        assert f"`{name}`" in reference
        assert " ".join(arg.doc.split()).replace("|", "\\|") in reference


def test_every_built_in_invariant_is_one_module_with_its_declaration() -> None:
    found = registry.invariants()
    assert list(found)[: len(registry.BUILTIN)] == list(registry.BUILTIN)
    for name in registry.BUILTIN:
        module = sys.modules[f"pytest_torchperf.invariants.{name}"]
        assert module.INVARIANT is found[name] and found[name].name == name


def test_the_options_schema_covers_every_argument_and_accepts_the_defaults() -> None:
    schema = registry.options_schema()
    assert schema["additionalProperties"] is False
    assert list(schema["properties"]) == list(registry.all_arguments())
    assert schema["properties"]["max_syncs_per_step"] == {
        "type": ["integer", "null"], "minimum": 0, "default": None,
        "description": registry.all_arguments()["max_syncs_per_step"][0].doc, "x-invariant": "no_host_sync",
    }
    assert schema["properties"]["scope"]["enum"] == ["training_step", "batch", "test"]
    defaults = {name: prop["default"] for name, prop in schema["properties"].items()}
    assert parse_options(defaults) == Options()


def test_options_are_immutable_and_name_a_misspelt_attribute() -> None:
    options = parse_options({"max_overhead": 1})
    with pytest.raises(AttributeError, match="immutable"):
        options.max_overhead = 2.0  # type: ignore[misc]
    with pytest.raises(AttributeError, match=r"no argument 'max_overheads' \(did you mean 'max_overhead'\?\)"):
        options.max_overheads  # noqa: B018
    assert options.replace(max_overhead=None) == Options()
    assert options.to_dict()["max_overhead"] == 1.0
    assert "max_overhead=1.0" in repr(options)


class CountSteps(Check):
    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        super().__init__(run)
        self.ends = 0

    def on_step_end(self) -> None:
        self.ends += 1

    def result(self) -> CheckResult:
        steps = self.run.options.at_least_steps
        status = PASSED if self.ends >= steps else "failed"
        return CheckResult("at_least_steps_ran", status, f"{self.ends} steps ended", 0, [], {"ends": self.ends})


SPEC = Invariant(
    name="at_least_steps_ran",
    doc="the run ends at least N training steps",
    check=CountSteps,
    kind=Flag(),
    default=False,
    arguments=(Argument("at_least_steps", Integer(minimum=1, optional=False), 1, "how many steps must end"),),
)


@pytest.fixture
def registered() -> Invariant:
    register(SPEC)
    try:
        yield SPEC
    finally:
        unregister(SPEC.name)


def test_a_registered_invariant_is_validated_checked_and_listed(registered: Invariant) -> None:
    assert "at_least_steps_ran=False" in describe_options() and "at_least_steps=1" in describe_options()
    with pytest.raises(UsageError, match=r"unknown argument 'at_least_step' \(did you mean 'at_least_steps'\?\)"):
        parse_options({"at_least_step": 2})
    with pytest.raises(UsageError, match=r"at_least_steps must be an integer >= 1, got 0 \(int\)"):
        parse_options({"at_least_steps": 0})
    with watch(at_least_steps_ran=True, at_least_steps=2, no_host_sync=False) as run:
        for _ in range(3):
            with run.step():
                pass
    result = run.report["at_least_steps_ran"]  # type: ignore[index]
    assert (result.status, result.summary, result.figures) == (PASSED, "3 steps ended", {"ends": 3})


def test_registering_a_taken_name_or_a_reserved_one_is_refused(registered: Invariant) -> None:
    with pytest.raises(UsageError, match="'at_least_steps_ran' is already registered"):
        register(SPEC)
    with pytest.raises(UsageError, match="'no_host_sync' is already registered"):
        register(Invariant(name="no_host_sync", doc="", check=CountSteps))
    with pytest.raises(UsageError, match="'to_dict' cannot be an argument name"):
        register(Invariant(name="to_dict", doc="", check=CountSteps))
    with pytest.raises(UsageError, match="not a pytest_torchperf.extend.Invariant"):
        register("no_such_thing")  # type: ignore[arg-type]


@pytest.mark.slow
def test_a_broken_third_party_entry_point_is_a_usage_error_naming_it(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    dist = pytester.path / "site" / "broken_invariants-1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-invariants\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        "[pytest_torchperf.invariants]\nbroken = no_such_module_anywhere:INVARIANT\n"
    )
    pytester.makepyfile(
        "import pytest\n\ndef test_nothing():\n    pass\n\n"
        "@pytest.mark.torchperf\ndef test_watched():\n    pass\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(pytester.path / "site"))
    named = (
        "*pytest-torchperf: cannot load entry point 'broken' of broken-invariants "
        "(no_such_module_anywhere:INVARIANT): ModuleNotFoundError*"
    )
    # The invariants load when the first test is watched (start-up pays nothing): its set-up fails naming it.
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1, errors=1)
    assert "pytest-torchperf: pytest-torchperf:" not in result.stdout.str()
    result.stdout.fnmatch_lines([named])
    # `pytest --markers` lists every invariant: a usage error naming the broken one.
    result = pytester.runpytest_subprocess("--markers")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([named])
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()


def test_importing_the_registry_and_parsing_options_never_imports_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        from pytest_torchperf import registry, options
        registry.invariants()
        options.parse_options({"max_overhead": 0.1, "allowed_syncs": ["a.py:3"]})
        print("torch" in sys.modules)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


def test_a_handler_with_the_wrong_arguments_is_refused_at_registration_with_the_expected_signature() -> None:
    from pytest_torchperf.arguments import UsageError
    from pytest_torchperf.extend import Check, Invariant, register

    class WrongSync(Check):
        def on_sync(self, event, extra):  # type: ignore[no-untyped-def]  # the event sends one argument
            pass

        def result(self):  # type: ignore[no-untyped-def]
            raise AssertionError("never made")

    with pytest.raises(UsageError) as info:
        register(Invariant("wrong_sync_handler", "a check whose handler takes two arguments", WrongSync))
    message = str(info.value)
    assert "on_sync(self, event, extra)" in message
    assert "it is called as on_sync(self, event)" in message


def test_an_unknown_handler_name_is_refused_with_did_you_mean() -> None:
    from pytest_torchperf.arguments import UsageError
    from pytest_torchperf.extend import Check, Invariant, register

    class Misspelt(Check):
        def on_step_ends(self):  # type: ignore[no-untyped-def]
            pass

        def result(self):  # type: ignore[no-untyped-def]
            raise AssertionError("never made")

    with pytest.raises(UsageError, match="on_step_ends\\(\\), which is no event \\(did you mean 'on_step_end'\\?\\)"):
        register(Invariant("misspelt_handler", "a check with a misspelt handler", Misspelt))


def test_a_handler_may_take_defaults_or_star_args_beyond_what_the_event_sends() -> None:
    from pytest_torchperf.extend import Check, Invariant, register, unregister

    class Lenient(Check):
        def on_optimizer_step(self, optimizer, *rest):  # type: ignore[no-untyped-def]
            pass

        def on_step_end(self, extra=None):  # type: ignore[no-untyped-def]
            pass

        def result(self):  # type: ignore[no-untyped-def]
            raise AssertionError("never made")

    register(Invariant("lenient_handlers", "handlers that take what their events send", Lenient))
    unregister("lenient_handlers")


def test_an_event_s_declared_signature_is_what_the_reference_lists() -> None:
    import inspect

    from pytest_torchperf.core import EVENTS, Events

    for name, text in EVENTS.items():
        params = list(inspect.signature(getattr(Events, name)).parameters)[1:]
        assert text.startswith(f"({', '.join(params)}): ")


_LATE_PLUGIN = '''
import pytest

from pytest_torchperf.extend import Argument, Check, CheckResult, Integer, Invariant, register, unregister


class SeesItsSetting(Check):
    def result(self) -> CheckResult:
        late = self.run.options.late_setting
        return CheckResult("late_invariant", "passed", f"late_setting={late}", 0, [], {"late_setting": late})


LATE = Invariant(
    name="late_invariant",
    doc="registered after the first watched test",
    check=SeesItsSetting,
    arguments=(Argument("late_setting", Integer(minimum=1, optional=False), 1, "a setting of its own"),),
)


@pytest.mark.torchperf
def test_a_watched_test_loads_the_registry():
    pass


def test_a_plugin_registers_its_invariant():
    register(LATE)


@pytest.mark.torchperf(late_invariant=True, late_setting=3)
def test_the_marker_accepts_it():
    pass


def test_the_plugin_unregisters_it():
    unregister("late_invariant")


@pytest.mark.torchperf(late_invariant=True)
def test_the_marker_refuses_it_again():
    pass
'''


def test_an_invariant_registered_after_the_first_watched_test_is_known_from_then_on(pytester: pytest.Pytester) -> None:
    """The registry's tables are built once and kept: registering (and unregistering) builds them again."""
    import json

    pytester.makepyfile(test_late=_LATE_PLUGIN)
    try:
        result = pytester.runpytest("-p", "no:randomly", "--torchperf-json=out.json")
    finally:
        unregister("late_invariant")  # whatever the inner run left
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at setup of test_the_marker_refuses_it_again*", "*got an unknown argument 'late_invariant'*"]
    )
    tests = {t["nodeid"].split("::")[-1]: t for t in json.loads((pytester.path / "out.json").read_text())["tests"]}
    (run,) = tests["test_the_marker_accepts_it"]["runs"]
    assert run["options"]["late_invariant"] is True and run["options"]["late_setting"] == 3
    assert run["checks"]["late_invariant"]["summary"] == "late_setting=3"
    assert "late_invariant" not in tests["test_a_watched_test_loads_the_registry"]["runs"][0]["options"]


def test_the_registry_loads_without_max_overhead_s_replay_and_timing_modules() -> None:
    """``max_overhead``'s check is made by a factory: its modules load when a run first checks it."""
    code = textwrap.dedent(
        """
        import sys
        from pytest_torchperf import options, registry
        registry.all_arguments()
        options.parse_options({"max_overhead": 0.1})
        print(sorted(m for m in sys.modules if m.startswith(("pytest_torchperf.overhead", "pytest_torchperf.timing"))))
        """
    )
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "[]"


def test_every_built_in_declaration_passes_the_validation_a_plug_in_s_gets() -> None:
    """The registry does not validate this package's own declarations in every process: this test does."""
    for name in registry.BUILTIN:
        registry._validate(registry.get(name), f"pytest_torchperf.invariants.{name}")


def test_every_built_in_check_s_handlers_take_what_their_events_send() -> None:
    """As at registration, for the one built-in check made by a factory too (verified when first made)."""
    from pytest_torchperf.declarations import verify_handlers
    from pytest_torchperf.overhead.check import OverheadCheck

    made_by_factories = {"max_overhead": OverheadCheck}
    for name in registry.BUILTIN:
        invariant = registry.get(name)
        check = invariant.check if isinstance(invariant.check, type) else made_by_factories[name]
        verify_handlers(check, f"built-in {name}", registry._probe_events(invariant))
    assert [n for n in registry.BUILTIN if not isinstance(registry.get(n).check, type)] == list(made_by_factories)
