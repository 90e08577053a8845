"""``no_graph_retention``: no autograd graph built in a training step is still reachable after the next step.

Plain loops are watched directly (``watch()``); Lightning fits run in this
process from modules written to ``tmp_path`` (so the report's lines are
known), and once through pytester under the marker.
"""

from __future__ import annotations

import contextlib
import gc
import json
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
import torch
from seed_tips_models import QUIET, trainer
from step_check_helpers import write_module

from pytest_torchperf import InvariantViolation, UsageError, watch
from pytest_torchperf.engine import ENGINE
from pytest_torchperf.extend import Check, Invariant, register, unregister
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED, CheckResult

NAME = "no_graph_retention"
STEPS = 12


def check_of(fn: Any, *args: Any) -> CheckResult:
    """Run ``fn(run, *args)`` under ``watch(no_graph_retention=True)`` (other defaults off); its verdict."""
    try:
        with watch(no_graph_retention=True, **QUIET) as run:
            fn(run, *args)
    except InvariantViolation as exc:
        return exc.report[NAME]
    assert run.report is not None
    return run.report[NAME]


# -- plain loops ------------------------------------------------------------------------------------

LOOPS = '''
import torch
import torchmetrics


def batches(n):
    torch.manual_seed(0)
    return [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(n)]


def model_and_optimizer():
    torch.manual_seed(0)
    trunk = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU())
    head, aux = torch.nn.Linear(16, 1), torch.nn.Linear(16, 1)
    params = [*trunk.parameters(), *head.parameters(), *aux.parameters()]
    return trunk, head, aux, torch.optim.SGD(params, lr=0.01)


def losses_appended(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    losses = []
    for x, y in batches(n):
        with run.step():
            loss = torch.nn.functional.mse_loss(head(trunk(x)), y)  # HERE losses_appended
            losses.append(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()


def running_sum(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    total = 0.0
    for x, y in batches(n):
        with run.step():
            loss = torch.nn.functional.mse_loss(head(trunk(x)), y)
            total = total + loss  # HERE running_sum
            opt.zero_grad()
            loss.backward()
            opt.step()


def outputs_collected(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    outputs = []
    for x, y in batches(n):
        with run.step():
            out = head(trunk(x))  # HERE outputs_collected
            outputs.append(out)
            loss = torch.nn.functional.mse_loss(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat(outputs).mean()


def auxiliary_output(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    aux_outputs = []
    for x, y in batches(n):
        with run.step():
            h = trunk(x)
            aux_outputs.append(aux(h))  # HERE auxiliary_output
            loss = torch.nn.functional.mse_loss(head(h), y)
            opt.zero_grad()
            loss.backward()
            opt.step()


def detached(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    losses, outputs, total = [], [], 0.0
    for x, y in batches(n):
        with run.step():
            out = head(trunk(x))
            loss = torch.nn.functional.mse_loss(out, y)
            losses.append(loss.detach())
            outputs.append(out.detach())
            total += loss.detach()
            opt.zero_grad()
            loss.backward()
            opt.step()


def item(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    total = 0.0
    for x, y in batches(n):
        with run.step():
            loss = torch.nn.functional.mse_loss(head(trunk(x)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        total += loss.item()  # outside the step


def metric(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    mean, mse = torchmetrics.MeanMetric(), torchmetrics.MeanSquaredError()
    for x, y in batches(n):
        with run.step():
            out = head(trunk(x))
            loss = torch.nn.functional.mse_loss(out, y)
            mean.update(loss)
            mse(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return mean.compute(), mse.compute()


def truncated_bptt(run, n):
    torch.manual_seed(0)
    cell, head = torch.nn.GRUCell(8, 16), torch.nn.Linear(16, 1)
    opt = torch.optim.SGD([*cell.parameters(), *head.parameters()], lr=0.01)
    hidden = None
    for x, y in batches(n):
        with run.step():
            hidden = cell(x, hidden)
            loss = torch.nn.functional.mse_loss(head(hidden), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            hidden = hidden.detach()


def retain_graph_within_a_step(run, n):
    trunk, head, aux, opt = model_and_optimizer()
    for x, y in batches(n):
        with run.step():
            h = trunk(x)
            first = torch.nn.functional.mse_loss(head(h), y)
            second = aux(h).abs().mean()
            opt.zero_grad()
            first.backward(retain_graph=True)
            second.backward()
            opt.step()


def accumulated_before_backward(run, n):
    """Gradient accumulation over 3 micro-steps, one backward: legal, the graph lives until its optimizer step."""
    trunk, head, aux, opt = model_and_optimizer()
    pending = 0.0
    for i, (x, y) in enumerate(batches(n)):
        with run.step():
            pending = pending + torch.nn.functional.mse_loss(head(trunk(x)), y)
            if i % 3 == 2:
                opt.zero_grad()
                pending.backward()
                opt.step()
                pending = 0.0
'''


