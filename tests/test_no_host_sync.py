"""``no_host_sync``: every synchronising operation caught at its line, in plain loops and Lightning fits, on CPU.

Most tests call ``watch()`` directly on code written to a file (so the site of
each event is a known ``path:line``); the report text and the plugin glue are
tested through ``pytester``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from step_check_helpers import batches, report_of, write_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytest_torchperf import InvariantViolation, UsageError, parse_options, watch  # noqa: E402
from pytest_torchperf.report import Report  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# -- what the user writes ------------------------------------------------------------------

#: One line each, run inside the step on ``out`` (the model's output), ``loss``, ``x``, ``y``.
SYNCS = {
    "item": ("v = loss.item()", "`.item()`"),
    "float": ("v = float(loss.detach())", "`float(tensor)`"),
    "int": ("v = int(loss > 0)", "`int(tensor)`"),
    "if": ("if loss > 0.5: pass", "`bool(tensor)`"),
    "assert": ("assert loss >= 0", "`bool(tensor)`"),
    "and": ("v = bool(out.sum()) and 1", "`bool(tensor)`"),
    "fstring": ('v = f"loss {loss:.3f}"', "an f-string or `format()` of a tensor"),
    "print": ("print(loss)", "`print`/`str`/`repr` of a tensor"),
    "str": ("v = str(out)", "`print`/`str`/`repr` of a tensor"),
    "tolist": ("v = out.tolist()", "`.tolist()`"),
    "numpy": ("v = out.detach().numpy()", "`.numpy()`"),
    "cpu": ("v = out.cpu()", "`.cpu()`"),
    "nonzero": ("v = torch.nonzero(out > 0)", "`nonzero`"),
    "nonzero_method": ("v = (out > 0).nonzero()", "`nonzero`"),
    "argwhere": ("v = torch.argwhere(out > 0)", "`argwhere`"),
    "where_one_arg": ("v = torch.where(out > 0)", "`torch.where(condition)` with one argument"),
    "masked_select": ("v = torch.masked_select(out, out > 0)", "`masked_select`"),
    "unique": ("v = torch.unique(y > 0)", "`unique`"),
    "unique_method": ("v = (y > 0).unique()", "`unique`"),
    "mask_index": ("v = out[out > 0]", "boolean-mask indexing `x[mask]`"),
    "mask_assign": ("v = out.detach().clone(); v[v.abs() >= 0] = out.detach().flatten()", "boolean-mask assignment"),
    "index": ("v = [1, 2, 3][(out > 0).sum() % 3]", "a tensor used as a Python int"),
    "range": ("v = list(range((out > 0).sum()))", "a tensor used as a Python int"),
    "bincount": ("v = torch.bincount((out > 0).long().flatten())", "`bincount`"),
    "one_hot": ("v = torch.nn.functional.one_hot((out > 0).long().flatten())", "`F.one_hot` without `num_classes`"),
    "repeat_interleave": ("v = x.repeat_interleave((out > 0).long().flatten(), dim=0)", "`repeat_interleave`"),
    "equal": ("v = torch.equal(out, out)", "`.equal()`"),
    "allclose": ("v = out.allclose(out)", "`.allclose()`"),
    "contains": ("v = 0.5 in out", "`value in tensor`"),
}

#: The right idioms: no sync, so the step passes.
CLEAN = [
    'self_log("loss_again", loss)',
    "v = torch.where(out > 0, out, torch.zeros_like(out))",
    "v = out * (out > 0)",
    "v = out.masked_fill(out < 0, 0.0)",
    "v = out.detach().clone(); v[v > 0] = 0.0",
    "v = torch.nn.functional.one_hot((out > 0).long().flatten(), num_classes=2)",
    "v = x.repeat_interleave(2, dim=0)",
    "v = out[:, 0]; v = out[0]; v = out[torch.arange(2, device=out.device)]",
    "v = out.shape[0] + len(out) + out.numel() + out.dim()",
    "v = loss.detach() + out.sum()",
    "v = torch.tensor(3.0).item()",  # built on the host: not a device sync
    "v = torch.arange(4).tolist() + torch.zeros(2).numpy().tolist()",
    "v = torch.ones(3)[torch.ones(3, dtype=torch.bool)]",  # a host tensor's mask
    "v = torch.tensor([1.0, 2.0]).cpu().numpy()",
    "v = out.to(torch.float64).sum(0)",
]

LOOP = """
import torch

def self_log(name, value):
    pass

