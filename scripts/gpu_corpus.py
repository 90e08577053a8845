"""The cross-check corpus: one small training step per synchronising pattern the plugin claims to catch.

``scripts/gpu_check.py`` runs every pattern three ways and compares the lines each way blames:

- ``--mode plugin`` with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``): the plugin's verdict on a CPU-only
  machine, the claim under test (``no_host_sync``, ``on_device`` and ``pin_memory`` through ``watch()``);
- ``--mode plugin`` on CUDA: the plugin's verdict where it also listens to CUDA;
- ``--mode syncdebug`` on CUDA, without the plugin: ``torch.cuda.set_sync_debug_mode("warn")`` switched on
  inside each step (as the plugin does), every warning recorded with its file and line.

Each pattern's line is the one marked ``# <- the pattern``; a line blamed elsewhere is listed as such.
One JSON object per pattern is appended to ``--out`` as soon as it is known (a run cut short keeps what it
had). Run alone::

    python scripts/gpu_corpus.py --mode plugin --device cpu --out corpus.jsonl
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

#: Steps per pattern: every one syncs, so a per-step site fails rather than being a periodic note.
STEPS = 6
MARK = "# <- the pattern"
#: The text of torch's sync debug warning ("called a synchronizing CUDA operation").
SYNC_WARNING = "synchronizing CUDA operation"


@dataclass
class Ctx:
    """What a step works on: a model on the device, its optimizer, an input batch already there."""

    torch: Any
    dev: Any
    model: Any
    opt: Any
    x: Any


def _train(ctx: Ctx, x: Any) -> tuple[Any, Any]:
    out = ctx.model(x)
    loss = out.square().mean()
    loss.backward()
    ctx.opt.step()
    ctx.opt.zero_grad(set_to_none=True)
    return out, loss


# -- the patterns: each function is one training step; the marked line is the one under test ---------------


def clean(ctx: Ctx, batch: Any) -> Any:
    _train(ctx, ctx.x)


def item(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return loss.item()  # <- the pattern


def float_of(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return float(loss)  # <- the pattern


def bool_branch(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    if loss > 0:  # <- the pattern
        return 1
    return 0


def fstring(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return f"loss {loss:.3f}"  # <- the pattern


def cpu(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return loss.detach().cpu()  # <- the pattern


def tolist(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return out[0].tolist()  # <- the pattern


def nonzero(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return ctx.torch.nonzero(out > 0)  # <- the pattern


def bool_mask(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return out[out > 0]  # <- the pattern


def bool_mask_assign(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    kept = out.detach().clone()
    kept[kept < 0] = 0.0  # <- the pattern
    return kept


def bool_mask_assign_tensor(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    kept = out.detach().clone()
    kept[kept < 0] = ctx.torch.zeros(1, device=ctx.dev)  # <- the pattern
    return kept


def masked_select(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    return ctx.torch.masked_select(out, out > 0)  # <- the pattern


def tensor_on_device(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    scale = ctx.torch.tensor([0.5, 2.0], device=ctx.dev)  # <- the pattern
    return out[:, :2] * scale


def host_built_to(ctx: Ctx, batch: Any) -> Any:
    out, loss = _train(ctx, ctx.x)
    noise = ctx.torch.randn(out.shape).to(ctx.dev)  # <- the pattern
    return out + noise


def synchronize(ctx: Ctx, batch: Any) -> Any:
    _train(ctx, ctx.x)
    if ctx.dev.type == "cuda":
        ctx.torch.cuda.synchronize()  # <- the pattern


def loader_pageable(ctx: Ctx, batch: Any) -> Any:
    x = batch[0].to(ctx.dev)  # <- the pattern
    _train(ctx, x)


def loader_pageable_non_blocking(ctx: Ctx, batch: Any) -> Any:
    x = batch[0].to(ctx.dev, non_blocking=True)  # <- the pattern
    _train(ctx, x)


def loader_pinned(ctx: Ctx, batch: Any) -> Any:
    x = batch[0].to(ctx.dev)  # <- the pattern
    _train(ctx, x)


def loader_pinned_non_blocking(ctx: Ctx, batch: Any) -> Any:
    x = batch[0].to(ctx.dev, non_blocking=True)  # <- the pattern
    _train(ctx, x)


@dataclass(frozen=True)
class Pattern:
    """A pattern, what the plugin claims about it, and what CUDA is expected to say."""

    name: str
    step: Callable[[Ctx, Any], Any]
    #: The invariant that claims the pattern ("" for a clean step).
    claim: str
    #: Whether a CUDA step really waits for the device at the marked line (the expectation; the run decides).
    syncs: bool
    #: ``None``: no DataLoader; else the loader's ``pin_memory``.
    pinned: Optional[bool] = None
    #: What to say where the two sides disagree as expected, keyed by who flagged: "plugin" or "cuda".
    gaps: dict[str, str] = field(default_factory=dict)

    @property
    def line(self) -> int:
        """The line of the marked statement in this file (0 for a step without one)."""
        lines, first = inspect.getsourcelines(self.step)
        for offset, text in enumerate(lines):
            if MARK in text:
                return first + offset
        return 0


NOT_ROUTED = (
    "torch.cuda.synchronize() is cudaDeviceSynchronize, which does not go through c10::cuda::stream_synchronize "
    "or memcpy_and_sync, the only callers of warn_or_error_on_sync (c10/cuda/CUDAFunctions.h): a known gap of "
    "the debug mode; the plugin counts it by wrapping torch.cuda.synchronize"
)
PAGEABLE_ASYNC = (
    "a non_blocking copy from pageable host memory is issued with cudaMemcpyAsync and no warn_or_error_on_sync "
    "(the driver stages it synchronously, so the host still waits): a known gap of the debug mode; pin_memory "
    "blames the loader on CUDA"
)
LOADER_BY_DESIGN = (
    "on_device never blames a DataLoader batch (by design: that copy is the input); pin_memory judges the loader "
    "on a CUDA run only (not applicable on CPU), so a CPU-only run cannot claim it"
)
PINNED_BLOCKING = (
    "a pinned batch moved without non_blocking=True is still a blocking copy (memcpy_and_sync); no invariant "
    "claims it (pin_memory passes once the loader pins): a gap of the plugin"
)

PATTERNS = [
    Pattern("clean", clean, "", syncs=False),
    Pattern("item", item, "no_host_sync", syncs=True),
    Pattern("float_of", float_of, "no_host_sync", syncs=True),
    Pattern("bool_branch", bool_branch, "no_host_sync", syncs=True),
    Pattern("fstring", fstring, "no_host_sync", syncs=True),
    Pattern("cpu", cpu, "no_host_sync", syncs=True),
    Pattern("tolist", tolist, "no_host_sync", syncs=True),
    Pattern("nonzero", nonzero, "no_host_sync", syncs=True),
    Pattern("bool_mask", bool_mask, "no_host_sync", syncs=True),
    Pattern("bool_mask_assign", bool_mask_assign, "no_host_sync", syncs=True),
    Pattern("bool_mask_assign_tensor", bool_mask_assign_tensor, "no_host_sync", syncs=True),
    Pattern("masked_select", masked_select, "no_host_sync", syncs=True),
    Pattern("tensor_on_device", tensor_on_device, "on_device", syncs=True),
    Pattern("host_built_to", host_built_to, "on_device", syncs=True),
    Pattern("synchronize", synchronize, "no_host_sync", syncs=True, gaps={"plugin": NOT_ROUTED}),
    Pattern("loader_pageable", loader_pageable, "pin_memory", syncs=True, pinned=False,
            gaps={"cuda": LOADER_BY_DESIGN}),
    Pattern("loader_pageable_non_blocking", loader_pageable_non_blocking, "pin_memory", syncs=True, pinned=False,
            gaps={"plugin": PAGEABLE_ASYNC, "cuda": PAGEABLE_ASYNC}),
    Pattern("loader_pinned", loader_pinned, "", syncs=True, pinned=True, gaps={"cuda": PINNED_BLOCKING}),
    Pattern("loader_pinned_non_blocking", loader_pinned_non_blocking, "", syncs=False, pinned=True),
]
BY_NAME = {p.name: p for p in PATTERNS}


def _where(filename: str, lineno: int) -> str:
    here = os.path.abspath(__file__)
    if os.path.abspath(filename) == here:
        return f"{os.path.basename(here)}:{lineno}"
    return f"{filename}:{lineno}"


def _context(torch: Any, dev: Any) -> Ctx:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    return Ctx(torch, dev, model, opt, torch.randn(32, 64, device=dev))


def _batches(torch: Any, pattern: Pattern) -> Any:
    """``STEPS`` batches: ``None`` each, or a DataLoader's (iterated in the loop, pinned between the steps)."""
    if pattern.pinned is None:
        return [None] * STEPS
    from torch.utils.data import DataLoader, TensorDataset

    return DataLoader(TensorDataset(torch.randn(32 * STEPS, 64)), batch_size=32, pin_memory=pattern.pinned)


