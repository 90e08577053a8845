"""``no_host_sync``'s sync-rate policy: a site that syncs on a period is a note, one that syncs in most steps fails.

Also the wording that depends on where the run is: plain-PyTorch hints outside
Lightning, summaries that fit ``scope="test"``, and framework syncs reported
at the framework's line.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from step_check_helpers import report_of, write_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytest_torchperf import UsageError, parse_options, watch  # noqa: E402
from pytest_torchperf.report import Report  # noqa: E402

LOOP = """
import torch

def train(watch, model, batches, **options):
    with watch(**options) as run:
        for i, (x, y) in enumerate(batches):
            with run.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if {condition}:
                    v = loss.item()  # HERE
    return run
"""


@pytest.fixture(autouse=True)
def quiet_lightning() -> Any:
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def loop(tmp_path: Path, condition: str, steps: int, **options: Any) -> tuple[Report, int]:
    name = "loop_" + "".join(c if c.isalnum() else "_" for c in condition)[:40] + f"_{steps}"
    module, lineno = write_module(tmp_path, name, LOOP.format(condition=condition))
    data = [(torch.randn(4, 8), torch.randn(4, 1))] * steps
    return report_of(module.train, watch, torch.nn.Linear(8, 1), data, **options), lineno


def event(report: Report) -> dict[str, Any]:
    (found,) = report["no_host_sync"].figures["events"]
    return found


def test_a_sync_every_10th_step_is_a_note_with_its_rate(tmp_path: Path) -> None:
    report, lineno = loop(tmp_path, "i % 10 == 0", 40)
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no sync in your code over 40 steps; 4 periodic syncs in your code (noted)"
    found = event(report)
    assert found["cadence"] == "periodic" and found["rate"] == 0.1
    (finding,) = check.findings
    assert finding.title == "note: `.item()` in train: periodic: 4 of 40 steps"
    # The share printed beside the limit is the one held against it, with the steps it counts; no raw share.
    assert finding.facts[1] == (
        "periodic: synced in 4 of 40 steps, the first of them free; the other 3: 0.07 of the steps, within "
        "max_sync_rate=0.1: a note, not a failure; max_sync_rate=0 fails on it"
    ), finding.facts
    assert not finding.hint
    assert check.figures["periodic_syncs"] == 4 and check.figures["syncs"] == 0


@pytest.mark.parametrize(
    "condition, steps, rate",
    [
        ("True", 20, 1.0),  # every step
        ("i % 2 == 0", 20, 0.5),  # every other step: half the cost of a per-step sync is still a bug
        ("i % 4 == 3", 40, 0.25),  # at each optimizer step under 4 steps of gradient accumulation
        ("i % 5 == 0", 40, 0.2),
    ],
)
def test_a_sync_in_a_large_share_of_the_steps_fails(tmp_path: Path, condition: str, steps: int, rate: float) -> None:
    report, lineno = loop(tmp_path, condition, steps)
    check = report["no_host_sync"]
    assert check.status == "failed", check.summary
    found = event(report)
    assert found["cadence"] is None and found["rate"] == rate
    facts = "\n".join(check.findings[0].facts)
    beyond = (round(rate * steps) - 1) / steps  # no DataLoader here: one epoch, its first sync free
    measured = f"rate {rate:.2f}" + (f"; {beyond:.2f} after its first step in each epoch" if rate < 1 else "")
    assert f"({measured}): more often than max_sync_rate=0.1 allows for a periodic sync" in facts
    assert check.findings[0].hint


@pytest.mark.parametrize(
    "condition, steps, status, title",
    [
        ("i % 10 == 0", 3, "passed", "once: 1 of 3 steps"),  # 3 steps cannot show a period: one sync is "once"
        ("i == 1", 2, "passed", "once: 1 of 2 steps"),
        ("True", 1, "failed", "1 per step over 1 step"),  # a sync in every observed step always fails
        ("i % 2 == 0", 3, "failed", "1 per step in 2 of 3 steps"),
        ("i % 10 == 0", 12, "passed", "periodic: 2 of 12 steps"),  # step 0 is free: 1 more in 12 steps
    ],
)
def test_short_runs_are_judged_by_what_they_show(
    tmp_path: Path, condition: str, steps: int, status: str, title: str
) -> None:
    report, _ = loop(tmp_path, condition, steps)
    check = report["no_host_sync"]
    assert check.status == status, check.render(False)
    assert check.findings[0].title.endswith(title), check.findings[0].title


@pytest.mark.parametrize("rate, status", [(0, "failed"), (0.05, "failed"), (0.1, "passed"), (0.5, "passed")])
def test_max_sync_rate_sets_the_limit(tmp_path: Path, rate: float, status: str) -> None:
    report, _ = loop(tmp_path, "i % 10 == 0", 40, max_sync_rate=rate)
    check = report["no_host_sync"]
    assert check.status == status, check.summary
    assert check.figures["max_sync_rate"] == rate


def test_max_sync_rate_zero_fails_even_a_single_sync(tmp_path: Path) -> None:
    report, _ = loop(tmp_path, "i == 3", 20, max_sync_rate=0)
    assert report["no_host_sync"].status == "failed"


SAMPLING = """
import torch

