"""The bug this project was born from, as its victim would have tested it.

pytorch-lightning 1.5.0 set ``DataLoader._iterator = None`` at the start of
every epoch, so ``persistent_workers=True`` did nothing: every epoch forked new
workers, each loading its data again, and one user's iterations went from 4 s
to 15 s. Under pytorch-lightning 1.5.0 this test fails and shows the stack
that dropped the iterator; under 1.5.1 and later it passes.
"""

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as pl


class SlowToOpenDataset(Dataset):
    """Each worker opens its shard once (worker_init_fn); persistent workers pay that once."""

    def __init__(self, n=256, width=32):
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, width, generator=generator)
        self.y = self.x.sum(dim=1, keepdim=True)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        return self.x[index], self.y[index]


def open_shard(worker_id):
    time.sleep(0.2)  # stands in for opening files, building an index, loading a tokenizer...


class Regressor(pl.LightningModule):
    def __init__(self, width=32):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


def loader(shuffle):
    return DataLoader(
        SlowToOpenDataset(),
        batch_size=64,
        shuffle=shuffle,
        num_workers=2,
        persistent_workers=True,
        worker_init_fn=open_shard,
    )


@pytest.mark.torchperf
def test_fit_keeps_its_workers(tmp_path):
    trainer = pl.Trainer(
        max_epochs=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(Regressor(), loader(shuffle=True), loader(shuffle=False))
