"""The GPU-only invariants on a buggy and a fixed twin each, judged through ``watch()``.

``pin_memory``, ``mixed_precision``, ``max_memory_growth``, ``gpu_settings``, ``no_empty_cache`` and
``max_overhead`` (timed with CUDA events on a GPU) each get a buggy loop that should fail and its fixed
twin that should pass; every other invariant is off, so each verdict is the invariant's alone. On a CPU
(``--device cpu``, for the dry run) the CUDA-only ones say *not checked*. One JSON object per twin is
appended to ``--out`` as soon as it is known::

    python scripts/gpu_invariants.py --device cuda --out invariants.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Optional

STEPS = 8


def _off() -> dict[str, bool]:
    from pytest_torchperf import Options

    return {name: False for name in Options().enabled_checks}


def _judge(body: Callable[[Any], None], **kwargs: Any) -> Any:
    """Run ``body(run)`` under ``watch(**kwargs)`` with every default invariant off; the report either way."""
    from pytest_torchperf import InvariantViolation, watch

    run = None
    try:
        with watch(**{**_off(), **kwargs}) as run:
            body(run)
    except InvariantViolation:
        pass
    assert run is not None
    return run.report


def _mlp(torch: Any, dev: Any, width: int = 64, out: int = 8) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.ReLU(), torch.nn.Linear(width, out)).to(dev)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model: Any, opt: Any, x: Any) -> Any:
    out = model(x)
    out.square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return out


def pin_memory(torch: Any, dev: Any, buggy: bool) -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(32 * STEPS, 64)), batch_size=32, pin_memory=not buggy)
    model, opt = _mlp(torch, dev)

    def body(run: Any) -> None:
        for (x,) in loader:
            with run.step():
                _step(model, opt, x.to(dev, non_blocking=not buggy))

    return _judge(body, pin_memory=True)


def mixed_precision(torch: Any, dev: Any, buggy: bool) -> Any:
    import contextlib

    model, opt = _mlp(torch, dev)
    x = torch.randn(32, 64, device=dev)

    def body(run: Any) -> None:
        for _ in range(STEPS):
            with run.step():
                region = contextlib.nullcontext() if buggy else torch.autocast(dev.type, dtype=torch.bfloat16)
                with region:
                    loss = model(x).float().square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

    return _judge(body, mixed_precision=True)


def max_memory_growth(torch: Any, dev: Any, buggy: bool) -> Any:
    model, opt = _mlp(torch, dev, width=512, out=512)
    x = torch.randn(32, 64, device=dev)
    kept = []

    def body(run: Any) -> None:
        for _ in range(STEPS + 4):
            with run.step():
                out = _step(model, opt, x)
                if buggy:
                    kept.append(out.detach().clone())  # 64 KiB more every step

    return _judge(body, max_memory_growth=4096)


def gpu_settings(torch: Any, dev: Any, buggy: bool, target: Any = True) -> Any:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(8 * 16 * 16, 8)
    ).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 3, 16, 16, device=dev)
    precision, benchmark = torch.get_float32_matmul_precision(), torch.backends.cudnn.benchmark
    torch.set_float32_matmul_precision("highest" if buggy else "high")
    torch.backends.cudnn.benchmark = not buggy

    def body(run: Any) -> None:
        for _ in range(STEPS):
            with run.step():
                _step(model, opt, x)

    try:
        return _judge(body, gpu_settings=target)
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cudnn.benchmark = benchmark


def no_empty_cache(torch: Any, dev: Any, buggy: bool) -> Any:
    model, opt = _mlp(torch, dev)
    x = torch.randn(32, 64, device=dev)

    def body(run: Any) -> None:
        for _ in range(STEPS):
            with run.step():
                _step(model, opt, x)
                if buggy:
                    torch.cuda.empty_cache()

    return _judge(body, no_empty_cache=True)


def max_overhead(torch: Any, dev: Any, buggy: bool) -> Any:
    """A Lightning fit against its plain loop: a tiny step (Lightning's fixed cost dominates) or a heavy one."""
    try:
        import pytorch_lightning as pl
    except ImportError:
        import lightning.pytorch as pl  # type: ignore[no-redef]
    from torch.utils.data import DataLoader

    on_gpu = dev.type == "cuda"
    if buggy:
        width, depth, batch, batches = 16, 1, 16, 32
    elif on_gpu:
        width, depth, batch, batches = 4096, 4, 4096, 12
    else:
        width, depth, batch, batches = 512, 4, 64, 12

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            layers: list[Any] = []
            for _ in range(depth - 1):
                layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
            self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-4)

    torch.manual_seed(0)
    data = [torch.randn(batch, width, device=dev) for _ in range(batches)]  # whole batches, already on the device
    loader = DataLoader(data, batch_size=None)

    def body(run: Any) -> None:
        with tempfile.TemporaryDirectory() as root:
            trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                 enable_model_summary=False, accelerator="gpu" if on_gpu else "cpu", devices=1,
                                 default_root_dir=root)
            trainer.fit(Module(), loader)

    return _judge(body, max_overhead=0.5, overhead_inconclusive="warn")


