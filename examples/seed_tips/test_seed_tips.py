"""The tips of "8 mistakes that slow down your PyTorch Lightning code", as tests.

Each ``*_buggy`` test makes one of the mistakes and fails with a torchperf
report naming the line; its ``*_fixed`` twin passes. The pinned-memory and
16-bit tips are about copies to and math on a GPU: those two pairs need CUDA
and are skipped elsewhere (on a CPU the invariants report "not applicable").
"""

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # the unified `lightning` package
    import lightning.pytorch as pl

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU tip: needs a CUDA device")


def dataset(n=128, width=16):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=generator)
    return TensorDataset(x, x.sum(dim=1, keepdim=True))


class Regressor(pl.LightningModule):
    def __init__(self, width=16):
        super().__init__()
        self.net = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def trainer(tmp_path, max_epochs=2, **kwargs):
    return pl.Trainer(
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        **kwargs,
    )


# -- 1. Use workers in DataLoaders ------------------------------------------------------------


@pytest.mark.torchperf(min_workers=2)
def test_workers_buggy(tmp_path):
    loader = DataLoader(dataset(), batch_size=32)  # every batch is loaded between two steps
    trainer(tmp_path).fit(Regressor(), loader)


@pytest.mark.torchperf(min_workers=2)
def test_workers_fixed(tmp_path):
    loader = DataLoader(dataset(), batch_size=32, num_workers=2, persistent_workers=True)
    trainer(tmp_path).fit(Regressor(), loader)


# -- 2. Pin memory (a GPU tip) ------------------------------------------------------------------


@cuda
@pytest.mark.torchperf(pin_memory=True)
def test_pin_memory_buggy(tmp_path):
    loader = DataLoader(dataset(), batch_size=32)
    trainer(tmp_path, accelerator="gpu", devices=1).fit(Regressor(), loader)


@cuda
@pytest.mark.torchperf(pin_memory=True)
def test_pin_memory_fixed(tmp_path):
    loader = DataLoader(dataset(), batch_size=32, pin_memory=True)
    trainer(tmp_path, accelerator="gpu", devices=1).fit(Regressor(), loader)


# -- 3. Do not call torch.cuda.empty_cache() in the loop (counted on a CPU too) -----------------


class FreesTheCache(Regressor):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        torch.cuda.empty_cache()  # "keeps memory usage low": makes every step allocate again
        return loss


@pytest.mark.torchperf(no_empty_cache=True)
def test_empty_cache_buggy(tmp_path):
    trainer(tmp_path).fit(FreesTheCache(), DataLoader(dataset(), batch_size=32))


@pytest.mark.torchperf(no_empty_cache=True)
def test_empty_cache_fixed(tmp_path):
    trainer(tmp_path).fit(Regressor(), DataLoader(dataset(), batch_size=32))


# -- 4. DistributedDataParallel, not DataParallel (on by default; caught on a CPU too) ----------


def train(model, run, epochs=2):
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU where there is one
    model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for _ in range(epochs):
        for x, y in DataLoader(dataset(), batch_size=32):
            x, y = x.to(device), y.to(device)
            with run.step():
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()


def test_data_parallel_buggy(torchperf):
    model = torch.nn.DataParallel(torch.nn.Linear(16, 1))  # one process drives every GPU
    with torchperf.watch() as run:
        train(model, run)


def test_data_parallel_fixed(torchperf):
    # One process per GPU instead: torch.nn.parallel.DistributedDataParallel under torchrun,
    # or Trainer(strategy="ddp"); on a single device, the module as it is.
    model = torch.nn.Linear(16, 1)
    with torchperf.watch() as run:
        train(model, run)


# -- 5. 16-bit precision (a GPU tip) ------------------------------------------------------------


@cuda
@pytest.mark.torchperf(mixed_precision=True)
def test_precision_buggy(tmp_path):
    trainer(tmp_path, accelerator="gpu", devices=1).fit(Regressor(), DataLoader(dataset(), batch_size=32))


@cuda
@pytest.mark.torchperf(mixed_precision=True)
def test_precision_fixed(tmp_path):
    precision = "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"
    trainer(tmp_path, accelerator="gpu", devices=1, precision=precision).fit(
        Regressor(), DataLoader(dataset(), batch_size=32)
    )


# -- 6. Clear gradients by setting them to None ---------------------------------------------------


class ZeroesGradients(Regressor):
    def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
        optimizer.zero_grad(set_to_none=False)  # a memset per parameter, then the backward adds into zeros


@pytest.mark.torchperf(grads_set_to_none=True)
def test_zero_grad_buggy(tmp_path):
    trainer(tmp_path).fit(ZeroesGradients(), DataLoader(dataset(), batch_size=32))


@pytest.mark.torchperf(grads_set_to_none=True)
def test_zero_grad_fixed(tmp_path):
    trainer(tmp_path).fit(Regressor(), DataLoader(dataset(), batch_size=32))


# -- 7. A compiled model must not recompile after warm-up ------------------------------------------


class ScaledByInt(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.linear = torch.nn.Linear(width, 1)
        self.stage = 0  # a Python int: torch.compile specialises on its value

    def forward(self, x):
        return self.linear(x) * (1.0 + 0.1 * self.stage)


class ScaledByTensor(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.linear = torch.nn.Linear(width, 1)
        self.register_buffer("stage", torch.zeros(()))  # a tensor: an input of the compiled graph

    def forward(self, x):
        return self.linear(x) * (1.0 + 0.1 * self.stage)


class Curriculum(Regressor):
    def __init__(self, scaled):
        super().__init__()
        self.scaled = scaled
        self.net = torch.compile(scaled, backend="eager")  # the backend does not matter to the check

    def on_train_epoch_start(self):
        if isinstance(self.scaled.stage, torch.Tensor):
            self.scaled.stage.fill_(self.current_epoch)
        else:
            self.scaled.stage = self.current_epoch


@pytest.mark.torchperf(no_recompiles=True)
def test_recompiles_buggy(tmp_path):
    trainer(tmp_path, max_epochs=3).fit(Curriculum(ScaledByInt()), DataLoader(dataset(), batch_size=32))


@pytest.mark.torchperf(no_recompiles=True)
def test_recompiles_fixed(tmp_path):
    trainer(tmp_path, max_epochs=3).fit(Curriculum(ScaledByTensor()), DataLoader(dataset(), batch_size=32))
