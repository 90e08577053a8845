"""The engine owns what torchperf holds while runs watch; a start that fails leaves nothing behind."""

from __future__ import annotations

import pytest
import torch

from pytest_torchperf import watch
from pytest_torchperf.core import FLAGS, Run, active_runs
from pytest_torchperf.engine import ENGINE
from pytest_torchperf.extend import Check, CheckResult, Invariant, Probe, Status, register, unregister
from pytest_torchperf.watching import installed_probes

#: torch's own, read before any watch of this module.
ITEM = vars(torch._C.TensorBase)["item"]


class Explodes(Check):
    def __init__(self, run) -> None:  # type: ignore[no-untyped-def]
        super().__init__(run)
        raise RuntimeError("a third-party check that cannot be built")

    def result(self) -> CheckResult:  # pragma: no cover - never built
        return CheckResult("explodes", Status.PASSED, "", 0, [], {})


class Interrupted(Probe):
    name = "interrupted_probe"

    def install(self, patcher) -> None:  # type: ignore[no-untyped-def]
        patcher.setattr(torch.Tensor, "item", lambda self: 0)
        raise KeyboardInterrupt  # an interrupt while probes install: the whole start is undone


class Fine(Check):
    def result(self) -> CheckResult:
        return CheckResult(self.name, Status.PASSED, "ok", 0, [], {})


def _nothing_held() -> None:
    assert "item" not in vars(torch.Tensor) and torch.Tensor.item is ITEM
    assert active_runs() == [] and installed_probes() == () and ENGINE.base is None
    assert not FLAGS.active and not FLAGS.in_scope


@pytest.fixture
def exploding() -> object:
    register(Invariant(name="explodes", doc="its check cannot be built", check=Explodes, probes=("syncs",)))
    yield
    unregister("explodes")


def test_a_check_constructor_that_raises_leaves_no_patch(exploding: object) -> None:
    with pytest.raises(RuntimeError, match="cannot be built"):
        with watch(explodes=True):
            pass  # pragma: no cover - never entered
    _nothing_held()
    with watch(no_host_sync=True) as run:  # the engine works again afterwards
        assert torch.Tensor.item is not ITEM
        with run.step():
            torch.ones(2).sum()
    assert run.report is not None and run.report["no_host_sync"].status == Status.PASSED
    _nothing_held()


def test_a_failed_start_inside_a_watch_undoes_only_its_own_probes(exploding: object) -> None:
    with watch(no_iterator_reset=True, no_host_sync=False, on_device=False) as outer:
        before = installed_probes()
        assert "syncs" not in before
        with pytest.raises(RuntimeError, match="cannot be built"):
            with watch(explodes=True):
                pass  # pragma: no cover
        assert installed_probes() == before and active_runs() == [outer] and FLAGS.active
    _nothing_held()


def test_an_interrupt_while_a_probe_installs_undoes_the_whole_start() -> None:
    register(Invariant(name="interrupted", doc="its probe is interrupted", check=Fine, probes=(Interrupted(),)))
    try:
        with pytest.raises(KeyboardInterrupt):
            with watch(interrupted=True, no_host_sync=True):
                pass  # pragma: no cover
    finally:
        unregister("interrupted")
    _nothing_held()


FAILED_START = """
    import pytest
    import torch
    from pytest_torchperf.extend import Check, Invariant, register

    ITEM = vars(torch._C.TensorBase)["item"]

    class Explodes(Check):
        def __init__(self, run):
            super().__init__(run)
            raise RuntimeError("cannot be built")

    register(Invariant(name="explodes", doc="x", check=Explodes, probes=("syncs",)))

    @pytest.mark.torchperf(explodes=True)
    def test_marked():
        pass

    def test_later_unmarked():
        assert "item" not in vars(torch.Tensor) and torch.Tensor.item is ITEM
"""


@pytest.mark.slow
def test_a_later_unmarked_test_sees_torch_s_own_functions_after_a_failed_start(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_failed_start=FAILED_START)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*test_marked*RuntimeError: cannot be built*"])