def train(watch, model, batches, steps_seen=None, **options):
    with watch(**options) as run:
        for i, (x, y) in enumerate(batches):
            with run.step():
                out = model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                {line}  # HERE
                loss.backward()
    return run
"""

MODULE = """
import torch
import pytorch_lightning as pl

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.layer(x)
        loss = torch.nn.functional.mse_loss(out, y)
        self.log("loss", loss, prog_bar=True)
        self_log = self.log
        {line}  # HERE
        return loss

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)
"""




def fit(module: ModuleType, steps: int = 2, **options: Any) -> Report:
    trainer = pl.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_train_batches=steps,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's num_workers advice
        try:
            with watch(**options) as run:
                trainer.fit(
                    module.Model(), DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
                )
        except InvariantViolation as exc:
            return exc.report
    return run.report


@pytest.fixture(autouse=True)
def quiet_lightning() -> Any:
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def events(report: Report) -> list[dict[str, Any]]:
    return report["no_host_sync"].figures["events"]


# -- every operation, at its line ------------------------------------------------------------


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_is_caught_at_its_line_in_a_plain_loop(tmp_path: Path, name: str, capsys: Any) -> None:
    line, label = SYNCS[name]
    module, lineno = write_module(tmp_path, f"loop_{name}", LOOP.format(line=line))
    model = torch.nn.Linear(8, 1)
    report = report_of(module.train, watch, model, batches(3))
    check = report["no_host_sync"]
    assert check.status == "failed", check.summary
    (event,) = events(report)
    assert event["site"].endswith(f"loop_{name}.py:{lineno}")
    assert event["code"] == "user"
    assert event["label"].startswith(label)
    assert event["count"] == 3
    assert event["frequency"] == "1 per step over 3 steps"
    assert event["devices"] == ["cpu"]  # inferred: would synchronise on an accelerator
    assert check.summary == f"3 syncs at {event['site']}: 1 per step over 3 steps"
    (finding,) = check.findings
    assert finding.hint


@pytest.mark.parametrize("name", list(SYNCS))
def test_each_sync_is_caught_at_its_line_in_a_lightning_training_step(tmp_path: Path, name: str) -> None:
    line, label = SYNCS[name]
    module, lineno = write_module(tmp_path, f"module_{name}", MODULE.format(line=line))
    report = fit(module, steps=2)
    check = report["no_host_sync"]
    assert check.status == "failed", check.summary
    (event,) = events(report)  # self.log(..., prog_bar=True) beside it is not a sync of the step
    assert event["site"].endswith(f"module_{name}.py:{lineno}")
    assert event["function"] == "training_step"
    assert event["label"].startswith(label)
    assert event["frequency"] == "1 per step over 2 steps"


@pytest.mark.parametrize("line", CLEAN)
def test_the_right_idioms_pass_in_a_plain_loop(tmp_path: Path, line: str) -> None:
    module, _ = write_module(tmp_path, "clean_loop", LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no sync in your code over 2 steps"


def test_the_right_idioms_pass_in_a_lightning_step(tmp_path: Path) -> None:
    body = "; ".join(line.replace("self_log(", "self.log(") for line in CLEAN)
    module, _ = write_module(tmp_path, "clean_module", MODULE.format(line=body))
    report = fit(module, steps=3)
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no sync in your code over 3 steps"
    assert check.figures["host_tensor_reads"] >= 3 * 3  # .item()/.tolist()/.numpy() of host tensors


def test_syncs_outside_the_step_are_not_counted(tmp_path: Path) -> None:
    module, _ = write_module(
        tmp_path,
        "outside",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                losses = []
                for x, y in batches:
                    with run.step():
                        loss = torch.nn.functional.mse_loss(model(x), y)
                        losses.append(loss.detach())  # HERE
                    print(f"{loss.item():.3f}")
                total = torch.stack(losses).sum().item()
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    assert report["no_host_sync"].status == "passed"


def test_counts_per_step_and_steps_with_syncs(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "counts",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for i, (x, y) in enumerate(batches):
                    with run.step():
                        out = model(x)
                        for j in range(3):
                            v = out[j].item()  # HERE
                        if i % 2 == 0:
                            w = out.sum().item()
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(4))
    check = report["no_host_sync"]
    first, second = events(report)
    assert first["site"].endswith(f"counts.py:{lineno}")
    assert first["frequency"] == "3 per step over 4 steps"
    assert second["site"].endswith(f"counts.py:{lineno + 2}")
    assert second["frequency"] == "1 per step in 2 of 4 steps"
    assert check.count == 14
    assert check.summary == "14 syncs at 2 sites in your code over 4 steps"


EDGES = """
import torch