def sample(logits, tokens):
    out = []
    for i in range(tokens):
        out.append(int(logits[i % len(logits)].argmax()))  # HERE
    return out

def train(watch, steps, every, **options):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    with watch(**options) as run:
        for i in range(steps):
            with run.step():
                out = model(torch.randn(4, 8))
                out.sum().backward()
                if (i == 17) if every > steps else (i % every == every - 1):
                    sample(out.detach(), 513 if every > steps else 3)
    return run
"""


def test_a_burst_of_reads_in_one_sampling_call_is_one_off_not_periodic(tmp_path: Path) -> None:
    """513 `int(t)` reads in one call, in one step of 40: a one-off, not periodic (periodic is spread over steps)."""
    module, _ = write_module(tmp_path, "sampling", SAMPLING)
    report = report_of(module.train, watch, 40, 1000)
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no sync in your code over 40 steps; 513 one-off syncs in your code (noted)"
    (finding,) = check.findings
    assert finding.title == "note: `int(tensor)` in sample: once: 513 times in 1 of 40 steps"
    assert event(report)["cadence"] == "once"
    # The same call every 10th step is periodic, and says how many reads it made.
    report = report_of(module.train, watch, 40, 10)
    check = report["no_host_sync"]
    assert check.summary == "no sync in your code over 40 steps; 12 periodic syncs in your code (noted)"
    assert check.findings[0].title == "note: `int(tensor)` in sample: periodic: 12 times in 4 of 40 steps"


def test_a_sync_once_per_epoch_is_a_note(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "per_epoch",
        """
        import torch

        def train(watch, model, loader):
            with watch() as run:
                for epoch in range(3):
                    for i, (x, y) in enumerate(loader):
                        with run.step():
                            loss = torch.nn.functional.mse_loss(model(x), y)
                            if i == len(loader) - 1:
                                print(f"epoch {epoch}: {loss.item():.3f}")  # HERE
            return run
        """,
    )
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), loader)
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    assert event(report)["cadence"] == "once per epoch"
    assert check.findings[0].title == "note: `.item()` in train: once per epoch: 3 of 12 steps"


EPOCHS = """
import torch

def train(watch, model, loader, epochs, every):
    with watch() as run:
        for epoch in range(epochs):
            for batch_idx, (x, y) in enumerate(loader):
                with run.step():
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    if batch_idx % every == 0:
                        v = loss.item()  # HERE
    return run