def run_plugin(torch: Any, dev: Any, pattern: Pattern) -> dict[str, Any]:
    """The plugin's verdicts on ``STEPS`` steps of the pattern, with every site it blamed."""
    from pytest_torchperf import InvariantViolation, watch

    ctx = _context(torch, dev)
    batches = _batches(torch, pattern)
    run = None
    try:
        with warnings.catch_warnings(), watch(no_host_sync=True, on_device=True, pin_memory=True) as run:
            warnings.filterwarnings("ignore", message=".*pin_memory.*")  # pinning without CUDA warns, does nothing
            for batch in batches:
                with run.step():
                    pattern.step(ctx, batch)
    except InvariantViolation:
        pass
    assert run is not None
    checks: dict[str, Any] = {}
    for name in ("no_host_sync", "on_device", "pin_memory"):
        check = run.report.checks.get(name)
        if check is None:
            continue
        sites = []
        for finding in check.findings:
            confirmed = [fact for fact in finding.facts if "confirmed" in fact or "set_sync_debug_mode" in fact]
            for site in finding.sites:
                frame = site.frame
                sites.append({
                    "where": _where(frame.filename, frame.lineno) if frame else None,
                    "label": site.label,
                    "count": site.count,
                    "finding": finding.title,
                    "confirmed": confirmed,
                })
            if not finding.sites:
                sites.append({"where": None, "label": "", "count": 0, "finding": finding.title, "confirmed": confirmed})
        checks[name] = {"status": check.status, "summary": check.summary, "sites": sites}
    return {"checks": checks}


