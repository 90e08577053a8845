"""Cross-check ``cuda_graph_ready`` against real CUDA-graph captures, on a machine with CUDA.

For each case (a blocker, or its clean twin) the script, in a subprocess of its own (a failed capture can
poison the CUDA context):

(a) runs three training steps under ``pytest_torchperf.watch(cuda_graph_ready=True)`` and records the verdict;
(b) warms the same step up on a side stream, then captures one step with ``torch.cuda.graph(...)`` and
    replays it, recording whether the capture succeeded (and the error).

It prints a markdown table (case | plugin verdict | real capture | agree?) and writes it to ``--out``.
Without CUDA it exits 2. Usage::

    python scripts/gpu_crosscheck_cuda_graphs.py --out crosscheck.md [--case item ...] [--timeout 60]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any, Callable

#: The step bodies: ``(x, y, model, opt) -> loss``; each blocker's clean twin is named ``<blocker>_clean``.
#: ``ragged`` is judged on its batches' shapes (the capture is tried with the second shape on the graph).
CASES = (
    "clean", "item", "item_clean", "mask", "mask_clean", "nonzero", "unique", "built", "built_clean",
    "randn", "randn_clean", "python_random", "synchronize", "empty_cache", "adam", "adam_clean",
    "ragged", "ragged_clean",
)
#: Cases whose real outcome is judged without a capture failing: the capture succeeds but the replay is
#: wrong (it repeats the captured host values, or it cannot take another shape).
SILENT = {
    "randn": "replay repeats the captured values",
    "python_random": "replay repeats the captured values",
    "ragged": "a graph takes one shape",
}


def step_for(case: str) -> Callable[..., Any]:
    import random

    import torch
    import torch.nn.functional as F

    def body(x: Any, y: Any, model: Any, opt: Any) -> Any:
        if case == "item" and x.sum().item() > 1e9:
            x = x / 2
        elif case == "item_clean":
            x = torch.where(x.sum() > 1e9, x / 2, x)
        elif case == "mask":
            x = x - x[x > 0].mean()
        elif case == "mask_clean":
            mask = x > 0
            x = x - (x * mask).sum() / mask.sum().clamp(min=1)
        elif case == "nonzero":
            x = x + x.nonzero().shape[0]
        elif case == "unique":
            x = x + torch.unique((x > 0).long()).numel()
        elif case == "built":
            x = x * torch.tensor([0.5, 2.0]).repeat(4).to(x.device)
        elif case == "built_clean":
            x = x * torch.full((8,), 2.0, device=x.device)
        elif case == "randn":
            x = x + torch.randn(8).to(x.device)
        elif case == "randn_clean":
            x = x + torch.randn(8, device=x.device)
        elif case == "python_random":
            x = x * torch.tensor([random.random() for _ in range(8)]).to(x.device)
        elif case == "synchronize":
            torch.cuda.synchronize()
        elif case == "empty_cache":
            torch.cuda.empty_cache()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss

    return body


def optimizer_for(case: str, params: Any) -> Any:
    import torch

    if case == "adam":
        return torch.optim.Adam(params, lr=0.01)
    if case == "adam_clean":
        return torch.optim.Adam(params, lr=0.01, capturable=True)
    return torch.optim.SGD(params, lr=0.01)


def one_case(case: str) -> dict[str, Any]:
    """Run one case in this process: the plugin's verdict, then a real capture."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from pytest_torchperf import InvariantViolation, watch

    out: dict[str, Any] = {"case": case}
    dev = torch.device("cuda")
    body = step_for(case)
    n = 10 if case == "ragged" else 12  # 10 in batches of 4: a last batch of 2

    # (a) the plugin's verdict on three or more watched steps
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(dev)
    opt = optimizer_for(case, model.parameters())
    loader = DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=4)
    try:
        with watch(cuda_graph_ready=True, no_host_sync=False, on_device=False, no_iterator_reset=False) as run:
            for x, y in loader:
                with run.step():
                    body(x.to(dev), y.to(dev), model, opt)
        report = run.report
    except InvariantViolation as exc:
        report = exc.report
    check = report["cuda_graph_ready"]
    out["plugin"] = check.status
    out["plugin_summary"] = check.summary
    torch.cuda.synchronize()

    # (b) a real capture: warm-up on a side stream, capture one step, replay
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(dev)
    opt = optimizer_for(case, model.parameters())
    static_x = torch.randn(4, 8, device=dev)
    static_y = torch.randn(4, 1, device=dev)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                body(static_x, static_y, model, opt)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_loss = body(static_x, static_y, model, opt)
        graph.replay()
        torch.cuda.synchronize()
        out["capture"] = "captured"
        out["capture_error"] = ""
        if case in ("randn", "python_random"):
            first = static_x.clone()
            graph.replay()
            torch.cuda.synchronize()
            out["capture_error"] = f"replayed; loss {float(static_loss):.4f}"
            del first
        if case == "ragged":
            try:
                static_x.resize_(2, 8)  # the last batch's shape on a captured graph
                graph.replay()
                torch.cuda.synchronize()
                out["capture_error"] = "replay after a shape change ran on stale sizes"
            except Exception as exc:  # noqa: BLE001
                out["capture_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    except Exception as exc:  # noqa: BLE001 - the capture's failure is the result
        out["capture"] = "failed"
        out["capture_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
    return out


def expected_capture(case: str, captured: str) -> str:
    """What a real capture says of the step: ``blocked`` when it failed or the case's replay is silently wrong."""
    if captured == "failed":
        return "blocked"
    return "blocked (silently)" if case in SILENT else "ok"


def agree(plugin: str, capture: str) -> bool:
    return (plugin == "failed") == capture.startswith("blocked")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| case | plugin verdict | real capture | agree? |", "|---|---|---|---|"]
    for r in rows:
        real = expected_capture(r["case"], r.get("capture", "error"))
        detail = r.get("capture_error", "")
        if r.get("capture") == "captured" and r["case"] in SILENT:
            detail = SILENT[r["case"]] + (f"; {detail}" if detail else "")
        cell = f"{real}" + (f": {detail}" if detail else "")
        plugin = r.get("plugin", "error") + (f" ({r['plugin_summary']})" if r.get("plugin_summary") else "")
        ok = "yes" if r.get("plugin") and agree(r["plugin"], real) else "NO"
        lines.append(f"| {r['case']} | {plugin.replace('|', '/')} | {cell.replace('|', '/')} | {ok} |")
    return "\n".join(lines)


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the markdown file the table is written to")
    parser.add_argument("--case", action="append", choices=CASES, help="run only these cases (repeatable)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per case (default 60)")
    parser.add_argument("--one", choices=CASES, help=argparse.SUPPRESS)  # a case's subprocess
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    if args.one:
        print(json.dumps(one_case(args.one)))
        return 0
    import torch

    if not torch.cuda.is_available():
        print("gpu_crosscheck_cuda_graphs: CUDA is not available here: the cross-check needs a GPU", file=sys.stderr)
        return 2
    rows = []
    start = time.monotonic()
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    for case in args.case or CASES:
        try:
            done = subprocess.run(
                [sys.executable, os.path.abspath(__file__), "--out", args.out, "--one", case],
                capture_output=True, text=True, timeout=args.timeout, env=env,
            )
            line = next((ln for ln in reversed(done.stdout.splitlines()) if ln.startswith("{")), None)
            last = (done.stderr.strip().splitlines() or ["?"])[-1][:200]
            row = json.loads(line) if line else {"case": case, "capture": "error", "capture_error": last}
        except subprocess.TimeoutExpired:
            row = {"case": case, "capture": "error", "capture_error": f"timed out after {args.timeout:g} s"}
        rows.append(row)
        print(f"{case}: {row.get('plugin')} / {row.get('capture')} {row.get('capture_error', '')}", file=sys.stderr)
    text = table(rows)
    text += f"\n\ntorch {torch.__version__}, {torch.cuda.get_device_name()}, {time.monotonic() - start:.0f} s\n"
    print(text)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(text)
    agreed = [r.get("plugin") and agree(r["plugin"], expected_capture(r["case"], r.get("capture", ""))) for r in rows]
    return 0 if all(agreed) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