def read(t):
    return t.item()  # HERE

def train(watch, steps, marked, uneven=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(steps)]
    with watch() as run:
        for i, (x, y) in enumerate(data):
            with run.step() if marked else torch.enable_grad():
                loss = torch.nn.functional.mse_loss(model(x), y)
                read(loss)  # before backward: automatic steps begin at the first backward pass
                loss.backward()
                for _ in range(i % 3 if uneven else 3):
                    read(loss)
                opt.step()
                opt.zero_grad()
    return run
"""


@pytest.mark.parametrize("marked", [True, False], ids=["run.step", "automatic"])
def test_the_same_count_in_every_whole_step_reads_per_step_with_the_runs_edges_said(
    tmp_path: Path, marked: bool
) -> None:
    """4 reads in each of 40 iterations. Found at optimizer.step(), step 1 runs from the first backward pass to
    the second optimizer step (3 reads, then the next iteration's 4) and step 40 only after the last one: the
    count is 4 in every whole step, which reads "4 per step", not "159 times in 39 of 40 steps (4 to 7 per step)"."""
    module, lineno = write_module(tmp_path, f"edges_{marked}", EDGES)
    report = report_of(module.train, watch, 40, marked)
    check = report["no_host_sync"]
    (event,) = events(report)
    if marked:
        assert event["frequency"] == "4 per step over 40 steps"
        assert check.summary.endswith(": 4 per step over 40 steps")
    else:
        assert check.figures["steps"] == 40 and event["count"] == 159
        assert event["frequency"] == "4 per step over 40 steps (7 in the first, none in the last)"
        assert check.findings[0].title.endswith(": 4 per step over 40 steps (7 in the first, none in the last)")
    # Whole steps that truly differ keep their range.
    report = report_of(module.train, watch, 40, True, uneven=True)
    (event,) = events(report)
    assert event["frequency"] == "79 times over 40 steps (1 to 3 per step)"


def test_nested_operations_count_once(tmp_path: Path, capsys: Any) -> None:
    """print() reads the values with .item(); .cpu().numpy() is one copy: each line counts once."""
    module, lineno = write_module(
        tmp_path,
        "nested",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        out = model(x)
                        print(out.sum(), out)  # HERE
                        v = out.detach().cpu().numpy()
                        w = f"{out.sum():.2f}"
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    found = {(e["operation"], int(e["site"].rsplit(":", 1)[1])): e["count"] for e in events(report)}
    assert found == {("__repr__", lineno): 4, ("cpu", lineno + 1): 2, ("__format__", lineno + 2): 2}


def test_a_sync_inside_a_torch_function_is_the_callers(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "clip",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        torch.nn.functional.mse_loss(model(x), y).backward()
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    (event,) = events(report)
    assert event["site"].endswith(f"clip.py:{lineno}")
    assert event["operation"] == "__bool__"
    assert event["via"] == "clip_grad_norm_"
    assert "inside `clip_grad_norm_`" in report["no_host_sync"].findings[0].title


TORCH_SITES = """
import torch

def train(watch, model, batches, **call):
    layer = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 1,
                                        enable_nested_tensor=False)
    mask = torch.nn.Transformer.generate_square_subsequent_mask(4)
    with watch() as run:
        for x, y in batches:
            with run.step():
                if call:
                    out = layer(x.view(1, 4, 8), mask=mask, **call)  # HERE
                else:
                    # validation on (the default, until torch.compile's first use turns it off process-wide)
                    out = torch.distributions.Normal(model(x), 1.0, validate_args=True).log_prob(y)  # HERE
                out.sum().backward()
    return run
