"""DataLoader worker pools that get rebuilt every epoch, and their fixes.

Each ``*_buggy`` test fails with a torchperf report; its ``*_fixed`` twin passes.
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as pl


def dataset(n=128, width=16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Regressor(pl.LightningModule):
    def __init__(self, width=16):
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer(tmp_path, max_epochs=3):
    return pl.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )


# -- Lightning: a validation loader that forks its workers again at every validation run ----------


@pytest.mark.torchperf
def test_fit_val_loader_buggy(tmp_path):
    train = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    val = DataLoader(dataset(), batch_size=32, num_workers=2)  # persistent_workers defaults to False
    trainer(tmp_path).fit(Regressor(), train, val)


@pytest.mark.torchperf
def test_fit_val_loader_fixed(tmp_path):
    train = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    val = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    trainer(tmp_path).fit(Regressor(), train, val)


# -- A hand-written loop, watched through the fixture ------------------------------------------------


def reset_between_epochs(loader):
    """A "clean slate" helper of the kind that creeps into training scripts."""
    loader._iterator = None


def train(loader, epochs, run, reset):
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _epoch in range(epochs):
        for x, y in loader:
            with run.step():
                loss = torch.nn.functional.mse_loss(model(x), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        if reset:
            reset_between_epochs(loader)


def test_custom_loop_buggy(torchperf):
    loader = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    with torchperf.watch() as run:
        train(loader, epochs=3, run=run, reset=True)


def test_custom_loop_fixed(torchperf):
    loader = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    with torchperf.watch() as run:
        train(loader, epochs=3, run=run, reset=False)
    # The report is also there to assert on.
    assert run.report["no_iterator_reset"].figures["pools_started"] == 1
    assert run.steps == 12