@pytest.fixture(scope="module")
def loops(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, int]]:
    path = tmp_path_factory.mktemp("loops")
    module, _ = write_module(path, "retention_loops", LOOPS)
    lines = {}
    for i, text in enumerate((path / "retention_loops.py").read_text().splitlines(), 1):
        if "# HERE " in text:
            lines[text.split("# HERE ")[1].strip()] = i
    return module, lines


# The loop's locals die when its function returns, before the watch ends: the report is the last scan
# made on the way. Step 1's graph is seen alive when step 3 starts (step 2 has run); step 3 runs under the
# creation trace; scans when steps 5 and 10 start count what steps 1-3 and 1-8 left.
ONE_PER_STEP = "list of 8 tensors with autograd graphs, one per step (steps 1-8)"


@pytest.mark.parametrize(
    "pattern, holder, description",
    [
        ("losses_appended", "local 'losses' in losses_appended", ONE_PER_STEP),
        ("running_sum", "local 'total' in running_sum", "one graph spanning 8 steps (steps 1-8)"),
        ("outputs_collected", "local 'outputs' in outputs_collected", ONE_PER_STEP),
        ("auxiliary_output", "local 'aux_outputs' in auxiliary_output", ONE_PER_STEP),
    ],
)
def test_a_leak_in_a_plain_loop_fails_with_its_holder_line_and_growth(
    loops: tuple[Any, dict[str, int]], pattern: str, holder: str, description: str
) -> None:
    module, lines = loops
    check = check_of(getattr(module, pattern), STEPS)
    assert check.status == FAILED, check.summary
    assert check.summary == f"graphs of 8 steps kept by {holder}"
    finding = check.findings[0]
    assert finding.title == f"{holder}: {description}"
    (site,) = finding.sites
    assert site.frame is not None and site.frame.filename.endswith("retention_loops.py")
    assert site.frame.lineno == lines[pattern] and site.frame.function == pattern
    assert "first seen after step 2 ended: the graph built in step 1 was still alive" in finding.facts[-1]
    assert check.figures["steps_retained"] >= 1 and check.figures["scans"] >= 1
    assert check.figures["holders"][0] == holder
    assert check.figures["scanned_at_step"] == 9
    assert check.figures["retained_tensors_per_step"] == (round(1 / 8, 3) if pattern == "running_sum" else 1.0)


