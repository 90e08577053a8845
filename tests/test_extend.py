"""The plug-in API: one module, handlers and probes validated at registration, settings namespaced."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_torchperf import extend, registry
from pytest_torchperf.extend import (
    Argument,
    Check,
    CheckResult,
    Integer,
    Invariant,
    Status,
    UsageError,
    register,
    unregister,
)
from pytest_torchperf.options import parse_options

ROOT = Path(__file__).resolve().parent.parent


class Misspelt(Check):
    def on_step_ended(self) -> None:  # the event is on_step_end
        pass

    def result(self) -> CheckResult:  # pragma: no cover
        return CheckResult(self.name, Status.PASSED, "", 0, [], {})


class Budget(Check):
    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        super().__init__(run)
        self.budget = self.settings.budget  # the frozen settings object, in the constructor too

    def on_step_end(self) -> None:
        pass

    def result(self) -> CheckResult:
        return CheckResult(self.name, Status.PASSED, f"budget {self.budget}", 0, [], {"budget": self.budget})


def _budget(name: str, default: int = 1) -> Invariant:
    budget = Argument("budget", Integer(minimum=0), default, "b")
    return Invariant(name=name, doc="d", check=Budget, arguments=(budget,))


def test_an_unknown_handler_is_refused_at_registration_with_the_closest_event() -> None:
    expected = r"defines on_step_ended\(\), which is no event \(did you mean 'on_step_end'\?\)"
    with pytest.raises(UsageError, match=expected):
        register(Invariant(name="misspelt", doc="d", check=Misspelt))
    assert "misspelt" not in registry.invariants()


def test_an_unknown_probe_is_refused_at_registration_with_the_closest_probe() -> None:
    with pytest.raises(UsageError, match=r"needs probe 'sync', which does not exist \(did you mean 'syncs'\?\)"):
        register(Invariant(name="no_probe", doc="d", check=Budget, probes=("sync",)))


def test_a_probe_declares_the_events_it_sends() -> None:
    class Own(extend.Probe):
        name = "own_probe"
        events = {"on_own_thing": "(): something of its own"}

        def install(self, patcher: extend.Patcher) -> None:
            pass

    class Listens(Check):
        def on_own_thing(self) -> None:
            pass

        def result(self) -> CheckResult:  # pragma: no cover
            return CheckResult(self.name, Status.PASSED, "", 0, [], {})

    register(Invariant(name="listens", doc="d", check=Listens, probes=(Own(),)))
    unregister("listens")


def test_status_is_a_string_enum_written_as_its_value() -> None:
    assert Status.FAILED == "failed" and Status("not checked") is Status.NOT_CHECKED
    assert json.dumps({"s": Status.INCONCLUSIVE}) == '{"s": "inconclusive"}'
    assert f"{Status.PASSED}" == "passed" and str(Status.NOT_CHECKED) == "not checked"
    from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED

    assert (PASSED, FAILED, NOT_CHECKED) == ("passed", "failed", "not checked")
    result = CheckResult("x", Status.FAILED, "s")  # a plug-in's member is kept as the plain string
    assert type(result.status) is str and type(result.to_dict()["status"]) is str and result.failed
    assert all(type(s) is str for s in (PASSED, FAILED, NOT_CHECKED))  # what travels to xdist's controller


def test_two_plugins_declaring_one_setting_are_spelt_by_their_namespace() -> None:
    register(_budget("first_budget", 1))
    register(_budget("second_budget", 2))
    try:
        with pytest.raises(UsageError, match=r"'budget' is declared by more than one plug-in: spell it "
                                             r"first_budget__budget or second_budget__budget"):
            parse_options({"first_budget": True, "budget": 3})
        options = parse_options({"first_budget": True, "second_budget": True, "first_budget__budget": 3})
        assert options.settings("first_budget").budget == 3 and options.settings("second_budget").budget == 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            options.settings("first_budget").budget = 4
        with pytest.raises(UsageError, match=r"first_budget__budget must be an integer >= 0 or None, got -1"):
            parse_options({"first_budget__budget": -1})
        with pytest.raises(UsageError, match=r"unknown argument 'first_budget__budgets' \(did you mean"):
            parse_options({"first_budget__budgets": 1})
        with extend_watch(first_budget=True, second_budget=True, second_budget__budget=5) as run:
            pass
        assert run.report["first_budget"].figures == {"budget": 1}  # type: ignore[index]
        assert run.report["second_budget"].figures == {"budget": 5}  # type: ignore[index]
    finally:
        unregister("first_budget")
        unregister("second_budget")


def extend_watch(**kwargs):  # type: ignore[no-untyped-def]
    from pytest_torchperf import watch

    return watch(no_host_sync=False, on_device=False, no_iterator_reset=False, no_data_parallel=False, **kwargs)


def test_a_plugin_setting_named_like_a_built_in_one_leaves_the_plain_name_to_the_built_in() -> None:
    clash = Invariant(name="clash", doc="d", check=Budget,
                      arguments=(Argument("budget", Integer(minimum=0), 0, "b"),
                                 Argument("max_syncs_per_step", Integer(minimum=0), 0, "b"),
                                 Argument("min_workers", Integer(minimum=0), 0, "named like an invariant")))
    register(clash)
    try:
        assert parse_options({"max_syncs_per_step": 2}).max_syncs_per_step == 2  # the built-in's
        options = parse_options({"clash": True, "clash__max_syncs_per_step": 7, "clash__min_workers": 3})
        own = options.settings("clash")
        assert (own.max_syncs_per_step, own.min_workers, own.budget) == (7, 3, 0)
        assert options.max_syncs_per_step is None and options.min_workers is None
        assert parse_options({"no_host_sync__max_syncs_per_step": 1}).settings("no_host_sync").max_syncs_per_step == 1
    finally:
        unregister("clash")


def test_the_example_plugin_imports_only_the_extension_api() -> None:
    source = (ROOT / "examples" / "custom_invariant" / "acme_torchperf" / "forward.py").read_text()
    imports = [line for line in source.splitlines() if line.startswith(("from pytest_torchperf", "import pytest_t"))]
    assert imports and all(line.startswith("from pytest_torchperf.extend import") for line in imports)


def test_the_extension_api_never_imports_torch() -> None:
    code = "import sys, pytest_torchperf.extend; print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


PROBE_PLUGIN = """
    import torch.nn.functional as F

    from pytest_torchperf.extend import Check, CheckResult, Invariant, Probe, Status, notify, register, unregister


    class ReluCalls(Probe):
        '''Counts F.relu calls; sends on_relu inside steps. A class: each engine makes its own.'''

        name = "relu_calls"
        needs = ("tensors",)
        events = {"on_relu": "(): torch.nn.functional.relu was called"}

        def __init__(self):
            super().__init__()
            self.calls = 0

        def reset(self):
            super().reset()
            self.calls = 0

        def install(self, patcher):
            self.reset()
            probe = self

            def make(original):
                def relu(*args, **kwargs):
                    probe.calls += 1
                    notify("on_relu", in_scope=True)
                    return original(*args, **kwargs)
                return relu

            patcher.wrap(F, "relu", make)


    class NoRelu(Check):
        def __init__(self, run):
            super().__init__(run)
            self.probe = run.probe("relu_calls")
            self.own_tensors = self.probe.needed["tensors"] is run.probe("tensors") is run.engine.probe("tensors")
            self.in_steps = self.seen = 0

        def on_relu(self):
            self.in_steps += 1

        def on_run_end(self):
            self.seen = self.probe.calls

        def result(self):
            status = Status.FAILED if self.in_steps else Status.PASSED
            summary = f"{self.in_steps} relu calls in steps, {self.seen} in all, own tensors {self.own_tensors}"
            return CheckResult(self.name, status, summary, self.in_steps, [], {"relu": self.in_steps})


    class SiluCalls(Probe):
        '''The older API: the plug-in makes the instance and reads it.'''

        name = "silu_calls"

        def install(self, patcher):
            self.calls = 0
            probe = self

            def make(original):
                def silu(*args, **kwargs):
                    probe.calls += 1
                    return original(*args, **kwargs)
                return silu

            patcher.wrap(F, "silu", make)


    SILU = SiluCalls()


    class SiluSeen(Check):
        def on_run_end(self):
            self.seen = SILU.calls

        def result(self):
            return CheckResult(self.name, Status.PASSED, f"silu seen {self.seen}", 0, [], {})


    register(Invariant(name="no_relu", doc="no F.relu in a step", check=NoRelu, probes=(ReluCalls,)))
    register(Invariant(name="silu_seen", doc="counts F.silu", check=SiluSeen, probes=(SILU,)))


    def pytest_unconfigure(config):
        unregister("no_relu")
        unregister("silu_seen")
