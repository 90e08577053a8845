"""Watching never changes the program: torch behaves the same during and after a watch.

The battery (``transparency_battery.py``) runs in a fresh interpreter; the
other tests cover what a battery of expressions cannot: torch's lazily built
tables first filled inside a watch, type slots, multi-process launches,
pickling a module mid-fit, and probes that fail.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import DATASET
from torch.utils.data import DataLoader, TensorDataset
from transparency_battery import BEHAVIOURS

from pytest_torchperf import InvariantViolation, Status, _slots, registry, watch
from pytest_torchperf.core import Run
from pytest_torchperf.report import Report

BATTERY = Path(__file__).with_name("transparency_battery.py")
CONDITIONS = ("in_step", "out_of_step", "after")


@pytest.fixture(scope="module")
def battery(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("battery") / "results.json"
    subprocess.run([sys.executable, str(BATTERY), str(out)], check=True, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(BEHAVIOURS))
def test_torch_behaves_the_same_watched_and_after_a_watch(battery: dict[str, Any], name: str) -> None:
    results = battery[name]
    for condition in CONDITIONS:
        assert results[condition] == results["unwatched"], f"{name} differs {condition.replace('_', ' ')}"


def test_the_battery_turns_every_invariant_on_over_forty_behaviours(battery: dict[str, Any]) -> None:
    assert len(BEHAVIOURS) >= 40
    assert battery["__invariants__"] == sorted(registry.invariants())
    # It really exercises what it claims: the reference values are real, and the errors are torch's own.
    assert battery["tensor_of_0d_tensors"]["unwatched"]["value"]["values"] == [3.0, 1.5]
    assert battery["len_0d"]["unwatched"]["raised"] == "TypeError"
    assert battery["subclass_torch_function"]["unwatched"]["value"] == [
        ["to", True], ["float", True], ["item", True], ["cpu", True], ["__format__", True]
    ]


def _python(code: str, timeout: int = 300) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_torch_tables_first_built_inside_a_watch_hold_torch_own_functions() -> None:
    """``torch.device`` as a context manager and dynamo cache tables of torch's functions on first use."""
    out = _python(
        """
        import torch
        from pytest_torchperf import InvariantViolation, watch

        def graph_targets(fn, x):
            graphs = []
            def backend(gm, inputs):
                graphs.append(sorted(str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
                return gm.forward
            torch.compile(fn, backend=backend)(x)
            return graphs

        def step(x):
            return (torch.zeros(x.shape) + x).float().sum()

        try:
            with watch() as run:
                with run.step():
                    with torch.device("meta"):
                        inside = str(torch.zeros(2).device)
                    first = graph_targets(step, torch.ones(3))  # dynamo is imported here, inside the watch
        except InvariantViolation:
            pass
        with torch.device("meta"):
            after = str(torch.zeros(2).device)
        from torch._dynamo import trace_rules
        assert torch.zeros in trace_rules.get_torch_obj_rule_map()
        assert torch.Tensor.item in trace_rules.get_tensor_method()
        assert torch.Tensor.float in trace_rules.get_tensor_method()
        print(inside, after, first == graph_targets(lambda x: (torch.zeros(x.shape) + x).float().sum(), torch.ones(3)))
        """
    )
    assert out.split() == ["meta", "meta", "True"]


def test_type_slots_of_tensor_classes_are_the_same_bytes_after_a_watch() -> None:
    class Before(torch.Tensor):
        pass

    classes = (torch.Tensor, torch.nn.Parameter, Before)
    snapshot = {cls: _slots.table_bytes(cls) for cls in classes}
    with pytest.raises(InvariantViolation):
        with watch() as run:
            with run.step():
                x = torch.arange(4.0)
                x[x > 1] = 0.0  # a patched __setitem__ in use
                assert x[torch.tensor([True, False, True, True])].tolist() == [0.0, 0.0, 0.0]

                class During(torch.Tensor):  # a subclass created while __getitem__ is patched
                    pass

                during = torch.tensor(2.0).as_subclass(During)
                assert torch.tensor([during, during]).tolist() == [2.0, 2.0]
    assert {cls: _slots.table_bytes(cls) for cls in classes} == snapshot
    assert _slots.table_bytes(During) == _slots.table_bytes(Before)
    assert torch.tensor([torch.tensor(1.0).as_subclass(During)]).tolist() == [1.0]