class Polled(Check):
    """Counts the steps that began with its switch on; ``broken`` makes its read raise."""

    switch = {"on": False, "broken": False}

    def __init__(self, run: object) -> None:
        super().__init__(run)  # type: ignore[arg-type]
        self.hits = 0

    def step_polls(self):  # type: ignore[no-untyped-def]
        def read() -> bool:
            if self.switch["broken"]:
                raise RuntimeError("the switch cannot be read")
            return self.switch["on"]

        return ((read, self._hit),)

    def _hit(self) -> None:
        self.hits += 1

    def result(self) -> CheckResult:
        return CheckResult(self.name, "passed", f"on in {self.hits} steps")


@pytest.fixture
def polled() -> object:
    Polled.switch.update(on=False, broken=False)
    register(Invariant(name="polled", doc="a switch read every step", check=Polled))
    yield Polled.switch
    unregister("polled")


def test_step_polls_are_read_as_each_outer_step_begins(polled: dict[str, bool]) -> None:
    with watch(polled=True) as run:
        for i in range(6):
            polled["on"] = i % 2 == 1  # on as steps 2, 4 and 6 begin
            with run.step():
                with run.step():  # a nested step is not a new one
                    polled["on"] = True
        polled["on"] = True  # outside a step: not read
    check = run.report.checks["polled"]
    assert (check.status, check.summary) == ("passed", "on in 3 steps")


def test_a_poll_that_raises_makes_its_check_not_checked_and_the_steps_go_on(polled: dict[str, bool]) -> None:
    polled["broken"] = True
    with watch(polled=True, no_host_sync=True) as run:
        for _ in range(3):
            with run.step():
                torch.ones(2).sum()
    assert run.steps == 3
    check = run.report.checks["polled"]
    assert check.status == "not checked"
    assert "RuntimeError: the switch cannot be read" in check.summary
    assert run.report.checks["no_host_sync"].status == "passed"


class OtherPolled(Polled):
    switch = {"on": False, "broken": False}


def test_a_poll_that_raises_leaves_the_other_checks_polls_read_once_a_step(polled: dict[str, bool]) -> None:
    # The reads run in one pass; when one raises, they are read again one at a time: the other check's
    # switch still counts once a step, in marked steps as in a framework's.
    OtherPolled.switch.update(on=True, broken=False)
    register(Invariant(name="other_polled", doc="another switch read every step", check=OtherPolled))
    try:
        polled["broken"] = True
        with watch(polled=True, other_polled=True) as run:
            for _ in range(4):
                with run.step():
                    pass
            run.step_started()
            run.step_ended()
    finally:
        unregister("other_polled")
    assert run.report.checks["polled"].status == "not checked"
    other = run.report.checks["other_polled"]
    assert (other.status, other.summary) == ("passed", "on in 5 steps")


def test_steps_begun_by_a_framework_put_the_runs_in_scope_and_take_them_out(polled: dict[str, bool]) -> None:
    # ``step_started()`` / ``step_ended()`` are how Lightning's training_step and the automatic steps mark a
    # step: the scope of the one run watching is kept inline, that of several runs recomputed over them all.
    polled["on"] = True
    with watch(polled=True) as outer:
        outer.step_started()
        assert FLAGS.in_scope
        outer.step_started()  # nested: not a new step
        outer.step_ended()
        assert FLAGS.in_scope
        outer.step_ended()
        assert not FLAGS.in_scope
        with watch(polled=True) as inner:
            inner.step_started()
            assert FLAGS.in_scope
            inner.step_ended()
            assert not FLAGS.in_scope
            with outer.step():
                inner.step_started()
                inner.step_ended()
                assert FLAGS.in_scope  # the outer run's step is still open
            assert not FLAGS.in_scope
        outer.step_ended()  # one end too many changes nothing
        assert not FLAGS.in_scope and outer._step_depth == 0
    assert (outer.steps, inner.steps) == (2, 2)
    assert outer.report.checks["polled"].summary == "on in 2 steps"
    assert inner.report.checks["polled"].summary == "on in 2 steps"