"""


@pytest.mark.parametrize(
    "call, where, hint",
    [
        ({"is_causal": None}, "transformer.py:", "pass `is_causal=True` with a causal mask"),
        ({}, "distribution.py:", "validate_args=False"),
    ],
)
def test_a_sync_torchs_own_code_makes_shows_its_torch_line_and_the_argument_that_avoids_it(
    tmp_path: Path, call: dict[str, Any], where: str, hint: str
) -> None:
    """torch's Transformer layers check a mask given without ``is_causal`` on the host, and torch.distributions
    validates on the host: the user's line is the site, torch's line is in the stack, the hint names the fix."""
    module, _ = write_module(tmp_path, "torch_sites", TORCH_SITES)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3), **call)
    check = report["no_host_sync"]
    assert check.status == "failed", "\n".join(check.render(True))
    finding = check.findings[0]
    assert hint in finding.hint, finding.hint
    text = "\n".join(check.render(False))
    assert where in text and "> " in text, text  # torch's own frame, shown without -v, beside the user's
    # the fix passes
    if call:
        passed = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3), is_causal=True)
        assert passed["no_host_sync"].status == "passed", passed["no_host_sync"].render(False)


def test_a_torch_warning_inside_a_wrapper_points_at_the_users_line(tmp_path: Path) -> None:
    """``torch.tensor(a_tensor)`` warns from C code inside the factory's wrapper: the warning names the user's line."""
    module, lineno = write_module(
        tmp_path,
        "warns",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        v = torch.tensor(x)  # HERE
                w = torch.tensor(x)
            return run
        """,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.train(watch, torch.nn.Linear(8, 1), batches(2))
    found = [(Path(w.filename).name, w.lineno) for w in caught if "copy construct" in str(w.message)]
    assert found == [("warns.py", lineno), ("warns.py", lineno), ("warns.py", lineno + 1)]


def _steps_with_a_state_built_before_the_watch(make_optimizer: Any) -> Any:
    """Three watched steps of ``make_optimizer(params)`` on a Linear(8, 1), its state built by one step before the
    watch.
    """
    model = torch.nn.Linear(8, 1)
    opt = make_optimizer(model.parameters())
    data = batches(3)
    x, y = data[0]
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()  # the state exists before the watch
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    with watch(scope="batch") as run:
        assert not _global_optimizer_pre_hooks  # found when a read is in question: no call every step
        for x, y in data:
            with run.step():
                opt.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
    return run.report["no_host_sync"]


def test_an_optimizer_state_built_before_the_watch_is_a_host_tensor() -> None:
    """Adam reads its CPU ``step`` counter with .item() per parameter: by design, not a device sync."""
    check = _steps_with_a_state_built_before_the_watch(torch.optim.Adam)
    assert check.status == "passed", check.summary
    assert check.figures["host_tensor_reads"] == 3 * 2  # one .item() per parameter per step
    assert check.figures["syncs"] == 0


def test_an_optimizer_of_your_own_with_its_state_built_before_the_watch_reads_host_counters() -> None:
    """The counters of any ``torch.optim.Optimizer`` subclass are host tensors, as torch's own are."""

    class Counted(torch.optim.Optimizer):
        def __init__(self, params: Any) -> None:
            super().__init__(params, {"lr": 0.01})

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            for group in self.param_groups:
                for p in group["params"]:
                    state = self.state[p]
                    if "step" not in state:
                        state["step"] = torch.tensor(0.0)
                    state["step"] += 1
                    p.add_(p.grad, alpha=-group["lr"] / state["step"].item())

    check = _steps_with_a_state_built_before_the_watch(Counted)
    assert check.status == "passed", check.summary
    assert check.figures["host_tensor_reads"] == 3 * 2
    assert check.figures["syncs"] == 0


def test_torch_compile_sees_through_the_wrappers() -> None:
    """A compiled function compiles to the same graphs inside and outside steps: no recompile, no graph break."""
    torch_dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))

    def forward(x: Any) -> Any:
        h = model(x).float()
        noise = torch.randn(4, 1, device=x.device)
        return (h + noise.to(x.device)).sum()

    def graphs(watched: bool) -> dict[str, Any]:
        torch_dynamo.reset()
        counters.clear()
        compiled = torch.compile(forward, backend="eager")
        x = torch.randn(4, 8)
        if watched:
            with watch() as run:
                for _ in range(3):
                    with run.step():
                        compiled(x)
                    compiled(x)  # out of scope: the same graph
            assert run.report["no_host_sync"].status == "passed"
        else:
            for _ in range(6):
                compiled(x)
        return {"graphs": dict(counters["stats"]), "breaks": sum(counters["graph_break"].values())}

    assert graphs(watched=True) == graphs(watched=False)


# -- scopes ------------------------------------------------------------------------------------

CALLBACK_MODULE = """
import torch
import pytorch_lightning as pl

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

class PrintLoss(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.last = outputs["loss"].item()  # HERE
"""