@pytest.mark.slow
def test_growth_counts_graph_nodes_and_the_saved_activations_a_leak_keeps(loops: tuple[Any, dict[str, int]]) -> None:
    module, _ = loops
    appended = check_of(module.losses_appended, STEPS)
    # mse_loss <- addmm <- t, relu <- addmm <- t: 6 nodes per step; backward freed their saved tensors.
    assert appended.figures["retained_nodes_per_step"] == 6
    assert appended.figures["retained_saved_bytes"] == 0
    assert appended.findings[0].facts[0] == (
        "growth per step: 1 tensor, 6 graph nodes, no saved activations (backward already freed them)"
    )
    assert "hint: put .detach()ed tensors in this list" in "\n".join(appended.render(False))
    aux = check_of(module.auxiliary_output, STEPS)
    # aux(h) was never part of a backward pass: its addmm still saves h (4 x 16 floats) each step.
    assert aux.figures["retained_saved_bytes_per_step"] == 4 * 16 * 4
    assert aux.findings[0].facts[0].endswith("256 B of saved activations")
    assert "never part of a backward pass" in aux.findings[0].hint
    total = check_of(module.running_sum, STEPS)
    assert "total += loss.detach()" in total.findings[0].hint


@pytest.mark.parametrize(
    "pattern",
    ["detached", "item", "metric", "truncated_bptt", "retain_graph_within_a_step", "accumulated_before_backward"],
)
def test_what_keeps_values_not_graphs_passes(loops: tuple[Any, dict[str, int]], pattern: str) -> None:
    module, _ = loops
    check = check_of(getattr(module, pattern), STEPS)
    assert check.status == PASSED, [f.title for f in check.findings]
    assert check.summary.startswith(f"no autograd graph outlived its step ({STEPS} steps, graphs of ")
    assert check.figures["steps_retained"] == 0 and check.figures["scans"] == 0
    assert check.figures["steps_tracked"] >= 1 and check.figures["steps_judged"] >= 1


def test_the_first_backward_pass_is_always_walked_then_the_cadence_adapts(loops: tuple[Any, dict[str, int]]) -> None:
    module, _ = loops
    check = check_of(module.detached, 200)
    figures = check.figures
    assert figures["backward_passes"] == 200
    assert 1 <= figures["backward_passes_sampled"] < 200
    assert figures["steps_tracked"] == figures["backward_passes_sampled"]


@pytest.mark.slow
def test_a_leak_that_starts_late_is_found() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    kept = []

    def body(run: Any) -> None:
        for i in range(400):
            with run.step():
                loss = model(torch.randn(2, 4)).pow(2).mean()
                if i >= 100:
                    kept.append(loss)
                opt.zero_grad()
                loss.backward()
                opt.step()

    check = check_of(body)
    assert check.status == FAILED
    assert check.figures["holders"] == ["local 'kept' in test_a_leak_that_starts_late_is_found"]


def test_a_holder_growing_every_step_is_named_before_one_growing_once_an_epoch() -> None:
    """A list of each step's loss, cleared at each epoch's end, and a list of each epoch's mean loss (one tensor
    an epoch, whose graph spans the epoch's steps): the per-step holder is the leak named first, though when
    scanned it holds 2 steps' graphs and the per-epoch one 16."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def body(run: Any) -> None:
        step_losses: list[Any] = []
        epoch_means: list[Any] = []
        for _epoch in range(3):
            for _ in range(8):
                with run.step():
                    loss = model(torch.randn(2, 4)).pow(2).mean()
                    step_losses.append(loss)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
            epoch_means.append(torch.stack(step_losses).mean())
            step_losses.clear()

    check = check_of(body)
    assert check.status == FAILED
    where = "body"
    assert check.figures["holders"] == [f"local 'step_losses' in {where}", f"local 'epoch_means' in {where}"]
    assert check.summary == f"graphs of 2 steps kept by local 'step_losses' in {where} (+1 more)"
    assert check.findings[0].title.startswith(f"local 'step_losses' in {where}: list of 2 tensors"), check.findings[0]
    assert "one per step" in check.findings[0].title


def test_not_checked_without_a_step_a_backward_pass_or_an_optimizer_step() -> None:
    model = torch.nn.Linear(4, 1)
    assert check_of(lambda run: model(torch.randn(2, 4))).status == NOT_CHECKED

    def forward_only(run: Any) -> None:
        for _ in range(3):
            with run.step():
                model(torch.randn(2, 4))

    no_backward = check_of(forward_only)
    assert no_backward.status == NOT_CHECKED and no_backward.summary == "no backward pass in the 3 steps seen"

    def one_backward(run: Any) -> None:
        for step in range(3):
            with run.step():
                loss = model(torch.randn(2, 4)).sum()
                if step == 0:
                    loss.backward()

    check = check_of(one_backward)
    assert check.status == NOT_CHECKED
    assert check.summary.startswith("no optimizer step and no second backward pass in the run")


@pytest.mark.parametrize("keep, status", [(True, FAILED), (False, PASSED)])
def test_a_loop_that_updates_the_parameters_by_hand_is_judged_at_the_next_backward_pass(
    keep: bool, status: str
) -> None:
    """pytorch/examples' word_language_model updates its parameters by hand (no optimizer): a step's graph is
    judged once the next step's backward pass has run."""
    model = torch.nn.Linear(4, 1)

    def by_hand(run: Any) -> None:
        kept = []
        for _ in range(6):
            with run.step():
                model.zero_grad()
                loss = model(torch.randn(2, 4)).sum()
                loss.backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(p.grad, alpha=-0.1)
                kept.append(loss if keep else loss.item())

    check = check_of(by_hand)
    assert check.status == status, check.summary
    if keep:
        assert "after a later backward pass had run" in "\n".join(check.findings[0].facts)