def test_a_stopped_run_is_not_kept_alive_by_torchperf(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each watch's run (its checks, its report) is freed once the user drops it: a session of many marked
    tests does not pile them up. The loader-log invariants each ask the loaders probe for a log of their run."""
    import gc
    import weakref

    from fit_helpers import fit

    loader_logs = dict(no_iterator_reset=True, pin_memory=True, no_recompiles=True, max_data_wait=1.0)
    refs = []
    for kwargs in ({}, loader_logs):
        with watch(**kwargs) as run:
            fit(tmp_path, epochs=1)
        assert run.report is not None and run.report.passed
        refs.append(weakref.ref(run))
        with watch(**kwargs) as run:
            with run.step():
                torch.ones(2).sum()
        refs.append(weakref.ref(run))
        del run
    gc.collect()
    assert [ref() for ref in refs] == [None] * len(refs)


def _steps_over(run: Run, loader: torch.utils.data.DataLoader) -> None:  # type: ignore[type-arg]
    for (batch,) in loader:
        with run.step():
            batch.sum()


def test_the_loaders_probe_forgets_the_logs_of_runs_that_are_over_while_their_reports_live_on() -> None:
    """A marked test's report keeps its run for the session; the next watch's loaders probe keeps no log of it,
    and a finished run's check that read every batch leaves the batches unread by a later watch that does not."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
    kept = []
    for kwargs in (dict(pin_memory=True), {}, {}):  # pin_memory reads every batch; the defaults do not
        with watch(**kwargs) as run:
            probe = run.probe("loaders")
            assert list(probe.logs) == [run] and probe.batching == ("pin_memory" in kwargs)
            _steps_over(run, loader)
        kept.append(run)  # as a test's report keeps it
    assert all(run.report is not None and run.report.passed for run in kept)
    assert len(probe.logs) == 0 and not probe.batching


def test_the_batches_probe_forgets_the_runs_that_timed_every_batch_once_they_are_over() -> None:
    """max_data_wait's runs time every batch; a later watch without it times only each pass's first batch."""
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 2)), batch_size=4)
    kept = []
    for kwargs in (dict(max_data_wait=1.0), dict(max_data_wait=1.0), {}):
        with watch(**kwargs) as run:
            probe = run.probe("batches")
            assert list(probe.every_batch) == list(probe.listeners) == ([run] if kwargs else [])
            _steps_over(run, loader)
            assert probe.latest_pass(loader).every_batch == bool(kwargs)  # type: ignore[union-attr]
        kept.append(run)  # as a test's report keeps it
    assert all(run.report is not None and run.report.passed for run in kept)


def test_marked_steps_nested_inside_a_batch_or_alone_keep_the_scope_and_the_counts(polled: dict[str, bool]) -> None:
    polled["on"] = True
    with watch(polled=True) as run:
        with run.step():
            assert FLAGS.in_scope and run.in_step
            with run.step():  # nested: not a new step, nor a new batch
                assert FLAGS.in_scope
            assert FLAGS.in_scope and run.in_step  # the outer step is still open
        assert not FLAGS.in_scope and not run.in_step
        run.batch_started()  # a framework's batch open: the step inside it is no new batch
        with run.step():
            assert FLAGS.in_scope
        assert not FLAGS.in_scope and run._batch_depth == 0  # a step closes its batch
        with run.step():
            pass
    assert (run.steps, run.batches) == (3, 3)
    assert run.report.checks["polled"].summary == "on in 3 steps"  # read as each outer step began
    with watch(scope="test") as run:
        with run.step():
            pass
        assert FLAGS.in_scope  # scope="test": the whole block, steps or not
    assert not FLAGS.in_scope and run.steps == 1
    with watch() as outer:
        with watch() as inner:
            with outer.step():
                assert FLAGS.in_scope
            assert not FLAGS.in_scope  # two runs: the scope of both recomputed as the step ends
            with inner.step():
                pass
    assert (outer.steps, inner.steps) == (1, 1)


def test_a_fresh_engine_watches_a_loop_with_the_probe_instances_it_installed_and_undoes_them() -> None:
    from pytest_torchperf.core import Run
    from pytest_torchperf.engine import Engine
    from pytest_torchperf.options import Options

    engine = Engine()
    run = Run(Options(no_host_sync=True))
    original_item = torch.Tensor.item
    engine.start(run)
    try:
        assert run.probe("syncs") is engine.probe("syncs") is engine.probes["syncs"]
        assert "syncs" in engine.installed_probes()
        x = torch.ones(3)
        for _ in range(3):
            with run.step():
                (x * 2).sum().item()
    finally:
        engine.stop(run)
    engine.finish(run)
    assert run.report is not None
    assert run.report.steps == 3
    assert run.report.checks["no_host_sync"].status == "passed"  # a CPU tensor's .item() waits on no device
    assert engine.installed_probes() == () and engine.probes == {}
    assert torch.Tensor.item is original_item
    with pytest.raises(KeyError, match="'graphs' was not installed"):
        run.probe("graphs")