"""

PROBE_TESTS = """
    import torch
    import torch.nn.functional as F


    def test_relu_in_a_step(torchperf):
        with torchperf.watch(no_relu=True, silu_seen=True) as run:
            F.relu(torch.ones(2))  # outside the step: counted by the probe, no event
            with run.step():
                F.relu(torch.ones(2))


    def test_no_relu_in_a_step(torchperf):
        with torchperf.watch(no_relu=True, silu_seen=True) as run:
            with run.step():
                F.silu(F.silu(torch.ones(2)))
        assert run.report["no_relu"].summary == "0 relu calls in steps, 0 in all, own tensors True"
        assert run.report["silu_seen"].summary == "silu seen 2"
        assert F.relu.__module__ == "torch.nn.functional" and "relu_calls" not in run.engine.installed_probes()
"""


def test_a_third_party_probe_class_and_an_instance_work_end_to_end(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(PROBE_PLUGIN)
    pytester.makepyfile(test_probe_plugin=PROBE_TESTS)
    result = pytester.runpytest("-p", "no:randomly", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*no_relu*1 relu calls in steps, 2 in all, own tensors True*"])
    assert "no_relu" not in registry.invariants()


def test_a_plugin_probe_cannot_take_the_name_of_another_probe() -> None:
    class Impostor(extend.Probe):
        name = "syncs"

        def install(self, patcher: extend.Patcher) -> None:  # pragma: no cover - never installed
            pass

    class Quiet(Check):
        def result(self) -> CheckResult:  # pragma: no cover - never built
            return CheckResult(self.name, Status.PASSED, "", 0, [], {})

    with pytest.raises(UsageError, match=r"the probe name 'syncs' is already <class '.*SyncsProbe'>'s"):
        register(Invariant(name="impostor", doc="d", check=Quiet, probes=(Impostor,)))
    assert "impostor" not in registry.invariants() and registry.probe_class("syncs").__name__ == "SyncsProbe"