@pytest.mark.slow
def test_the_watch_leaves_torch_as_it_found_it(loops: tuple[Any, dict[str, int]]) -> None:
    module, _ = loops
    backward = torch.autograd._engine_run_backward
    check_of(module.losses_appended, STEPS)  # its creation trace switches anomaly mode on for one step
    assert torch.autograd._engine_run_backward is backward
    assert not torch.is_anomaly_enabled()
    graphs = ENGINE.probe("graphs")
    assert not graphs.tracing and graphs._hook is None
    from torch.optim.optimizer import _global_optimizer_post_hooks

    assert not _global_optimizer_post_hooks


@pytest.mark.slow
def test_the_users_own_anomaly_mode_is_kept(loops: tuple[Any, dict[str, int]]) -> None:
    module, lines = loops
    with torch.autograd.set_detect_anomaly(True, check_nan=True):
        check = check_of(module.losses_appended, STEPS)
        assert torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
    assert check.findings[0].sites[0].frame.lineno == lines["losses_appended"]
    assert not torch.is_anomaly_enabled()


def test_a_probe_failure_is_not_checked_and_the_loop_runs_on(
    loops: tuple[Any, dict[str, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    module, _ = loops

    def broken(outputs: Any) -> tuple:
        raise RuntimeError("boom")

    monkeypatch.setattr("pytest_torchperf.probes.graphs.roots_of", broken)
    hooks = dict(torch.nn.modules.module._global_forward_hooks)
    check = check_of(module.losses_appended, STEPS)
    assert check.status == NOT_CHECKED
    assert check.summary == (
        "torchperf internal error in probe graphs: RuntimeError: boom; the check is not checked"
    )
    # The module forward hook of the step that failed is gone with the probe, not left on every module call.
    assert torch.nn.modules.module._global_forward_hooks == hooks


@pytest.mark.slow
def test_a_graph_held_only_from_cpp_is_reported_without_a_holder() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    anchor = torch.zeros(1, requires_grad=True)
    hooks = []

    def body(run: Any) -> None:
        for _ in range(6):
            with run.step():
                loss = model(torch.randn(2, 4)).pow(2).mean()
                # the hook's closure keeps the loss (and its graph); the hook itself lives in C++
                hooks.append(anchor.register_hook(lambda grad, kept=loss * 1: grad))
                opt.zero_grad()
                loss.backward()
                opt.step()

    check = check_of(body)
    assert check.status == FAILED
    assert check.summary == "graphs of 5 steps kept by an unnamed holder"
    assert check.findings[0].title == (
        "held by an object torchperf could not name: 5 tensors with autograd graphs, one per step (steps 1-5)"
    )
    for handle in hooks:
        handle.remove()


# -- Lightning fits -------------------------------------------------------------------------------------

MODULES = '''
import torch
import torchmetrics

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl


class Base(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.aux_head = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.head(torch.relu(self.layer(x)))  # HERE forward

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class LossList(Base):
    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)  # HERE LossList
        self.losses.append(loss)
        return loss


class RunningTotal(Base):
    def __init__(self):
        super().__init__()
        self.total = 0.0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.total = self.total + loss  # HERE RunningTotal
        return loss


class EpochOutputs(Base):
    """Lightning 2's documented replacement of training_epoch_end, without the .detach()."""

    def __init__(self):
        super().__init__()
        self.training_step_outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x)  # HERE EpochOutputs
        self.training_step_outputs.append(preds)
        return torch.nn.functional.mse_loss(preds, y)

    def on_train_epoch_end(self):
        torch.cat(self.training_step_outputs).mean()
        self.training_step_outputs.clear()


class AuxiliaryOutput(Base):
    def __init__(self):
        super().__init__()
        self.aux_outputs = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        h = torch.relu(self.layer(x))
        self.aux_outputs.append(self.aux_head(h))  # HERE AuxiliaryOutput
        return torch.nn.functional.mse_loss(self.head(h), y)


class Clean(Base):
    def __init__(self):
        super().__init__()
        self.losses, self.training_step_outputs, self.total = [], [], 0.0
        self.mean = torchmetrics.MeanMetric()
        self.mse = torchmetrics.MeanSquaredError()

    def training_step(self, batch, batch_idx):
        x, y = batch
        preds = self(x)
        loss = torch.nn.functional.mse_loss(preds, y)
        self.losses.append(loss.detach())
        self.training_step_outputs.append(preds.detach())
        self.total += loss.detach()
        self.mean.update(loss)
        self.mse(preds, y)
        self.log("train_loss", loss, on_epoch=True)
        self.log("train_mse", self.mse, on_epoch=True)
        return {"loss": loss, "preds": preds}

    def on_train_epoch_end(self):
        torch.cat(self.training_step_outputs).mean()
        self.training_step_outputs.clear()


class TruncatedBPTT(Base):
    def __init__(self):
        super().__init__()
        self.cell = torch.nn.GRUCell(8, 16)
        self.hidden = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.cell(x, self.hidden)
        self.hidden = hidden.detach()
        return torch.nn.functional.mse_loss(self.head(hidden), y)


class ManualRetainGraph(Base):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        h = torch.relu(self.layer(x))
        first = torch.nn.functional.mse_loss(self.head(h), y)
        second = self.aux_head(h).abs().mean()
        opt.zero_grad()
        self.manual_backward(first, retain_graph=True)
        self.manual_backward(second)
        opt.step()
'''


@pytest.fixture(scope="module")
def modules(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, dict[str, int], Path]:
    path = tmp_path_factory.mktemp("modules")
    module, _ = write_module(path, "retention_modules", MODULES)
    lines = {}
    for i, text in enumerate((path / "retention_modules.py").read_text().splitlines(), 1):
        if "# HERE " in text:
            lines[text.split("# HERE ")[1].strip()] = i
    return module, lines, path


def fit(tmp_path: Path, model: Any, epochs: int = 2) -> CheckResult:
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 8, generator=generator), torch.randn(48, 1, generator=generator))
    loader = DataLoader(data, batch_size=8)  # 6 steps per epoch
    try:
        with watch(no_graph_retention=True, **QUIET) as run:
            trainer(tmp_path, max_epochs=epochs, num_sanity_val_steps=0).fit(model, loader)
    except InvariantViolation as exc:
        return exc.report[NAME]
    assert run.report is not None
    return run.report[NAME]


@pytest.mark.parametrize(
    "name, title",
    [
        ("LossList", "LossList.losses: list of 11 tensors with autograd graphs, one per step (steps 1-11)"),
        ("RunningTotal", "RunningTotal.total: one graph spanning 11 steps (steps 1-11)"),
        (
            "AuxiliaryOutput",
            "AuxiliaryOutput.aux_outputs: list of 11 tensors with autograd graphs, one per step (steps 1-11)",
        ),
        # the list is cleared at each epoch's end, so the fit's end finds it empty: the scan on the way saw it
        (
            "EpochOutputs",
            "EpochOutputs.training_step_outputs: list of 3 tensors with autograd graphs, one per step (steps 1-3)",
        ),
    ],
)
@pytest.mark.slow
def test_a_leak_in_a_lightning_fit_fails_with_its_holder_and_line(
    modules: tuple[Any, dict[str, int], Path], tmp_path: Path, name: str, title: str
) -> None:
    module, lines, _ = modules
    check = fit(tmp_path, getattr(module, name)())
    assert check.status == FAILED, check.summary
    finding = check.findings[0]
    assert finding.title == title
    (site,) = finding.sites
    assert site.frame is not None and site.frame.filename.endswith("retention_modules.py")
    if name == "EpochOutputs":  # built in forward, called from the step's line
        assert site.frame.lineno == lines["forward"]
        mine = [f for f in site.stack if f.filename == site.frame.filename]
        assert [(f.function, f.lineno) for f in mine] == [("training_step", lines[name]), ("forward", lines["forward"])]
    else:
        assert site.frame.lineno == lines[name]


@pytest.mark.parametrize("name", ["Clean", "TruncatedBPTT", "ManualRetainGraph"])
def test_a_clean_lightning_fit_passes(modules: tuple[Any, dict[str, int], Path], tmp_path: Path, name: str) -> None:
    module, _, _ = modules
    check = fit(tmp_path, getattr(module, name)())
    assert check.status == PASSED, [f.title for f in check.findings]
    assert check.figures["steps"] == 12 and check.figures["steps_judged"] >= 1
    assert check.figures["scans"] == 0


SUITE = '''
import pytest
import torch
from torchperf_models import TinyModule, make_loader, make_trainer


class KeepsLosses(TinyModule):
    def __init__(self):
        super().__init__()
        self.losses = []

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses.append(loss)
        return loss


@pytest.mark.torchperf(no_graph_retention=True)
def test_fit_leaks(tmp_path):
    make_trainer(tmp_path, max_epochs=3).fit(KeepsLosses(), make_loader(num_workers=0))


@pytest.mark.torchperf(no_graph_retention=True)
def test_fit_clean(tmp_path):
    make_trainer(tmp_path, max_epochs=3).fit(TinyModule(), make_loader(num_workers=0))


@pytest.mark.torchperf(no_graph_retention=True)
def test_loop_leaks(torchperf):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    outputs = []
    with torchperf.watch(no_graph_retention=True) as run:
        for _ in range(10):
            with run.step():
                out = model(torch.randn(4, 8))
                outputs.append(out)
                opt.zero_grad()
                out.pow(2).mean().backward()
                opt.step()
'''


@pytest.mark.slow
def test_the_marker_fails_a_leaking_fit_and_reports_figures(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_suite=SUITE)
    result = user_models.runpytest(
        "-p", "no:warnings", "--torchperf-json=out.json", "--junitxml=out.xml", "-k", "fit", "-v"
    )
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_graph_retention (graphs of 11 steps kept by KeepsLosses.losses)*",
            "*torchperf: no_graph_retention*",
            "KeepsLosses.losses: list of 11 tensors with autograd graphs, one per step (steps 1-11)",
            "  growth per step: 1 tensor, * graph nodes, no saved activations (backward already freed them)",
            "*retained tensor created at torchperf_models.py:* in training_step *",
            "  hint: put .detach()ed tensors in this list*",
            "PASSED  test_suite.py::test_fit_clean",
            "*no_graph_retention: passed (no autograd graph outlived its step (12 steps*",
        ],
        consecutive=False,
    )
    doc = json.loads((user_models.path / "out.json").read_text())
    tests = {t["nodeid"].split("::")[1]: t for t in doc["tests"]}
    leak = tests["test_fit_leaks"]["checks"][NAME]
    assert leak["status"] == FAILED and leak["count"] == 11
    assert leak["figures"]["holders"] == ["KeepsLosses.losses"]
    assert leak["figures"]["retained_tensors_per_step"] == 1.0
    assert leak["findings"][0]["sites"][0]["function"] == "training_step"
    assert tests["test_fit_clean"]["checks"][NAME]["status"] == PASSED
    root = ET.parse(user_models.path / "out.xml").getroot()
    props = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in root.iter("testcase")
    }
    assert props["test_fit_leaks"][f"torchperf.{NAME}.status"] == FAILED
    assert props["test_fit_leaks"][f"torchperf.{NAME}.retained_tensors"] == "11"
    assert props["test_fit_clean"][f"torchperf.{NAME}.steps_retained"] == "0"


