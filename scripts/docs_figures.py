"""Draw the documentation's figures as SVG, from the recorded output of real runs (no plotting library).

- ``docs/figures/failing-report.svg``: the terminal output of ``docs/figures/data/failing-report-test_fit.py``
  (the getting-started page's failing example), recorded in ``docs/figures/data/failing-report.txt``;
- ``docs/figures/max-overhead-intervals.svg``: every run's overhead and 95% interval from
  ``benchmarks/bench_repeatability.py --json``, recorded in ``docs/figures/data/max-overhead-intervals.json``.

Re-record the data (slow, real runs), then redraw (fast, what CI checks is in step)::

    python scripts/docs_figures.py --record-report            # runs pytest on the example
    (cd benchmarks && python bench_repeatability.py --runs 6 --conditions quiet \\
        --json ../docs/figures/data/max-overhead-intervals.json)
    python scripts/docs_figures.py                            # redraw both SVGs
    python scripts/docs_figures.py --check                    # exit 1 when an SVG is out of date
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

ROOT = Path(__file__).resolve().parent.parent
FIGURES = ROOT / "docs" / "figures"
DATA = FIGURES / "data"
REPORT_TEXT = DATA / "failing-report.txt"
REPORT_TEST = DATA / "failing-report-test_fit.py"
INTERVALS = DATA / "max-overhead-intervals.json"

FONT = "ui-monospace, SFMono-Regular, Menlo, Consolas, 'DejaVu Sans Mono', monospace"
SANS = "system-ui, -apple-system, 'Segoe UI', Roboto, 'DejaVu Sans', sans-serif"
COLORS = {"text": "#d4d4d4", "red": "#f14c4c", "green": "#23d18b", "yellow": "#e5e510", "dim": "#8a8a8a",
          "bold": "#ffffff", "bg": "#1e1e1e"}
VERDICT_COLORS = {"passed": "#2e7d32", "failed": "#c62828", "inconclusive": "#ef6c00"}
WIDTH = 100  # terminal columns


def record_report() -> None:
    """Run the failing example under pytest and keep its output (the terminal report), as a user sees it."""
    with tempfile.TemporaryDirectory() as tmp:
        test = Path(tmp) / "test_fit.py"
        test.write_text(REPORT_TEST.read_text(encoding="utf-8"), encoding="utf-8")
        env = {**os.environ, "COLUMNS": str(WIDTH)}
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:logging", "-p", "no:warnings",
             "test_fit.py"], cwd=tmp, env=env, capture_output=True, text=True,
        )
        # As on a user's machine: the project and its virtual environment, not where this one was recorded.
        text = done.stdout.replace(tmp, "/home/you/project").replace(sys.prefix, "/home/you/project/.venv")
        REPORT_TEXT.write_text(text, encoding="utf-8")


def report_lines(text: str) -> list[tuple[str, str]]:
    """The parts of a session a reader looks at (the progress line, the failure report, torchperf's summary),
    wrapped at the terminal's width, each with its colour."""
    lines = text.splitlines()
    keep: list[str] = []
    skipping = False
    for line in lines:
        if line.startswith(("platform ", "rootdir:", "plugins:", "collected ")) or not line.strip():
            continue
        if line.startswith("-") and "Captured" in line:
            skipping = True
            continue
        if line.startswith("=") and skipping:
            skipping = False
        if skipping:
            continue
        keep.append(line)
    out: list[tuple[str, str]] = []
    for line in keep:
        indent = len(line) - len(line.lstrip())
        wrapped = textwrap.wrap(line, WIDTH, subsequent_indent=" " * (indent + 4), drop_whitespace=False) or [""]
        out.extend((part, _color(line)) for part in wrapped)
    return out


def _color(line: str) -> str:
    stripped = line.strip()
    if stripped.startswith(("=", "_")) or (stripped.startswith("-") and "torchperf" in stripped):
        return "red" if ("FAILURES" in line or "torchperf:" in line or "_ test" in line or "failed" in line) else "dim"
    if stripped.startswith(("torchperf: 1 invariant", "FAILED", "marker: no_host_sync")) or " T " in f" {line} ":
        return "red"
    if stripped.startswith(">") or "[your code]" in line:
        return "green"
    if stripped.startswith("hint:"):
        return "yellow"
    if stripped.startswith(("pytorch_lightning/", "...")):
        return "dim"
    if stripped.startswith(("on_device:", "no_iterator_reset:", "no_data_parallel:", "PASSED")):
        return "green"
    return "text"


def failing_report_svg(text: str) -> str:
    lines = report_lines(text)
    char_w, line_h, pad = 7.8, 16, 14
    width = int(WIDTH * char_w + 2 * pad)
    height = int(len(lines) * line_h + 2 * pad + 24)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="The terminal report of a test that torchperf failed: .item() in training_step">',
        f'<rect width="{width}" height="{height}" rx="8" fill="{COLORS["bg"]}"/>',
        f'<circle cx="{pad + 6}" cy="14" r="5" fill="#ff5f56"/><circle cx="{pad + 22}" cy="14" r="5" fill="#ffbd2e"/>'
        f'<circle cx="{pad + 38}" cy="14" r="5" fill="#27c93f"/>',
        f'<text x="{width / 2}" y="18" fill="{COLORS["dim"]}" font-family="{SANS}" font-size="12" '
        f'text-anchor="middle">pytest test_fit.py</text>',
        f'<g font-family="{FONT}" font-size="13" xml:space="preserve">',
    ]
    for i, (line, color) in enumerate(lines):
        y = pad + 24 + (i + 1) * line_h - 4
        parts.append(f'<text x="{pad}" y="{y}" fill="{COLORS[color]}">{escape(line)}</text>')
    parts += ["</g>", "</svg>"]
    return "\n".join(parts) + "\n"


