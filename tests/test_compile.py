"""torch.compile under watch: compiled code is unchanged by watching, and ``no_graph_breaks`` (eager backend, CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

import pytest
import torch
import torch._dynamo
from seed_tips_models import QUIET, dataset, pl, report_of, trainer
from torch.utils.data import DataLoader

from pytest_torchperf import watch
from pytest_torchperf.arguments import UsageError
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED


@pytest.fixture(autouse=True)
def fresh_dynamo() -> Iterator[None]:
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Counting:
    """A backend that counts the graphs dynamo hands it (and runs them as they are)."""

    def __init__(self) -> None:
        self.graphs: list[int] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
        self.graphs.append(len(gm.graph.nodes))
        return gm.forward


class Plain(pl.LightningModule):
    """A step dynamo compiles into one graph."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Reads(Plain):
    """A step that reads a Python number from a tensor: a graph break."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if loss.item() > 1e6:  # the break
            loss = loss * 0
        return loss


def _fit(tmp_path: Any, module: pl.LightningModule, backend: Counting, fullgraph: bool) -> None:
    loader = DataLoader(dataset(64), batch_size=8)
    compiled = torch.compile(module, backend=backend, fullgraph=fullgraph)
    trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, limit_val_batches=0).fit(compiled, loader)


@pytest.mark.slow
@pytest.mark.parametrize("fullgraph", [True, False])
def test_a_compiled_lightning_module_compiles_the_same_watched(tmp_path: Any, fullgraph: bool) -> None:
    unwatched = Counting()
    _fit(tmp_path, Plain(), unwatched, fullgraph)
    torch._dynamo.reset()
    watched = Counting()
    with watch(**QUIET, no_recompiles=True) as run:  # the default invariants and more probes
        _fit(tmp_path, Plain(), watched, fullgraph)
    assert watched.graphs == unwatched.graphs == [unwatched.graphs[0]]  # one graph, compiled once
    assert run.steps == 16  # the steps were still seen, each of them
    assert run.report.checks["no_recompiles"].figures["recompiles"] == 0
    assert run.report.checks["no_graph_breaks"].status == PASSED


@pytest.mark.slow
def test_a_compiled_lightning_step_with_item_fails_at_its_line(tmp_path: Any) -> None:
    unwatched = Counting()
    _fit(tmp_path, Reads(), unwatched, False)
    torch._dynamo.reset()
    watched = Counting()
    report = report_of(lambda run: _fit(tmp_path, Reads(), watched, False), no_host_sync=True)
    assert watched.graphs == unwatched.graphs  # the same graphs on both sides of the break
    check = report.checks["no_graph_breaks"]
    assert check.status == FAILED
    assert check.summary == "1 graph break in the compiled training step"
    (finding,) = check.findings
    line = Reads.training_step.__code__.co_firstlineno + 3
    assert finding.title == (
        f"graph break at tests/test_compile.py:{line}: Unsupported Tensor.item() call with capture_scalar_outputs=False"
    )
    assert finding.sites[0].frame.source == "if loss.item() > 1e6:  # the break"
    assert "keep the value a tensor" in finding.hint
    # The eager part of the step runs the read: no_host_sync sees it, at the same line.
    assert report.checks["no_host_sync"].status == FAILED


def _loop(step: Callable[..., torch.Tensor], model: torch.nn.Module, steps: int = 3) -> Callable[[Any], None]:
    def body(run: Any) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        for _ in range(steps):
            with run.step():
                optimizer.zero_grad()
                step(x, y).backward()
                optimizer.step()

    return body


def _helper_with_nonzero(t: torch.Tensor) -> torch.Tensor:
    return t[torch.nonzero(t > 0, as_tuple=True)].sum()


def test_breaks_in_a_compiled_function_the_step_calls_are_listed_with_reasons() -> None:
    model = torch.nn.Linear(8, 1)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = model(x)
        print("step")  # a builtin dynamo does not trace
        return torch.nn.functional.mse_loss(out, y) + 0 * _helper_with_nonzero(out)

    compiled = torch.compile(step, backend="eager")
    check = report_of(_loop(compiled, model))
    result = check.checks["no_graph_breaks"]
    assert result.status == FAILED, result.summary
    kinds = {f.title.split(": ", 1)[1] for f in result.findings}
    assert "Failed to trace builtin operator" in kinds
    assert "Dynamic shape operator" in kinds
    sources = {f.sites[0].frame.source for f in result.findings}
    assert 'print("step")  # a builtin dynamo does not trace' in sources
    assert "return t[torch.nonzero(t > 0, as_tuple=True)].sum()" in sources
    hints = {f.title.split(": ", 1)[1]: f.hint for f in result.findings}
    assert "torch.compiler.disable" in hints["Failed to trace builtin operator"]
    assert "depends on the tensor's values" in hints["Dynamic shape operator"]
    assert result.figures["graph_breaks"] == len(result.findings)


def test_a_clean_compiled_step_passes_and_max_graph_breaks_accepts_a_known_count() -> None:
    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(model, backend="eager")

    def clean(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(compiled(x), y)

    result = report_of(_loop(clean, model)).checks["no_graph_breaks"]
    assert result.status == PASSED, result.summary
    assert result.figures["compiles"] >= 1
    assert result.summary.endswith("no graph break in the training step")

    torch._dynamo.reset()

    def breaking(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * 0 if loss.item() > 1e6 else loss

    result = report_of(_loop(torch.compile(breaking, backend="eager"), model), max_graph_breaks=1).checks[
        "no_graph_breaks"
    ]
    assert result.status == PASSED, result.summary
    assert result.summary == "1 graph break, within max_graph_breaks=1"


def test_compiled_code_that_breaks_compiles_the_same_graphs_watched() -> None:
    model = torch.nn.Linear(8, 1)

    def breaking(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        return (loss * 0 if loss.item() > 1e6 else loss) * 2

    unwatched = Counting()
    step = torch.compile(breaking, backend=unwatched)
    for _ in range(3):
        step(torch.randn(8, 8), torch.randn(8, 1)).backward()
    torch._dynamo.reset()
    watched = Counting()
    report_of(_loop(torch.compile(breaking, backend=watched), model), no_recompiles=True)
    assert watched.graphs == unwatched.graphs and len(unwatched.graphs) == 3  # before the break, each branch after


def test_nothing_compiled_is_not_checked() -> None:
    model = torch.nn.Linear(8, 1)
    result = report_of(_loop(lambda x, y: torch.nn.functional.mse_loss(model(x), y), model)).checks[
        "no_graph_breaks"
    ]
    assert result.status == NOT_CHECKED
    assert result.summary == "nothing was compiled with torch.compile during the run"


def test_max_graph_breaks_is_validated() -> None:
    with pytest.raises(UsageError, match="max_graph_breaks"):
        with watch(max_graph_breaks=-1):
            pass


def test_torch_dynamo_reset_during_the_run_keeps_the_compiles_counted() -> None:
    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(model, backend="eager")

    def body(run: Any) -> None:
        torch._dynamo.reset()  # clears dynamo's callbacks, the probe's too
        _loop(lambda x, y: torch.nn.functional.mse_loss(compiled(x), y), model)(run)

    check = report_of(body, no_recompiles=True).checks["no_recompiles"]
    assert check.status == PASSED
    assert check.figures["compiles"] >= 1
    assert check.figures["dynamo_resets"] == 1
    assert check.summary.endswith("; torch._dynamo.reset() called once")


RAGGED = """
    import pytest
    import torch
    from torchperf_models import TinyModule, make_loader, make_trainer

    class Compiled(TinyModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.compile(self.layer, backend="eager")

    @pytest.mark.torchperf(no_recompiles=True)
    def test_fit(tmp_path):
        loader = make_loader(num_workers=0, n=19, drop_last=DROP_LAST)  # batches of 8, 8 and 3
        make_trainer(tmp_path, max_epochs=2, limit_val_batches=0).fit(Compiled(), loader)
"""


@pytest.mark.slow
def test_a_ragged_last_batch_recompiles_a_lightning_fit_and_drop_last_passes(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_fit=RAGGED.replace("DROP_LAST", "False"))
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_recompiles (1 recompile after warm-up)*",
            "*was compiled again 1 time after warm-up",
            "  recompiled in: epoch 0 (train)",
            "  a smaller batch: 3 rows where the compiled code expected 8 (the ragged last batch of an epoch*",
            "  guard that failed: tensor * size mismatch at index 0. expected 8, actual 3",
            "*",
            "  hint: drop the ragged last batch (DataLoader(..., drop_last=True)), or compile for changing*",
        ],
        consecutive=False,
    )
    user_models.makepyfile(test_fit=RAGGED.replace("DROP_LAST", "True"))
    user_models.runpytest("-p", "no:warnings").assert_outcomes(passed=1)


def test_each_break_is_a_baseline_observation_keyed_by_its_site() -> None:
    from pytest_torchperf.glue.baseline import observe

    model = torch.nn.Linear(8, 1)

    def breaking(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        return loss * 0 if loss.item() > 1e6 else loss  # the break

    report = report_of(_loop(torch.compile(breaking, backend="eager"), model))
    (observation,) = [o for o in observe(report) if o.invariant == "no_graph_breaks"]
    assert observation.file == "tests/test_compile.py"
    assert observation.function == "breaking"
    assert observation.source.startswith("return loss * 0 if loss.item() > 1e6 else loss")


FULLGRAPH = """
    import pytest
    import torch
    from torchperf_models import TinyModule, make_loader, make_trainer

    class Step(TinyModule):
        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.layer(x), y)

    @pytest.mark.torchperf
    def test_fit(tmp_path):
        module = torch.compile(Step(), backend="eager", fullgraph=True)
        make_trainer(tmp_path, max_epochs=2, limit_val_batches=0).fit(module, make_loader(num_workers=0))
