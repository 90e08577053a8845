"""What watching costs a whole Lightning fit: watched vs unwatched, interleaved.

Each round runs the same tiny fit three ways in alternating order: unwatched
(A), unwatched again (A', the A/A calibration of this machine's noise) and
inside ``pytest_torchperf.watch()`` (B). Reported: median seconds per fit, the
median and the spread (25th-75th percentile) of the per-round ratios B/A and
A'/A. The first round is a warm-up and is dropped.

    python benchmarks/bench_watch_fit.py [--rounds 15] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings


def build(workers: int):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    try:
        import pytorch_lightning as pl
    except ImportError:  # pragma: no cover
        import lightning.pytorch as pl

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x = torch.randn(2048, 64)
    data = TensorDataset(x, x.sum(1, keepdim=True))
    loader = DataLoader(data, batch_size=32, num_workers=workers, persistent_workers=workers > 0)
    root = tempfile.mkdtemp()

    def fit() -> None:
        trainer = pl.Trainer(
            max_epochs=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=root,
        )
        trainer.fit(Regressor(), loader)

    return fit


def quantiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no budget verdict)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds = 2

    import logging

    import torch

    from pytest_torchperf import watch

    torch.set_num_threads(args.threads)
    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    fit = build(args.workers)

    def unwatched() -> float:
        start = time.perf_counter()
        fit()
        return time.perf_counter() - start

    def watched() -> float:
        start = time.perf_counter()
        with watch():  # the default invariants
            fit()
        return time.perf_counter() - start

    times: dict[str, list[float]] = {"A": [], "A'": [], "B": []}
    runners = {"A": unwatched, "A'": unwatched, "B": watched}
    orders = [("A", "B", "A'"), ("B", "A'", "A"), ("A'", "A", "B")]
    for r in range(args.rounds + 1):
        for key in orders[r % len(orders)]:
            elapsed = runners[key]()
            if r:  # round 0 is the warm-up
                times[key].append(elapsed)

    ratio_b = [b / a for a, b in zip(times["A"], times["B"])]
    ratio_aa = [a2 / a for a, a2 in zip(times["A"], times["A'"])]
    print(f"tiny Lightning fit, 2 epochs x 64 steps, num_workers={args.workers}, threads={args.threads}, "
          f"{args.rounds} rounds (+1 warm-up), torch {torch.__version__}")
    for key, label in (("A", "unwatched"), ("A'", "unwatched again (A/A)"), ("B", "watched")):
        lo, med, hi = quantiles(times[key])
        print(f"  {label:24} median {med * 1000:8.1f} ms  (IQR {lo * 1000:.1f}-{hi * 1000:.1f})")
    for ratios, label in ((ratio_aa, "A'/A (noise)"), (ratio_b, "watched/unwatched")):
        lo, med, hi = quantiles(ratios)
        print(f"  {label:24} median {med:.3f}x     (IQR {lo:.3f}-{hi:.3f})")


if __name__ == "__main__":
    main()