@pytest.mark.slow
def test_a_local_of_the_test_is_named_while_it_is_alive(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_suite=SUITE)
    result = user_models.runpytest("-p", "no:warnings", "-k", "loop")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["local 'outputs' in test_loop_leaks: list of 9 tensors with autograd graphs, one per step (steps 1-9)"],
        consecutive=False,
    )


# -- arguments -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"no_graph_retention": 1}, "no_graph_retention must be True or False, got 1 (int)"),
        ({"no_graph_retention": "yes"}, "no_graph_retention must be True or False, got 'yes' (str)"),
        ({"no_graph_retentoin": True}, "(did you mean 'no_graph_retention'?)"),
    ],
)
def test_bad_arguments_name_themselves(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)").replace("?", r"\?")):
        with watch(**kwargs):
            pass


class _Preempted(Check):
    """Receives the sampled backward passes; the first one waits as if the process had lost its core (or, with
    ``collect``, sets off a full garbage collection, as an allocation of a check's may)."""

    waited = False
    collect = False

    def on_backward_sample(self, roots: Any) -> None:
        if not _Preempted.waited:
            _Preempted.waited = True
            if _Preempted.collect:
                gc.collect()  # CPU time, 0.2-0.3 s with torch loaded, none of it the walk's
            else:
                time.sleep(0.05)  # wall time passes, this thread's CPU time does not

    def result(self) -> CheckResult:
        return CheckResult(self.name, "passed", "")