def gpu_settings_as_hopper(torch: Any, dev: Any, buggy: bool) -> Any:
    """The same twins judged as on a Hopper GPU: the CPU-side prediction of ``gpu_settings=True`` on an H100/H200."""
    return gpu_settings(torch, dev, buggy, target="hopper")


#: (label, invariant, its buggy/fixed twin function, whether its verdict needs CUDA)
TWINS: list[tuple[str, str, Callable[..., Any], bool]] = [
    ("pin_memory", "pin_memory", pin_memory, True),
    ("mixed_precision", "mixed_precision", mixed_precision, True),
    ("max_memory_growth", "max_memory_growth", max_memory_growth, True),
    ("gpu_settings", "gpu_settings", gpu_settings, True),
    ("gpu_settings='hopper'", "gpu_settings", gpu_settings_as_hopper, False),
    ("no_empty_cache", "no_empty_cache", no_empty_cache, False),
    ("max_overhead", "max_overhead", max_overhead, False),
]


def expected(needs_cuda: bool, buggy: bool, device: str) -> str:
    if needs_cuda and device != "cuda":
        return "not checked"
    return "failed" if buggy else "passed"


def _figures(check: Any) -> str:
    figures = dict(check.figures)
    if "fits" in figures:  # max_overhead: each fit's scalars (device, unit, verdict) and both sides' medians
        figures["fits"] = [
            {**{k: v for k, v in fit.items() if isinstance(v, (str, int, float, bool)) or v is None},
             **{f"{side}_median_s": (fit.get(side) or {}).get("median_s") for side in ("candidate", "baseline")}}
            for fit in figures["fits"]
        ]
    text = json.dumps(figures, default=str, sort_keys=True)
    return text if len(text) <= 1500 else text[:1500] + "..."


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", required=True, help="JSON lines file, appended to")
    parser.add_argument("--only", default="", help="comma-separated invariant names (default: all)")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_invariants: --device cuda without a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    only = set(filter(None, args.only.split(",")))
    failed = 0
    for label, name, twin, needs_cuda in TWINS:
        if only and label not in only:
            continue
        for buggy in (True, False):
            began = time.perf_counter()
            record: dict[str, Any] = {"invariant": label, "twin": "buggy" if buggy else "fixed", "device": args.device,
                                      "expected": expected(needs_cuda, buggy, args.device)}
            try:
                check = twin(torch, dev, buggy)[name]
                record.update(status=check.status, summary=check.summary, figures=_figures(check),
                              findings=[f.title for f in check.findings][:3])
            except Exception as exc:  # noqa: BLE001 - one broken twin must not stop the others
                record.update(status="error", error=f"{type(exc).__name__}: {exc}",
                              traceback=traceback.format_exc()[-2000:])
            record["seconds"] = round(time.perf_counter() - began, 3)
            failed += record["status"] != record["expected"]
            with open(args.out, "a", encoding="utf-8") as out:
                out.write(json.dumps(record) + "\n")
            print(f"gpu_invariants: {label} {record['twin']}: {record['status']} (expected {record['expected']}, "
                  f"{record['seconds']} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