"""


@pytest.mark.parametrize(
    "batches_per_epoch, epochs, every, status, detail",
    [
        # pytorch/examples' MNIST logs `if batch_idx % log_interval == 0` (10): the count restarts every epoch, so
        # 15 batches an epoch sync at batches 0 and 10 (2 of 15, 0.13), the first of each epoch free: 3 of 45
        (15, 3, 10, "passed", "periodic: 6 of 45 steps"),
        (25, 2, 10, "passed", "periodic: 6 of 50 steps"),
        # every 5th batch is twice as often: 3 of 15 an epoch, 2 of them beyond the free one (0.13 > 0.1)
        (15, 3, 5, "failed", "(rate 0.20; 0.13 after its first step in each epoch)"),
        # every other batch: 0.53, 0.47 beyond the free ones
        (15, 3, 2, "failed", "(rate 0.53; 0.47 after its first step in each epoch)"),
    ],
)
def test_a_period_that_restarts_every_epoch_gets_its_first_sync_of_each_epoch_free(
    tmp_path: Path, batches_per_epoch: int, epochs: int, every: int, status: str, detail: str
) -> None:
    module, _ = write_module(tmp_path, f"epochs_{batches_per_epoch}_{epochs}_{every}", EPOCHS)
    loader = DataLoader(
        TensorDataset(torch.randn(batches_per_epoch, 8), torch.randn(batches_per_epoch, 1)), batch_size=1
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), loader, epochs, every)
    check = report["no_host_sync"]
    assert check.status == status, check.render(False)
    text = check.findings[0].title + "\n" + "\n".join(check.findings[0].facts)
    assert detail in text, text


def test_two_epochs_free_first_syncs_are_counted_and_the_share_printed_is_the_one_judged(tmp_path: Path) -> None:
    """`batch_idx % 10 == 0` over 4 epochs of 12 batches: 8 of 48 steps (0.17), 4 of them first in their epoch;
    the note says so and prints 0.08 beside the limit, never 0.17 as though it met it."""
    module, _ = write_module(tmp_path, "epochs_12_4_10", EPOCHS)
    loader = DataLoader(TensorDataset(torch.randn(12, 8), torch.randn(12, 1)), batch_size=1)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), loader, 4, 10)
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    fact = check.findings[0].facts[1]
    assert fact.startswith(
        "periodic: synced in 8 of 48 steps, the first in each of 4 epochs free; the other 4: 0.08 of the steps, "
        "within max_sync_rate=0.1"
    ), fact
    assert "0.17" not in fact


VALIDATION = """
import torch

def train(watch, model, loader, val_loader, every):
    with watch() as run:
        for i, (x, y) in enumerate(loader):
            with run.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                loss.backward()
                if i % every == 0:
                    v = loss.item()  # HERE
            if i % 10 == 9:
                with torch.no_grad():  # a validation pass every 10 steps is no epoch
                    for vx, vy in val_loader:
                        model(vx)
    return run
"""


@pytest.mark.parametrize("every, status", [(5, "failed"), (10, "passed")])
def test_an_evaluation_pass_under_no_grad_does_not_begin_an_epoch(tmp_path: Path, every: int, status: str) -> None:
    """A sync every 5th step (0.2) fails even with a validation pass every 10 steps: counted as epochs, those
    passes made a first sync free in each 10 steps, and 4 of 40 steps read as periodic within 0.1."""
    module, _ = write_module(tmp_path, f"validation_{every}", VALIDATION)
    loader = DataLoader(TensorDataset(torch.randn(40, 8), torch.randn(40, 1)), batch_size=1)
    val_loader = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), loader, val_loader, every)
    check = report["no_host_sync"]
    assert check.status == status, check.render(False)
    if status == "failed":
        assert "(rate 0.20; 0.17 after its first step in each epoch)" in "\n".join(check.findings[0].facts)
    else:
        assert event(report)["cadence"] == "periodic"


def test_a_rate_that_rounds_to_the_limit_is_shown_with_the_digits_that_tell_them_apart() -> None:
    from pytest_torchperf.invariants._steps import rate_text

    assert rate_text(564 / 5628) == "0.10"
    assert rate_text(564 / 5628, 0.1) == "0.1002"
    assert rate_text(0.1, 0.1) == "0.10"
    assert rate_text(0.47, 0.1) == "0.47"


def test_per_step_syncs_in_short_epochs_still_fail(tmp_path: Path) -> None:
    """Once per epoch is never every step: a loader of one batch makes every step an epoch."""
    module, _ = write_module(
        tmp_path,
        "one_batch",
        """
        import torch

        def train(watch, model, loader):
            with watch() as run:
                for epoch in range(4):
                    for x, y in loader:
                        with run.step():
                            v = model(x).sum().item()  # HERE
            return run
        """,
    )
    loader = DataLoader(TensorDataset(torch.randn(4, 8), torch.randn(4, 1)), batch_size=4)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), loader)
    assert report["no_host_sync"].status == "failed"


def test_max_sync_rate_is_validated() -> None:
    for value in (1.5, -0.1, "0.1", True, float("nan")):
        with pytest.raises(UsageError, match=r"max_sync_rate must be a number from 0 to 1 \(the largest share"):
            parse_options({"max_sync_rate": value}, where="torchperf.watch()")
    assert parse_options({"max_sync_rate": 1}).max_sync_rate == 1.0


# -- a real Lightning fit -----------------------------------------------------------------------

MODULE = """
import torch
import pytorch_lightning as pl

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        if {condition}:
            self.last = loss.item()  # HERE
        return loss

    def on_train_epoch_end(self):
        self.epoch_loss = self.layer.weight.sum().item()  # once per epoch, outside the steps

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""