def test_a_sampled_pass_preempted_for_a_while_does_not_stop_the_sampling() -> None:
    """The cadence counts a walk's cost in CPU time: counted in wall time, a walk that waited 50 ms for a core
    put the next one 10 s away, past the whole run."""
    _Preempted.waited = False
    register(Invariant(name="preempted_walks", doc="x", check=_Preempted, probes=("graphs",)))
    try:
        model = torch.nn.Linear(4, 1)
        with watch(preempted_walks=True, **QUIET) as run:
            deadline = time.perf_counter() + 0.3
            while time.perf_counter() < deadline:  # 0.3 s of steps: a walk of a few microseconds is due often
                with run.step():
                    model(torch.randn(2, 4)).pow(2).mean().backward()
            samples = run.probe("graphs").samples
    finally:
        unregister("preempted_walks")
    assert _Preempted.waited and samples >= 3


def test_a_collection_in_a_sampled_pass_does_not_stop_the_sampling() -> None:
    """A garbage collection set off in a walk is left out of its cost: counted, a full one (180-260 ms in a
    process with torch and Lightning) put the next walk 40-50 s away."""
    _Preempted.waited, _Preempted.collect = False, True
    register(Invariant(name="preempted_walks", doc="x", check=_Preempted, probes=("graphs",)))
    try:
        model = torch.nn.Linear(4, 1)
        with watch(preempted_walks=True, **QUIET) as run:
            with run.step():  # its walk collects
                model(torch.randn(2, 4)).pow(2).mean().backward()
            deadline = time.perf_counter() + 0.3
            while time.perf_counter() < deadline:
                with run.step():
                    model(torch.randn(2, 4)).pow(2).mean().backward()
            samples, collected = run.probe("graphs").samples, run.probe("graphs").gc_cpu
    finally:
        _Preempted.collect = False
        unregister("preempted_walks")
    assert _Preempted.waited and collected > 0 and samples >= 3


