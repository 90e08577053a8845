"""GPU stalls caught on a CPU-only machine: host syncs and host-built tensors in the training step.

On a GPU, ``loss.item()`` makes the CPU wait for every queued kernel, and
``torch.randn(shape).to(self.device)`` fills host memory and copies it over,
every step. On CPU neither costs anything, so CPU-only CI never notices;
torchperf recognises them anyway. Each ``*_buggy`` test fails with a report
pointing at the line; its ``*_fixed`` twin passes.
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as pl


#: The device a plain loop trains on: the GPU where there is one (Lightning's Trainer picks it by itself).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def loader():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 16, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=16)


def trainer(tmp_path):
    return pl.Trainer(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(16, 1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


# -- .item() in the step: a GPU->CPU sync every step ------------------------------------------


class LogsWithItem(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if loss.item() > 100:  # a Python branch on a device value
            print("diverging")
        return loss


class LogsTheLightningWay(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)  # Lightning reduces it when it needs to
        return loss


@pytest.mark.torchperf
def test_sync_in_training_step_buggy(tmp_path):
    trainer(tmp_path).fit(LogsWithItem(), loader())


@pytest.mark.torchperf
def test_sync_in_training_step_fixed(tmp_path):
    trainer(tmp_path).fit(LogsTheLightningWay(), loader())


# -- noise built on the host and copied to the device every step ------------------------------


class NoisyOnHost(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.randn(x.shape).to(self.device)
        return torch.nn.functional.mse_loss(self.net(x + 0.01 * noise), y)


class NoisyOnDevice(Regressor):
    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.randn(x.shape, device=self.device)
        return torch.nn.functional.mse_loss(self.net(x + 0.01 * noise), y)


@pytest.mark.torchperf
def test_host_built_noise_buggy(tmp_path):
    trainer(tmp_path).fit(NoisyOnHost(), loader())


@pytest.mark.torchperf
def test_host_built_noise_fixed(tmp_path):
    trainer(tmp_path).fit(NoisyOnDevice(), loader())


# -- a plain loop through the fixture: a boolean mask is a sync too -----------------------------


def test_boolean_mask_in_my_loop_buggy(torchperf):
    model = torch.nn.Linear(16, 1).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchperf.watch() as run:
        for x, y in loader():
            x, y = x.to(DEVICE), y.to(DEVICE)
            with run.step():
                err = (model(x) - y).abs()
                loss = err[err > 0.5].mean()  # the mask's size is data dependent: a sync
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()


def test_boolean_mask_in_my_loop_fixed(torchperf):
    model = torch.nn.Linear(16, 1).to(DEVICE)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    with torchperf.watch() as run:
        for x, y in loader():
            x, y = x.to(DEVICE), y.to(DEVICE)
            with run.step():
                err = (model(x) - y).abs()
                keep = (err > 0.5).float()
                loss = (err * keep).sum() / keep.sum().clamp(min=1)  # same value, no sync
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