@pytest.mark.parametrize("scope, status", [("training_step", "passed"), ("batch", "failed")])
def test_scope_batch_catches_a_sync_in_a_user_callback(tmp_path: Path, scope: str, status: str) -> None:
    module, lineno = write_module(tmp_path, f"callback_{scope}", CALLBACK_MODULE)
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[module.PrintLoss()],
    )
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = report_of(lambda: _fit_in_watch(trainer, module.Model(), loader, scope=scope))
    check = report["no_host_sync"]
    assert check.status == status
    if status == "failed":
        (event,) = events(report)
        assert event["site"].endswith(f"callback_{scope}.py:{lineno}")
        assert event["function"] == "on_train_batch_end"
        assert event["frequency"] == "1 per step over 3 steps"


def _fit_in_watch(trainer: Any, model: Any, loader: Any, **options: Any) -> Any:
    with watch(**options) as run:
        trainer.fit(model, loader)
    return run


def test_scope_test_counts_the_whole_body(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "whole",
        """
        import torch

        def train(watch, model, batches):
            with watch(scope="test") as run:
                for x, y in batches:
                    with run.step():
                        loss = torch.nn.functional.mse_loss(model(x), y)
                    v = loss.item()  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    (event,) = events(report)
    assert event["site"].endswith(f"whole.py:{lineno}")
    assert event["frequency"] == "3 times outside training steps"


def test_no_step_observed_is_not_checked_rather_than_passed() -> None:
    with watch() as run:
        torch.ones(2).sum().item()
    check = run.report["no_host_sync"]
    assert check.status == "not checked"
    assert "no training step observed" in check.summary


def test_nested_runs_each_see_their_scope() -> None:
    model = torch.nn.Linear(8, 1)
    with pytest.raises(InvariantViolation) as outer_failure:
        with watch(scope="test", max_sync_rate=0) as outer:  # the one-off bool() would be a note otherwise
            before = model(torch.zeros(1, 8)).sum()
            bool(before)  # in the outer run's scope only
            with pytest.raises(InvariantViolation) as inner_failure:
                with watch() as inner:
                    for x, _ in batches(2):
                        with inner.step():
                            model(x).sum().item()
    assert inner_failure.value.report["no_host_sync"].count == 2
    assert outer_failure.value.report["no_host_sync"].count == 3
    assert inner.report is inner_failure.value.report and outer.report is outer_failure.value.report


# -- framework syncs, and the opt-in to fail on them -----------------------------------------

FRAMEWORK_MODULE = """
import torch
import pytorch_lightning as pl

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)  # HERE
        self.log("mean_y", y.mean(), on_step=True, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""


def _framework_fit(tmp_path: Path, name: str, **options: Any) -> Report:
    module, _ = write_module(tmp_path, name, FRAMEWORK_MODULE)
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=True, enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return report_of(lambda: _fit_in_watch(trainer, module.Model(), loader, **options))


def test_lightning_logging_with_prog_bar_passes_with_its_syncs_noted(tmp_path: Path, capsys: Any) -> None:
    report = _framework_fit(tmp_path, "framework_batch", scope="batch")
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    noted = [e for e in events(report) if e["code"] == "framework"]
    assert noted and check.figures["framework_syncs"] == sum(e["count"] for e in noted)
    assert {e["operation"] for e in noted} == {"item"}  # the progress bar reads the logged values
    assert check.summary.startswith("no sync in your code over 3 batches; ")
    assert "(noted)" in check.summary
    assert all(f.title.startswith("note: ") for f in check.findings)
    assert "fail_on_framework_syncs=True" in check.findings[0].facts[-1]


def test_fail_on_framework_syncs_turns_the_notes_into_failures(tmp_path: Path, capsys: Any) -> None:
    report = _framework_fit(tmp_path, "framework_strict", scope="batch", fail_on_framework_syncs=True)
    check = report["no_host_sync"]
    assert check.status == "failed"
    assert check.count == check.figures["framework_syncs"] > 0
    assert "failing because fail_on_framework_syncs=True" in check.findings[0].facts[-1]


# -- the allow-list ------------------------------------------------------------------------------

ALLOW_LOOP = """
import torch

def log_every(step, loss, every=2):
    if step % every == 0:
        return loss.item()

class Logger:
    def flush(self, out):
        return out.tolist()

def train(watch, model, batches, **options):
    logger = Logger()
    with watch(**options) as run:
        for i, (x, y) in enumerate(batches):
            with run.step():
                out = model(x)
                loss = torch.nn.functional.mse_loss(out, y)
                log_every(i, loss)
                logger.flush(out)
                v = float(loss)  # HERE
    return run
"""


@pytest.mark.parametrize(
    "allowed, left",
    [
        ([], {"item", "tolist", "__float__"}),
        (["log_every"], {"tolist", "__float__"}),
        (["Logger.flush", "log_every"], {"__float__"}),
        ("allow_site", {"item", "tolist"}),
        ("allow_file", set()),
        (["Other.flush"], {"item", "tolist", "__float__"}),
        (["train"], set()),  # a function covers everything it calls
    ],
)
def test_allowed_syncs_accept_known_syncs_by_site_or_function(tmp_path: Path, allowed: Any, left: set[str]) -> None:
    module, lineno = write_module(tmp_path, "allow_loop", ALLOW_LOOP)
    if allowed == "allow_site":
        allowed = [f"allow_loop.py:{lineno}"]
    elif allowed == "allow_file":
        allowed = [str(tmp_path / "allow_loop.py")]
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(4), allowed_syncs=allowed)
    check = report["no_host_sync"]
    failing = {e["operation"] for e in events(report) if not e["allowed_by"]}
    assert failing == left
    assert check.status == ("failed" if left else "passed")
    accepted = [e for e in events(report) if e["allowed_by"]]
    assert check.figures["allowed_syncs"] == sum(e["count"] for e in accepted)
    if not left:
        assert check.summary.endswith(f"; {check.figures['allowed_syncs']} allowed")