def test_a_module_output_callback_preempted_for_a_while_does_not_stop_the_sampling() -> None:
    """The armed module output callbacks' time is bounded by the thread's CPU time since they were armed:
    counted whole, one that lost its core for 50 ms (as on a busy CI machine) put the next sampled pass 10 s
    away."""
    waited: list[bool] = []

    def preempted(output: Any) -> None:
        if not waited:
            waited.append(True)
            time.sleep(0.05)  # wall time passes, this thread's CPU time does not

    _Preempted.waited = True  # its walks do not wait: only the module output callback does
    register(Invariant(name="preempted_walks", doc="x", check=_Preempted, probes=("graphs",)))
    try:
        model = torch.nn.Linear(4, 1)
        with watch(preempted_walks=True, **QUIET) as run:
            run.probe("graphs").arm_forward(preempted)  # for the first step, as a check arms it for a sampled step
            try:
                with run.step():
                    model(torch.randn(2, 4)).pow(2).mean().backward()
            finally:
                run.probe("graphs").disarm_forward(preempted)
            deadline = time.perf_counter() + 0.3
            while time.perf_counter() < deadline:
                with run.step():
                    model(torch.randn(2, 4)).pow(2).mean().backward()
            samples = run.probe("graphs").samples
    finally:
        unregister("preempted_walks")
    assert waited and samples >= 3