def _started(engine: object, **kwargs: object) -> object:
    """A run of ``kwargs`` started on ``engine`` (not the process's: a test's own)."""
    from pytest_torchperf.core import Run
    from pytest_torchperf.options import parse_options

    run = Run(parse_options(kwargs))
    engine.start(run)  # type: ignore[attr-defined]
    return run


def _host_reads(engine, run, reads: int) -> None:  # type: ignore[no-untyped-def]
    try:
        with run.step():
            for _ in range(reads):
                torch.ones(2).sum().item()  # a host tensor's read: counted by the syncs probe, no sync
    finally:
        engine.stop(run)
    engine.finish(run)


def test_two_engines_hold_distinct_probe_instances_and_the_state_of_one_stays_its_own() -> None:
    from pytest_torchperf.engine import Engine
    from pytest_torchperf.probes.syncs import SyncsProbe

    first, second = Engine(), Engine()
    names = ("syncs", "tensors", "loaders", "graphs", "ops")
    assert all(first.probe(name) is first.probe(name) for name in names)  # made once per engine
    assert all(first.probe(name) is not second.probe(name) for name in names)
    assert all(type(first.probe(name)) is type(second.probe(name)) for name in names)
    assert type(first.probe("syncs")) is SyncsProbe and first.installed_probes() == ()  # made, not installed
    mine, theirs = first.probe("syncs"), second.probe("syncs")
    run = _started(first, no_host_sync=True)
    try:
        assert run.probe("syncs") is mine and run.engine is first  # type: ignore[attr-defined]
        assert "syncs" in first.installed_probes() and second.installed_probes() == () and second.probes == {}
        with run.step():  # type: ignore[attr-defined]
            kept = [torch.zeros(2) for _ in range(3)]  # built in the step: the tensors probe records their birth
            for t in kept:
                t.sum().item()
            born = len(first.probe("tensors").births)
        assert (mine.host_reads, theirs.host_reads) == (3, 0)
        assert born > 0 and len(second.probe("tensors").births) == 0
    finally:
        first.stop(run)  # type: ignore[arg-type]
    first.finish(run)  # type: ignore[arg-type]
    assert run.report.checks["no_host_sync"].figures["host_tensor_reads"] == 3  # type: ignore[attr-defined]
    assert first.probe("syncs") is mine  # kept for the engine's next watch
    other = _started(second, no_host_sync=True)
    assert other.probe("syncs") is theirs and first.installed_probes() == ()  # type: ignore[attr-defined]
    _host_reads(second, other, 2)
    assert other.report.checks["no_host_sync"].figures["host_tensor_reads"] == 2  # type: ignore[attr-defined]
    assert mine.host_reads == 0 and torch.Tensor.item is ITEM  # the first engine's probe saw none of them


def test_a_probe_is_given_the_instances_of_the_probes_it_needs_by_its_own_engine() -> None:
    from pytest_torchperf.engine import Engine

    first, second = Engine(), Engine()
    syncs = first.probe("syncs")
    assert dict(syncs.needed) == {"tensors": first.probe("tensors")} and syncs.tensors is first.probe("tensors")
    assert second.probe("syncs").tensors is second.probe("tensors") is not first.probe("tensors")
    assert first.probe("graph_breaks").needed["recompiles"] is first.probe("recompiles")
    run = _started(second, no_host_sync=True, on_device=False)
    try:
        assert second.probes["syncs"].tensors is second.probes["tensors"] is run.probe("tensors")  # type: ignore[attr-defined]
        assert list(second.installed_probes()).index("tensors") < list(second.installed_probes()).index("syncs")
    finally:
        second.stop(run)  # type: ignore[arg-type]


def test_no_module_of_the_package_holds_a_probe_instance() -> None:
    """No ``PROBE = XProbe()`` (nor any ``... = SomethingProbe()``) at a module's top level: engines make probes."""
    import ast
    from pathlib import Path

    import pytest_torchperf

    root = Path(pytest_torchperf.__file__).resolve().parent
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8"), str(path)).body:
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            names = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            value = node.value
            made = isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", ""))
            if "PROBE" in names or (isinstance(made, str) and made.endswith("Probe")):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert len(list(root.rglob("probes/*.py"))) > 20 and found == []