@pytest.mark.parametrize(
    "value, message",
    [
        (3, "allowed_syncs must be a list of strings"),
        ([3], "allowed_syncs entries must be strings"),
        (["train.py:0"], "allowed_syncs entry 'train.py:0' has line 0; lines start at 1"),
        (["not a name"], "allowed_syncs entry 'not a name' is not a site 'path/to/file.py:LINE'"),
        ([""], "allowed_syncs entry '' is not a site"),
    ],
)
def test_allowed_syncs_is_validated(value: Any, message: str) -> None:
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_options({"allowed_syncs": value}, where="torchperf.watch()")


def test_setting_arguments_are_not_invariants() -> None:
    options = parse_options({"allowed_syncs": "train.py:3", "fail_on_framework_syncs": True})
    assert options.allowed_syncs == ("train.py:3",)
    assert options.enabled_checks[:2] == ("no_host_sync", "on_device")
    assert "allowed_syncs" not in options.enabled_checks
    assert "fail_on_framework_syncs" not in parse_options({"fail_on_framework_syncs": True}).enabled_checks
    with pytest.raises(UsageError, match="fail_on_framework_syncs must be True or False, got 'yes'"):
        parse_options({"fail_on_framework_syncs": "yes"})
    with pytest.raises(UsageError, match=r"unknown argument 'allowed_sync' \(did you mean 'allowed_syncs'\?\)"):
        parse_options({"allowed_sync": ["x"]})


# -- the report, through pytest ----------------------------------------------------------------


def test_failure_report_names_the_site_the_line_the_count_and_the_fix(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_sync="""
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Chatty(TinyModule):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                self.seen = loss.item()
                return loss

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(Chatty(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_host_sync (8 syncs at test_sync.py:8: 1 per step over 8 steps)*",
            "*- torchperf: no_host_sync -*",
            "`.item()` in training_step: 1 per step over 8 steps",
            "  on this CPU-only run: would synchronise on an accelerator*",
            "  `.item()` (8x) at test_sync.py:8 in training_step [[]your code[]]",
            "      self.seen = loss.item()",
            "    stack (most recent call last; > marks your code):",
            "    > test_sync.py:13 in test_fit",
            "*> test_sync.py:8 in training_step",
            "  hint: keep the value on the device: pass the tensor itself to `self.log(...)`*",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED test_sync.py::test_fit - torchperf: 1 invariant broken: no_host_sync*"])


def test_plain_loop_through_the_fixture_and_the_summary_line(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_loop="""
        import torch

        def test_clean(torchperf):
            model = torch.nn.Linear(8, 1)
            with torchperf.watch() as run:
                for _ in range(3):
                    with run.step():
                        loss = model(torch.ones(2, 8)).sum()
                        loss.backward()

        def test_branch(torchperf):
            model = torch.nn.Linear(8, 1)
            with torchperf.watch() as run:
                for _ in range(3):
                    with run.step():
                        loss = model(torch.ones(2, 8)).sum()
                        if loss > 100:
                            break
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf summary*",
            "torchperf: 2 watched tests, broken invariants: no_host_sync in 1",
            "torchperf: held: no_host_sync in 1, *",
            "FAILED  test_loop.py::test_branch: no_host_sync failed (3 syncs at test_loop.py:17: 1 per step over 3 "
            "steps)",
        ]
    )
    result.stdout.no_fnmatch_line("PASSED  test_loop.py::test_clean*")  # a clean test adds nothing by default
    verbose = user_models.runpytest("-p", "no:warnings", "-v")
    verbose.stdout.fnmatch_lines(
        [
            "*torchperf summary*",
            "PASSED  test_loop.py::test_clean",
            "*no_host_sync: passed (no sync in your code over 3 steps)*",
            "FAILED  test_loop.py::test_branch",
            "*no_host_sync: failed (3 syncs at test_loop.py:17: 1 per step over 3 steps)*",
        ]
    )
    result.stdout.fnmatch_lines(["      if loss > 100:", "  hint: a Python `if`/`while`/`assert`*"])