class _TwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def test_the_forward_hook_is_invisible_to_torch_compile_same_graphs_no_warning() -> None:
    """The retention check's global forward hook is out of torch's hooks while dynamo compiles."""
    import warnings

    import torch._dynamo

    from pytest_torchperf import InvariantViolation, watch

    def fit(backend: Any, run: Any = None) -> None:
        model = _TwoLayers()
        compiled = torch.compile(model, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        for _ in range(4):
            with run.step() if run is not None else contextlib.nullcontext():
                torch.nn.functional.mse_loss(compiled(torch.randn(8, 8)), torch.randn(8, 1)).backward()
                optimizer.step()
                optimizer.zero_grad()

    def counting() -> tuple[list[int], Any]:
        graphs: list[int] = []

        def backend(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
            graphs.append(len(gm.graph.nodes))
            return gm.forward

        return graphs, backend

    torch._dynamo.reset()
    unwatched, backend = counting()
    fit(backend)
    torch._dynamo.reset()
    watched, backend = counting()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            try:
                with watch(no_graph_retention=True, no_recompiles=True, grads_set_to_none=True) as run:
                    fit(backend, run)
                report = run.report
            except InvariantViolation as exc:
                report = exc.report
    finally:
        torch._dynamo.reset()
    assert watched == unwatched and len(unwatched) == 1
    assert report is not None
    assert report.checks["no_graph_breaks"].status == "passed", [
        f.title for f in report.checks["no_graph_breaks"].findings
    ]
    assert report.checks["no_recompiles"].figures["compiles"] == 1
    assert report.checks["no_graph_retention"].status == "passed", report.checks["no_graph_retention"].summary
    from torch.nn.modules.module import _global_forward_hooks

    assert not _global_forward_hooks
