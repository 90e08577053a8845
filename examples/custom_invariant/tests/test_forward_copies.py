"""ACME's invariant in use: a module that builds its position ids on the host, and its fix.

Run with pytest-torchperf and acme-torchperf installed; ``*_buggy`` fails with the report.
"""

from __future__ import annotations

import pytest
import torch


class Positions(torch.nn.Module):
    """Adds learned position embeddings; the buggy one builds the ids on the host every call."""

    def __init__(self, on_device: bool) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(16, 8)
        self.on_device = on_device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_device:
            ids = torch.arange(x.shape[1], device=x.device)
        else:
            ids = torch.arange(x.shape[1]).to(x.device)
        return x + self.embedding(ids)


def train(torchperf, on_device: bool, **arguments) -> None:
    model = Positions(on_device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchperf.watch(no_host_to_device_in_forward=True, on_device=False, **arguments) as run:
        for _ in range(4):
            with run.step():
                loss = model(torch.randn(2, 16, 8)).pow(2).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()


def test_position_ids_buggy(torchperf) -> None:
    train(torchperf, on_device=False)


def test_position_ids_fixed(torchperf) -> None:
    train(torchperf, on_device=True)


def test_a_budget_of_one_copy_per_step_fixed(torchperf) -> None:
    train(torchperf, on_device=False, max_forward_copies=1)


def test_a_misspelt_argument_is_named_with_the_closest_one(torchperf) -> None:
    with pytest.raises(
        ValueError, match=r"unknown argument 'max_forward_copy' \(did you mean 'max_forward_copies'\?\)"
    ):
        train(torchperf, on_device=True, max_forward_copy=1)