def test_marker_arguments_are_validated_through_pytest(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.torchperf(allowed_syncs=["train.py:x"])
        def test_body():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pytest-torchperf: @pytest.mark.torchperf: allowed_syncs entry 'train.py:x' is not*"])


def test_torch_is_pristine_after_passed_failed_and_crashed_runs(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_isolation="""
        import pytest
        import torch
        import torch.nn.functional as F
        import torch.optim.optimizer as optimizer_module
        import warnings
        from pytest_torchperf.core import FLAGS

        def snapshot():
            return {
                "tensor": dict(vars(torch.Tensor)),
                "torch": {name: getattr(torch, name) for name in dir(torch) if not name.startswith("_")},
                "one_hot": F.one_hot,
                "optimizer_hooks": dict(optimizer_module._global_optimizer_pre_hooks),
                "listeners": list(FLAGS.listeners),
                "filters": list(warnings.filters),
                "showwarnmsg": warnings._showwarnmsg,
            }

        BEFORE = snapshot()
        ITEM = torch.Tensor.item

        def loop(run, body):
            model = torch.nn.Linear(2, 1)
            for _ in range(2):
                with run.step():
                    body(model(torch.ones(1, 2)).sum())

        def test_passes(torchperf):
            with torchperf.watch() as run:
                loop(run, lambda loss: loss.backward())

        def test_fails(torchperf):
            with torchperf.watch() as run:
                loop(run, lambda loss: loss.item())

        def test_crashes(torchperf):
            with torchperf.watch() as run:
                loop(run, lambda loss: loss.view(5))

        def test_everything_is_pristine():
            assert snapshot() == BEFORE
            assert torch.Tensor.item is ITEM
            assert "item" not in vars(torch.Tensor) and "__bool__" not in vars(torch.Tensor)
            assert not FLAGS.active and not FLAGS.in_scope
            from pytest_torchperf.engine import ENGINE
            assert ENGINE.probe("tensors").births == {}
        """
    )
    result = user_models.runpytest("-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*RuntimeError: shape '[[]5[]]' is invalid*"])


# -- CUDA: the real signal ----------------------------------------------------------------------


@cuda
def test_cuda_item_is_confirmed_by_the_sync_debug_mode() -> None:
    model = torch.nn.Linear(8, 1).cuda()
    before = torch.cuda.get_sync_debug_mode()
    with pytest.raises(InvariantViolation) as excinfo:
        with watch() as run:
            for _ in range(3):
                with run.step():
                    loss = model(torch.randn(4, 8, device="cuda")).sum()
                    loss.item()
                    assert torch.cuda.get_sync_debug_mode() == 1  # "warn", inside the step
            assert torch.cuda.get_sync_debug_mode() == before  # restored between steps
    assert torch.cuda.get_sync_debug_mode() == before
    (event,) = events(excinfo.value.report)
    assert event["devices"] == ["cuda:0"]
    assert event["cuda_confirmed"] == 3
    assert "confirmed 3x by torch.cuda.set_sync_debug_mode" in excinfo.value.report["no_host_sync"].findings[0].facts[0]


@cuda
def test_cuda_syncs_no_wrapper_sees_are_reported_at_their_line() -> None:
    x = torch.randn(64, device="cuda")
    with pytest.raises(InvariantViolation) as excinfo:
        with watch() as run:
            for _ in range(2):
                with run.step():
                    torch.cuda.synchronize()  # not seen by the debug mode: counted by its wrapper
                    x.to("cpu")  # a blocking copy: no wrapper counts it, the debug mode does
    ops = {e["operation"] for e in events(excinfo.value.report)}
    assert "synchronize" in ops
    assert "cuda_sync" in ops  # the blocking copy of .to("cpu"), seen by the debug mode only


