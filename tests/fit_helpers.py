"""A tiny, seeded Lightning fit for in-process tests: ``fit(root)`` returns the trained weights."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the lightning package only
    import lightning.pytorch as pl  # type: ignore[no-redef]


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root: Path, epochs: int = 2) -> torch.Tensor:
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    model = Tiny()
    trainer = pl.Trainer(
        max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=str(root), accelerator="cpu", devices=1,
    )
    trainer.fit(model, DataLoader(data, batch_size=4))
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])