def test_the_slot_layout_check_passes_on_this_interpreter() -> None:
    assert _slots.supported() == ""


# -- multi-process launches ------------------------------------------------------------------------


@pytest.mark.slow
def test_a_ddp_spawn_fit_runs_under_the_marker(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_spawn="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            trainer = make_trainer(
                tmp_path, max_epochs=1, strategy="ddp_spawn", accelerator="cpu", devices=2, num_sanity_val_steps=0
            )
            trainer.fit(TinyModule(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest_subprocess("-p", "no:warnings", timeout=300)
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*PicklingError*")


def test_a_callback_can_deepcopy_pickle_and_save_the_module_mid_fit(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_copies="""
        import copy, io, pickle
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer, pl

        SEEN = {}

        def outcome(fn):
            try:
                fn()
                return "ok"
            except Exception as exc:
                return type(exc).__name__

        class Copier(pl.Callback):
            def __init__(self, key):
                self.key = key

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if batch_idx != 1:
                    return
                clone = copy.deepcopy(pl_module)
                with torch.no_grad():
                    clone.layer.weight.add_(100.0)
                buffer = io.BytesIO()
                torch.save(pl_module, buffer)
                buffer.seek(0)
                optimizer = trainer.optimizers[0]
                SEEN[self.key] = {
                    "copy_runs_copy": bool(clone.training_step(batch, 0) != pl_module.training_step(batch, 0)),
                    "pickled": type(pickle.loads(pickle.dumps(pl_module))).__name__,
                    "saved": type(torch.load(buffer, weights_only=False)).__name__,
                    "optimizer_copy": type(copy.deepcopy(optimizer)).__name__,
                    "optimizer_state": sorted(pickle.loads(pickle.dumps(optimizer.state_dict()))),
                    "pickle_trainer": outcome(lambda: pickle.dumps(trainer)),
                    "deepcopy_trainer": outcome(lambda: copy.deepcopy(trainer)),
                }

        def fit(tmp_path, key):
            make_trainer(tmp_path, max_epochs=1, callbacks=[Copier(key)]).fit(TinyModule(), make_loader(num_workers=0))

        def test_unwatched(tmp_path):
            fit(tmp_path, "unwatched")

        @pytest.mark.torchperf(no_host_sync=False)
        def test_watched(tmp_path):
            fit(tmp_path, "watched")

        def test_the_same():
            assert SEEN["watched"] == SEEN["unwatched"]
            assert SEEN["watched"]["copy_runs_copy"] is True
            assert (SEEN["watched"]["pickled"], SEEN["watched"]["saved"]) == ("TinyModule", "TinyModule")
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "-p", "no:randomly")
    result.assert_outcomes(passed=3)


@pytest.mark.slow
@pytest.mark.parametrize("context", ["spawn", "forkserver"])
def test_dataloader_workers_with_spawn_start_methods_run_under_the_marker(
    user_models: pytest.Pytester, context: str
) -> None:
    # Each spawned worker imports the dataset's module to unpickle it: a module with torch only (the
    # models' module imports Lightning, seconds of every worker's start-up).
    loaders = "import torch\nfrom torch.utils.data import DataLoader, Dataset\n\n\n" + DATASET + textwrap.dedent(
        """

        def make_loader(**kwargs):
            return DataLoader(RandomDataset(), batch_size=8, persistent_workers=True, **kwargs)
        """
    )
    user_models.makepyfile(
        spawn_loaders=loaders,
        test_workers=f"""
        import pytest
        import torch
        from spawn_loaders import make_loader

        def epochs(loader):
            return [[x.sum().item() for x, _ in loader] for _ in range(2)]

        def test_unwatched():
            torch.manual_seed(0)
            pytest.REFERENCE = epochs(make_loader(num_workers=1, multiprocessing_context="{context}"))

        @pytest.mark.torchperf(scope="test", no_host_sync=False)
        def test_watched(request):
            torch.manual_seed(0)
            assert epochs(make_loader(num_workers=1, multiprocessing_context="{context}")) == pytest.REFERENCE
        """
    )
    result = user_models.runpytest_subprocess("-p", "no:warnings", "-p", "no:randomly", "-v", timeout=300)
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*no_iterator_reset: passed (1 loader with workers, 1 worker pool started)*"])


# -- probes that fail ------------------------------------------------------------------------------


def _workload(run: Any = None) -> torch.Tensor:
    """A plain training loop touching every probe: factories, moves, syncs, loaders, zeroing, autocast."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    model = torch.nn.DataParallel(torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        for x, y in loader:
            with run.step() if run is not None else _nothing():
                with torch.autocast("cpu", enabled=False):
                    noise = torch.zeros(x.shape).to(x.device)
                    loss = F.mse_loss(model(x + noise), y)
                loss.item()
                torch.cuda.empty_cache()
                loss.backward()
                optimizer.step()
                for p in model.parameters():
                    p.grad.zero_()
                optimizer.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _break(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"injected fault in {name}")

    monkeypatch.setattr(owner, name, boom)


def _watched(fn: Callable[[Any], torch.Tensor], **kwargs: Any) -> tuple[torch.Tensor, Report]:
    report: Report
    try:
        with watch(**kwargs) as run:
            out = fn(run)
        report = run.report  # type: ignore[assignment]
    except InvariantViolation as exc:
        report = exc.report
    return out, report


def _probe_cases() -> list[Any]:
    from pytest_torchperf.probes import (
        autocast,
        cuda_cache,
        data_parallel,
        grads,
        graphs,
        iterators,
        loaders,
        optimizers,
        syncs,
        tensors,
    )

    return [
        pytest.param("tensors", tensors.TensorsProbe, "born", {"on_device": True}, id="tensors"),
        pytest.param("syncs", syncs.SyncsProbe, "send", {"no_host_sync": True}, id="syncs"),
        pytest.param("loaders", loaders.LoaderLog, "on_pass", {"min_workers": 1}, id="loaders"),
        pytest.param("iterators", iterators.IteratorsProbe, "_send", {"no_iterator_reset": True}, id="iterators"),
        pytest.param("optimizers", optimizers.OptimizersProbe, "stepped", {"grads_set_to_none": True}, id="optimizers"),
        pytest.param("grads", grads.GradsProbe, "_zeroed", {"grads_set_to_none": True}, id="grads"),
        pytest.param("autocast", autocast.AutocastProbe, "entered", {"mixed_precision": True}, id="autocast"),
        pytest.param("cuda_cache", cuda_cache.CudaCacheProbe, "called", {"no_empty_cache": True}, id="cuda_cache"),
        pytest.param("data_parallel", data_parallel.DataParallelProbe, "forwarded", {"no_data_parallel": True},
                     id="data_parallel"),
        pytest.param("graphs", graphs.GraphsProbe, "sample", {"no_graph_retention": True}, id="graphs"),
    ]


@pytest.mark.parametrize("probe, owner, method, kwargs", _probe_cases())
def test_a_probe_that_fails_leaves_the_training_untouched_and_says_so(
    monkeypatch: pytest.MonkeyPatch, probe: str, owner: Any, method: str, kwargs: dict[str, Any]
) -> None:
    reference = _workload()
    _break(monkeypatch, owner, method)
    weights, report = _watched(_workload, **kwargs)
    assert torch.equal(weights, reference)
    assert report.internal_errors[probe] == f"RuntimeError: injected fault in {method}"
    (name,) = kwargs
    check = report[name]
    assert check.status == Status.NOT_CHECKED
    assert check.summary == (
        f"torchperf internal error in probe {probe}: RuntimeError: injected fault in {method}; the check is not checked"
    )
    assert f"torchperf internal error in probe {probe}: RuntimeError: injected fault in {method}" in report.render()


def test_a_lightning_observer_that_fails_leaves_the_fit_untouched(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from fit_helpers import fit

    from pytest_torchperf.frameworks import lightning

    reference = fit(tmp_path / "a")
    _break(monkeypatch, lightning, "_attach_to_fit")
    weights, report = _watched(lambda run: fit(tmp_path / "b"))
    assert torch.equal(weights, reference)
    assert set(report.checks) == {
        "no_host_sync", "on_device", "no_iterator_reset", "no_data_parallel", "no_graph_breaks", "no_debug_modes"
    }
    assert all(
        c.status == Status.NOT_CHECKED and "internal error in probe lightning" in c.summary
        for c in report.checks.values()
    )


def test_a_check_that_fails_is_not_checked_and_the_others_still_judge(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_torchperf.invariants.no_host_sync import HostSyncCheck

    reference = _workload()
    _break(monkeypatch, HostSyncCheck, "on_sync")
    weights, report = _watched(_workload, on_device=True, no_host_sync=True)
    assert torch.equal(weights, reference)
    assert report["no_host_sync"].status == Status.NOT_CHECKED
    assert "torchperf internal error in check no_host_sync: RuntimeError: injected fault in on_sync" in (
        report["no_host_sync"].summary
    )
    assert report["on_device"].status == "failed"  # torch.zeros(x.shape).to(x.device), every step


def test_no_recompiles_is_not_checked_on_a_dynamo_without_the_hook_it_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    from pytest_torchperf.probes import recompiles

    monkeypatch.setattr(recompiles, "_REASONS", ("a_function_this_dynamo_does_not_have",))
    fn = torch.compile(lambda x: x * 2, backend="eager")
    with watch(no_recompiles=True) as run:
        fn(torch.ones(2))
    check = run.report["no_recompiles"]  # type: ignore[index]
    assert check.status == Status.NOT_CHECKED
    assert check.summary == "this torch version's dynamo has no recompilation hook torchperf knows"


def test_a_run_is_a_guest_its_probes_are_gone_after_it() -> None:
    from pytest_torchperf.core import FLAGS, active_runs
    from pytest_torchperf.watching import installed_probes

    with watch(**{name: True for name in ("grads_set_to_none", "no_recompiles", "no_empty_cache")}) as run:
        assert isinstance(run, Run) and set(installed_probes()) >= {"tensors", "syncs", "grads", "recompiles"}
    assert installed_probes() == () and active_runs() == [] and not FLAGS.active and not FLAGS.in_scope


@pytest.mark.parametrize("persistent", [True, False], ids=["persistent", "per-epoch"])
def test_a_watched_loops_loader_and_workers_are_freed_when_the_user_lets_go(persistent: bool) -> None:
    """Objects the user drops are freed at once, as unwatched: no frame or table of the plugin keeps them.

    Each epoch's StopIteration passes through the probes' wrappers; a frame of theirs holding the exception
    made a cycle that kept the iterator (and its worker processes) alive until the garbage collector ran,
    and a loader freed that way waits out the workers' 5 s join (its queues closed first).
    """
    import gc
    import weakref

    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    refs: list[weakref.ref[Any]] = []

    def loop() -> None:
        loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=persistent)
        for _ in range(2):
            for _batch in loader:
                pass
        refs.append(weakref.ref(loader))
        if loader._iterator is not None:
            refs.append(weakref.ref(loader._iterator))

    was_enabled = gc.isenabled()
    gc.disable()  # freed by reference counting alone, as the same loop unwatched is
    try:
        try:
            with watch():
                loop()
        except InvariantViolation:  # the per-epoch pools: no_iterator_reset fails, as it should
            assert not persistent
        assert [r() for r in refs] == [None] * len(refs)
    finally:
        if was_enabled:
            gc.enable()