"""


@pytest.mark.slow
def test_a_fullgraph_compiled_fit_passes_under_the_bare_marker(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_fit=FULLGRAPH)
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(passed=1)


def test_every_module_of_the_package_imported_by_a_run_is_marked_for_dynamo() -> None:
    # The modules are looked up by name (a run's start must not scan thousands of sys.modules entries):
    # the names listed from the package's folder are exactly its modules.
    import pkgutil
    import sys

    import pytest_torchperf
    from pytest_torchperf import dynamo_frames

    walked = {m.name for m in pkgutil.walk_packages(pytest_torchperf.__path__, "pytest_torchperf.")}
    assert set(dynamo_frames._package_modules() or ()) == walked | {"pytest_torchperf"}
    with watch():
        pass
    imported = {name for name in sys.modules if name.split(".")[0] == "pytest_torchperf"}
    assert imported <= dynamo_frames._DONE


class _Printing(torch.nn.Module):
    """A forward with a ``print``: dynamo breaks the graph there."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        print("forward")  # the break
        return out


def _bare_loop(model: torch.nn.Module, compiled: Callable[..., torch.Tensor]) -> Callable[[Any], None]:
    """A plain loop with no marked steps: steps are found at ``optimizer.step()``."""

    def body(run: Any) -> None:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(8, 8), torch.randn(8, 1)
        for _ in range(3):
            torch.nn.functional.mse_loss(compiled(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()

    return body


def test_compile_then_a_bare_loop_fails_at_the_break_the_first_call_compiled_before_the_first_step() -> None:
    model = _Printing()
    result = report_of(_bare_loop(model, torch.compile(model, backend="eager"))).checks["no_graph_breaks"]
    assert result.status == FAILED, result.summary
    (finding,) = result.findings
    assert finding.sites[0].frame.source == 'print("forward")  # the break'
    assert "Failed to trace builtin operator" in finding.title
    assert any("before step 1" in fact and "run in step 1" in fact for fact in finding.facts), finding.facts
    assert result.figures["graph_breaks_outside_steps"] == 0


def test_a_break_compiled_by_an_earlier_run_fails_a_run_that_reuses_the_compiled_code() -> None:
    first = _Printing()
    report_of(_bare_loop(first, torch.compile(first, backend="eager")))
    second = _Printing()  # a fresh instance of the same class: dynamo reuses the first one's compiled code
    result = report_of(_bare_loop(second, torch.compile(second, backend="eager"))).checks["no_graph_breaks"]
    assert result.status == FAILED, result.summary
    assert result.figures["compiles"] == 0 and result.figures["compiled_functions_reused"] == 1
    (finding,) = result.findings
    assert "Failed to trace builtin operator" in finding.title
    assert any("before this test was watched" in fact for fact in finding.facts), finding.facts


def test_a_break_compiled_while_nothing_watched_fails_with_the_line_and_dynamos_recorded_reason() -> None:
    first = _Printing()
    compiled = torch.compile(first, backend="eager")
    compiled(torch.randn(8, 8))  # compiled unwatched: torchperf saw nothing of it
    second = _Printing()
    result = report_of(_bare_loop(second, torch.compile(second, backend="eager"))).checks["no_graph_breaks"]
    assert result.status == FAILED, result.summary
    (finding,) = result.findings
    assert finding.sites[0].frame.source == 'print("forward")  # the break'
    assert "Failed to trace builtin operator" in finding.title  # from dynamo's compilation records


def test_clean_compiled_code_reused_from_an_earlier_run_passes() -> None:
    model = torch.nn.Linear(8, 1)
    compiled = torch.compile(model, backend="eager")
    compiled(torch.randn(8, 8))
    result = report_of(_bare_loop(model, compiled)).checks["no_graph_breaks"]
    assert result.status == PASSED, result.summary
    assert result.summary.startswith("compiled code reused from before the watch")


def test_a_compiled_module_called_in_two_watches_is_judged_in_each() -> None:
    """What a step's compiled functions hold is read once per watch: a second test calling the same compiled
    module, or a new one that took a freed one's id, is judged like the first, not "nothing was compiled"."""
    model = _Printing()
    compiled = torch.compile(model, backend="eager")
    for watch_number in (1, 2, 3):
        result = report_of(_bare_loop(model, compiled)).checks["no_graph_breaks"]
        assert result.status == FAILED, (watch_number, result.summary)
        (finding,) = result.findings
        assert finding.sites[0].frame.source == 'print("forward")  # the break'