def run_syncdebug(torch: Any, dev: Any, pattern: Pattern) -> dict[str, Any]:
    """The same steps without the plugin, under ``set_sync_debug_mode("warn")`` inside each step."""
    ctx = _context(torch, dev)
    batches = _batches(torch, pattern)
    seen: dict[str, dict[str, Any]] = {}

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if SYNC_WARNING not in str(message):
            return
        # The warning names the innermost Python line; a sync inside torch's own Python code (an f-string's
        # Tensor.__format__) is blamed on the corpus line that called it, as the plugin blames the user's line.
        where = via = _where(filename, lineno)
        frame = sys._getframe(1)
        while frame is not None and os.path.abspath(frame.f_code.co_filename) != os.path.abspath(__file__):
            frame = frame.f_back
        if frame is not None and frame.f_code.co_name != "run_syncdebug":
            where = _where(frame.f_code.co_filename, frame.f_lineno)
        entry = seen.setdefault(where, {"where": where, "count": 0, "via": set(),
                                        "message": str(message).splitlines()[0][:160]})
        entry["count"] += 1
        if via != where:
            entry["via"].add(via)

    for batch in batches:  # the debug mode is on inside the steps only, as the plugin has it
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                pattern.step(ctx, batch)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    for entry in seen.values():
        entry["via"] = sorted(entry["via"])
    return {"warnings": sorted(seen.values(), key=lambda e: -e["count"])}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("plugin", "syncdebug"), required=True)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--out", required=True, help="JSON lines file, appended to")
    parser.add_argument("--only", default="", help="comma-separated pattern names (default: all)")
    args = parser.parse_args(argv)

    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_corpus: --device cuda without a CUDA device", file=sys.stderr)
        return 2
    if args.mode == "syncdebug" and args.device != "cuda":
        print("gpu_corpus: the sync debug mode needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device(args.device)
    chosen = [BY_NAME[n] for n in args.only.split(",") if n] if args.only else PATTERNS
    runner = run_plugin if args.mode == "plugin" else run_syncdebug
    failed = 0
    for pattern in chosen:
        began = time.perf_counter()
        record: dict[str, Any] = {"mode": args.mode, "device": args.device, "pattern": pattern.name}
        try:
            record.update(runner(torch, dev, pattern))
        except Exception as exc:  # noqa: BLE001 - one broken pattern must not stop the others
            failed += 1
            record["error"] = f"{type(exc).__name__}: {exc}"
            record["traceback"] = traceback.format_exc()[-2000:]
        record["seconds"] = round(time.perf_counter() - began, 3)
        with open(args.out, "a", encoding="utf-8") as out:
            out.write(json.dumps(record) + "\n")
        print(f"gpu_corpus: {args.mode}/{args.device} {pattern.name}: {record.get('error', 'done')} "
              f"({record['seconds']} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
