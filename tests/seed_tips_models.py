"""Small models, loaders and loops for the direct ``watch()`` tests of the seed article's tips.

The pytester tests use ``torchperf_models`` (tests/conftest.py); these are
imported by the test modules themselves, so a test can read ``run.report``.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the lightning package only
    import lightning.pytorch as pl

from pytest_torchperf import InvariantViolation, Report, watch


def _import_what_compiling_imports() -> None:
    """Compile once, at import: the first torch.compile imports dynamo's backends and inductor's caches.

    In-process pytester runs drop the modules imported during them, and those
    modules register themselves in torch once per process (see conftest.py);
    a test suite compiling inside pytester runs needs them imported before.
    """
    import torch._dynamo

    torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
    torch.compile(torch.nn.Linear(1, 1), backend="eager")(torch.ones(1, 1))  # patches nn.Module once
    torch._dynamo.reset()


_import_what_compiling_imports()

#: The default invariants that have nothing to do with these tests (they have their own).
QUIET = {"no_host_sync": False, "on_device": False, "no_iterator_reset": False}


def dataset(n: int = 36, width: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


def loader(n: int = 36, batch_size: int = 8, **kwargs: Any) -> DataLoader:
    """36 samples in batches of 8: four full batches and a last one of 4."""
    return DataLoader(dataset(n), batch_size=batch_size, **kwargs)


class Regressor(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x), y))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def trainer(tmp_path: Any, max_epochs: int = 2, **kwargs: Any) -> Any:
    kwargs.setdefault("num_sanity_val_steps", 1)
    return pl.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


def train(
    run: Any,
    model: torch.nn.Module,
    batches: Any,
    epochs: int = 2,
    zero: Optional[Callable[[torch.nn.Module, Any], None]] = None,
    forward: Optional[Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]] = None,
) -> torch.optim.Optimizer:
    """A plain loop, each step marked with ``run.step()``; ``zero(model, optimizer)`` clears the gradients."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for x, y in batches:
            with run.step():
                if zero is None:
                    optimizer.zero_grad()
                else:
                    zero(model, optimizer)
                out = forward(model, x) if forward is not None else model(x)
                torch.nn.functional.mse_loss(out, y).backward()
                optimizer.step()
    return optimizer


def report_of(body: Callable[[Any], None], **options: Any) -> Report:
    """Run ``body(run)`` under ``watch(**QUIET, **options)`` and return the report, broken or not."""
    try:
        with watch(**{**QUIET, **options}) as run:
            body(run)
    except InvariantViolation as exc:
        return exc.report
    assert run.report is not None
    return run.report