def intervals_svg(data: dict[str, Any]) -> str:
    """One row per run: the overhead (dot) and its 95% interval (bar), grouped by case, the threshold a line."""
    cases: dict[str, list[dict[str, Any]]] = {}
    for case, items in data["runs"]["quiet"].items():
        threshold = data["near_threshold"] if case.startswith("(c)") else data["threshold"]
        cases[case] = [{**run, "threshold": threshold} for run in items]
    runs = [run for items in cases.values() for run in items]
    waits = sorted(run["cpu_wait"] or 0.0 for run in runs)
    lows = [r["interval"][0] for r in runs] + [0.0]
    highs = [r["interval"][1] for r in runs] + [r["threshold"] for r in runs]
    lo, hi = min(lows), max(highs) * 1.08
    left, right, top, row_h, gap = 210, 30, 112, 14, 26
    width = 900
    plot_w = width - left - right
    n_rows = sum(len(v) for v in cases.values())
    height = top + n_rows * row_h + gap * len(cases) + 70

    def x(value: float) -> float:
        return left + (value - lo) / (hi - lo) * plot_w

    recorded = str(data.get("recorded", "")).split(", ", 1)
    machine = [
        f"{recorded[0]}: {len(runs) // max(len(cases), 1)} runs per case, {data['cpus']} CPUs, fits with "
        f"{data['torch_threads']} torch threads; our threads waited for a CPU {waits[len(waits) // 2]:.0%} of their "
        "runnable time (median)",
        recorded[1] if len(recorded) > 1 else "",
    ]
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
        f'role="img" aria-label="max_overhead: each run\'s overhead and 95% interval against its threshold" '
        f'font-family="{SANS}" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
        '<text x="16" y="24" font-size="15" font-weight="600" fill="#212121">max_overhead: the same fit timed '
        'again and again (dot: the overhead; bar: its 95% interval)</text>',
        f'<text x="16" y="44" fill="#616161">{escape(machine[0])}</text>',
        f'<text x="16" y="60" fill="#616161">{escape(machine[1])}</text>',
    ]
    step = 0.2 if hi - lo > 0.6 else 0.1
    tick = 0.0
    axis_y = height - 48
    while tick <= hi:
        if tick >= lo:
            parts.append(f'<line x1="{x(tick):.1f}" y1="{top - 8}" x2="{x(tick):.1f}" y2="{axis_y}" stroke="#eeeeee"/>')
            parts.append(f'<text x="{x(tick):.1f}" y="{axis_y + 16}" text-anchor="middle" fill="#616161">'
                         f'+{tick:.0%}</text>')
        tick = round(tick + step, 6)
    parts.append(f'<text x="{left + plot_w / 2}" y="{axis_y + 36}" text-anchor="middle" fill="#424242">'
                 'Lightning epoch over the plain loop of the same module (geometric mean of paired ratios)</text>')
    y = top
    for case, items in cases.items():
        threshold = items[0]["threshold"]
        block_h = len(items) * row_h
        parts.append(f'<text x="{left - 12}" y="{y + block_h / 2 + 4:.1f}" text-anchor="end" fill="#212121">'
                     f'{escape(case)}</text>')
        parts.append(f'<line x1="{x(threshold):.1f}" y1="{y - 6}" x2="{x(threshold):.1f}" y2="{y + block_h + 2}" '
                     'stroke="#212121" stroke-dasharray="4 3"/>')
        parts.append(f'<text x="{x(threshold) + 4:.1f}" y="{y - 8}" fill="#212121" font-size="11">threshold '
                     f'{threshold:.1%}</text>')
        for i, run in enumerate(items):
            cy = y + i * row_h + row_h / 2
            color = VERDICT_COLORS.get(run["verdict"], "#757575")
            a, b = run["interval"]
            parts.append(f'<line x1="{x(a):.1f}" y1="{cy:.1f}" x2="{x(b):.1f}" y2="{cy:.1f}" stroke="{color}" '
                         'stroke-width="3" stroke-linecap="round"/>')
            parts.append(f'<circle cx="{x(run["overhead"]):.1f}" cy="{cy:.1f}" r="3.5" fill="{color}"/>')
        y += block_h + gap
    legend_x = left
    for verdict, color in VERDICT_COLORS.items():
        parts.append(f'<rect x="{legend_x}" y="76" width="12" height="4" fill="{color}"/>')
        parts.append(f'<text x="{legend_x + 16}" y="81" fill="#424242" font-size="11">{verdict}</text>')
        legend_x += 100
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def figures() -> dict[Path, str]:
    return {
        FIGURES / "failing-report.svg": failing_report_svg(REPORT_TEXT.read_text(encoding="utf-8")),
        FIGURES / "max-overhead-intervals.svg": intervals_svg(json.loads(INTERVALS.read_text(encoding="utf-8"))),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when an SVG is out of date")
    parser.add_argument("--record-report", action="store_true", help="re-run the failing example first")
    args = parser.parse_args()
    if args.record_report:
        record_report()
    stale = []
    for path, svg in figures().items():
        if path.exists() and path.read_text(encoding="utf-8") == svg:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(svg, encoding="utf-8")
    if args.check and stale:
        print(f"out of date: {', '.join(map(str, stale))}: run python scripts/docs_figures.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
