"""What ``--torchperf-trace`` costs a watched test.

Three variants of the same watched test body, interleaved round by round (warm-up round dropped):

- ``watched``: the test as it runs without the option;
- ``traced``: the option on and the test passing: the profiler records the body through the 4th
  optimizer step, then the recording is dropped;
- ``traced+saved``: the option on and the test failing: the trace is also exported, its findings
  marked, and written to disk.

Bodies: a tiny Lightning fit (3 epochs x 8 steps, the fit's setup and sanity check included) and a
plain loop (24 steps). The cost of a trace is about constant per test (profiler start-up, Python
frames recorded for 4 steps, export), so it is reported in milliseconds added per test, with the
median of per-round differences and their IQR, and the written file's size.

    python benchmarks/bench_trace.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Callable

import torch
from torch.utils.data import DataLoader, TensorDataset

from pytest_torchperf.glue.baseline import observe
from pytest_torchperf.glue.trace import StepTrace
from pytest_torchperf.options import parse_options
from pytest_torchperf.watching import watching

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss.item())  # a sync: the finding a failing test would have
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def lightning_fit(tmp: str) -> None:
    x = torch.randn(64, 16)
    loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(
        max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp, limit_val_batches=0,
    )
    trainer.fit(Module(), loader)


def plain_loop(run) -> None:
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(24):
        with run.step():
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.item()
            loss.backward()
            opt.step()
            opt.zero_grad()


def run_once(body: Callable, variant: str, tmp: str) -> tuple[float, int]:
    start = time.perf_counter()
    size = 0
    with watching(parse_options({})) as run:
        recorder = StepTrace() if variant != "watched" else None
        if recorder:
            recorder.start()
        body(run, tmp)
        if recorder:
            recorder.stop()
    if recorder and variant == "traced+saved":
        path = recorder.save(tmp, "bench::test", observe(run.report))
        assert path, recorder.error
        size = os.path.getsize(path)
        os.unlink(path)
    elif recorder:
        recorder.discard()
    return time.perf_counter() - start, size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="a tiny setting for CI (seconds; no figures)")
    args = parser.parse_args()
    warmup = 1
    if args.smoke:  # every variant of both bodies once: that it runs, not what it costs
        args.rounds, warmup = 1, 0
    torch.set_num_threads(1)
    import logging

    logging.getLogger("pytorch_lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    bodies = {
        "Lightning fit, 3 epochs x 8 steps": lambda run, tmp: lightning_fit(tmp),
        "plain loop, 24 steps": lambda run, tmp: plain_loop(run),
    }
    variants = ("watched", "traced", "traced+saved")
    print(f"{args.rounds} interleaved rounds after {warmup} warm-up, 1 thread, torch {torch.__version__}")
    print("| test body | watched (median) | + trace, passing | + trace, failing (written) | file |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name, body in bodies.items():
            times: dict[str, list[float]] = {v: [] for v in variants}
            sizes = []
            for round_ in range(args.rounds + warmup):
                order = variants if round_ % 2 == 0 else variants[::-1]
                for variant in order:
                    seconds, size = run_once(body, variant, tmp)
                    if round_ >= warmup:
                        times[variant].append(seconds)
                        if size:
                            sizes.append(size)
            base = statistics.median(times["watched"])

            def added(variant: str) -> str:
                diffs = sorted((t - w) * 1000 for t, w in zip(times[variant], times["watched"]))  # noqa: B023 - called in this iteration
                q = statistics.quantiles(diffs, n=4) if len(diffs) > 1 else diffs * 3
                return f"+{statistics.median(diffs):.0f} ms (IQR {q[0]:.0f}..{q[2]:.0f})"

            print(
                f"| {name} | {base * 1000:.0f} ms | {added('traced')} | {added('traced+saved')} | "
                f"{statistics.median(sizes) / 1e6:.1f} MB |"
            )


if __name__ == "__main__":
    main()