def fit(tmp_path: Path, name: str, condition: str, **options: Any) -> tuple[Report, int]:
    module, lineno = write_module(tmp_path, name, MODULE.format(condition=condition))
    trainer = pl.Trainer(
        max_epochs=2, limit_train_batches=20, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(torch.randn(80, 8), torch.randn(80, 1)), batch_size=4)

    def go() -> Any:
        with watch(**options) as run:
            trainer.fit(module.Model(), loader)
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return report_of(go), lineno


def test_lightning_logging_every_10_batches_is_a_note_and_every_batch_fails(tmp_path: Path) -> None:
    report, lineno = fit(tmp_path, "periodic_fit", "batch_idx % 10 == 0", scope="test")
    check = report["no_host_sync"]
    assert check.status == "passed", check.render(False)
    found = {e["function"]: e for e in check.figures["events"] if e["code"] == "user"}
    assert found["training_step"]["cadence"] == "periodic"
    assert found["training_step"]["steps_with_sync"] == 4 and found["training_step"]["rate"] == 0.1
    assert found["on_train_epoch_end"]["cadence"] == "once per epoch"
    assert check.summary.startswith(
        "no sync in your code in the whole test (40 steps); 4 periodic and 2 once-per-epoch syncs in your code"
    )

    report, lineno = fit(tmp_path, "every_fit", "True")
    check = report["no_host_sync"]
    assert check.status == "failed"
    assert "pass the tensor itself to `self.log(...)`" in check.findings[0].hint  # inside a Lightning call


def test_plain_loops_get_plain_pytorch_hints(tmp_path: Path) -> None:
    report, _ = loop(tmp_path, "True", 3)
    hint = report["no_host_sync"].findings[0].hint
    assert "self.log" not in hint
    assert "accumulate it with tensor ops (`total += loss.detach()`)" in hint
    assert "(that periodic sync is a note, not a failure, at max_sync_rate=0.1)" in hint


# -- scope="test": the wording, and framework syncs at the framework's line -----------------------------


def test_scope_test_without_steps_says_so() -> None:
    with watch(scope="test") as run:
        torch.ones(2).sum()
    assert run.report["no_host_sync"].summary == "no sync in your code in the whole test"
    assert run.report["on_device"].summary == "no host-built tensor copied in the whole test"


def test_framework_syncs_under_scope_test_are_at_the_frameworks_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_ckpt="""
        import pytest
        import torch
        import pytorch_lightning as pl
        from torch.utils.data import DataLoader, TensorDataset

        class Model(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(8, 1)

            def training_step(self, batch, batch_idx):
                x, y = batch
                return torch.nn.functional.mse_loss(self.layer(x), y)

            def validation_step(self, batch, batch_idx):
                x, y = batch
                self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        @pytest.mark.torchperf(scope="test")
        def test_fit(tmp_path):
            loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)
            checkpoint = pl.callbacks.ModelCheckpoint(
                dirpath=tmp_path, filename="{epoch}-{val_loss:.3f}", monitor="val_loss"
            )
            trainer = pl.Trainer(max_epochs=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                                 callbacks=[checkpoint], default_root_dir=tmp_path)
            trainer.fit(Model(), loader, loader)
        """
    )
    result = pytester.runpytest("-p", "no:warnings", "--torchperf-json=out.json", "-v")
    result.assert_outcomes(passed=1)
    doc = json.loads((pytester.path / "out.json").read_text())
    check = doc["tests"][0]["checks"]["no_host_sync"]
    assert check["summary"].startswith("no sync in your code in the whole test (8 steps); ")
    formatting = [f for f in check["findings"] if "_format_checkpoint_name" in f["title"]]
    assert formatting, [f["title"] for f in check["findings"]]
    for finding in check["findings"]:
        (site,) = finding["sites"]
        assert site["user_code"] is False, site
        assert site["site"].startswith(("pytorch_lightning/", "lightning_fabric/")), site
        assert any(frame.startswith(site["site"]) for frame in site["stack"])
        assert any(frame.startswith("pytorch_lightning/trainer/trainer.py") for frame in site["stack"])