@cuda
def test_cuda_host_tensors_and_cpu_results_are_not_syncs() -> None:
    x = torch.randn(64, device="cuda")
    with pytest.raises(InvariantViolation) as excinfo:
        with watch() as run:
            for _ in range(2):
                with run.step():
                    host = x.cpu()  # one sync
                    host.numpy(), host.tolist(), host.sum().item()  # host reads: not syncs
                    torch.tensor(1.0).item()
    (event,) = events(excinfo.value.report)
    assert event["operation"] == "cpu"


@cuda
def test_cuda_debug_mode_is_restored_after_a_crash() -> None:
    before = torch.cuda.get_sync_debug_mode()
    torch.zeros(1, device="cuda")
    with pytest.raises(RuntimeError):
        with watch() as run:
            with run.step():
                raise RuntimeError("boom")
    assert torch.cuda.get_sync_debug_mode() == before


def test_cuda_paths_are_skipped_without_cuda() -> None:
    """On this machine the CUDA wrappers are not installed at all (nothing to restore, nothing to pay)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    synchronize = torch.cuda.synchronize
    with watch() as run:
        assert torch.cuda.synchronize is synchronize
        with run.step():
            pass
    assert torch.cuda.synchronize is synchronize


def _indexing_is_routed() -> bool:
    """Whether ``tensor[i]`` goes straight to torch's C code now (``torch.Tensor``'s mapping slot holds
    ``TensorBase``'s function), not through a patched ``__getitem__``."""
    import ctypes

    from pytest_torchperf import _slots

    def subscript(cls: type) -> Any:
        return ctypes.c_void_p.from_address(
            _slots._table(cls, _slots._AS_MAPPING) + _slots.MP_SUBSCRIPT * _slots._PTR
        ).value

    return bool(subscript(torch.Tensor) == subscript(torch._C.TensorBase))


class _Samples(torch.utils.data.Dataset):  # type: ignore[misc]
    """Eight samples; each fetch notes whether indexing was routed, and a mask in it syncs a watched step."""

    def __init__(self, masked: bool = False, wait: Any = None) -> None:
        self.x = torch.randn(8, 4)
        self.masked, self.wait = masked, wait
        self.routed: list[bool] = []

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        if self.wait is not None:
            self.wait()
        self.routed.append(_indexing_is_routed())
        row = self.x[i]
        return row[row > 0].sum() if self.masked else row  # a mask index: a sync in a step


def test_a_dataloader_fetch_outside_the_steps_indexes_without_the_patch_and_a_step_gets_it_back() -> None:
    """Fetching samples outside the steps, ``tensor[i]`` skips the mask-indexing patch (nothing to count
    there); a fetch inside a step keeps it, so a mask in a dataset fetched in a step is still a sync; and a
    step beginning in another thread while a fetch runs gets the patch back at once."""
    import threading

    from pytest_torchperf import _slots

    tables = _slots.table_bytes(torch.Tensor)
    outside, inside = _Samples(masked=True), _Samples(masked=True)  # built before: not host tensors of the run
    with watch() as run:
        for (x,) in DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4):
            with run.step():
                x.sum()
        assert list(DataLoader(outside, batch_size=4)) and outside.routed == [True] * 8
        with run.step():
            batch = next(iter(DataLoader(inside, batch_size=4)))
        assert batch.shape == (4,) and inside.routed == [False] * 4
    masks = [e for e in events(run.report) if e["source"].startswith("return row[row > 0]")]
    assert [(e["count"], e["outside_steps"]) for e in masks] == [(4, 0)], masks  # the four fetched in the step
    assert _slots.table_bytes(torch.Tensor) == tables

    stepping, stepped = threading.Event(), threading.Event()
    first = [True]

    def hold() -> None:  # the first sample waits while another thread begins a step
        if first[0]:
            first[0] = False
            stepping.set()
            assert stepped.wait(10)

    held = _Samples(wait=hold)
    with watch() as run:
        def other_thread() -> None:
            stepping.wait(10)
            with run.step():
                stepped.set()

        thread = threading.Thread(target=other_thread)
        thread.start()
        list(DataLoader(held, batch_size=4))
        thread.join(10)
    assert held.routed[:4] == [False] * 4  # the patch back at once, for the rest of that fetch
    assert _slots.table_bytes(torch.Tensor) == tables
