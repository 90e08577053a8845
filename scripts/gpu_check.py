"""GPU check: run the CUDA paths on a machine with a CUDA GPU and write one summary file.

    python3 scripts/gpu_check.py --out DIR             # on a GPU machine: about 3-5 minutes
    python3 scripts/gpu_check.py --out DIR --cpu-dry-run   # the same plumbing on a CPU, CUDA columns "no CUDA"

It uses the Python that runs it as it is: that interpreter must already have a CUDA build of torch (and
pytest; Lightning for the examples and ``max_overhead``). Nothing is installed or downloaded. The plugin is
loaded from this working tree, installed or not: a metadata stub on ``PYTHONPATH`` declares its pytest
entry point, so every pytest process (the suite's ``pytester`` runs and subprocesses included) loads it as
if installed (``-p pytest_torchperf.glue.plugin`` would reach the outer session only, and collides with an
installed copy).

What it runs, each part in its own process with a time limit, all within ``--budget`` seconds:

- ``corpus``: the cross-check (``scripts/gpu_corpus.py``): every sync pattern the plugin claims, judged by
  the plugin on a CPU-only run (CUDA hidden), by the plugin on CUDA, and by
  ``torch.cuda.set_sync_debug_mode("warn")`` alone; a table of where they agree, each disagreement explained;
- ``invariants``: the GPU-only invariants on buggy/fixed twins (``scripts/gpu_invariants.py``);
- ``tests``: every CUDA-gated test (``scripts/cuda_gated.py``);
- ``examples``: the example suites (each ``*_buggy`` must fail, each ``*_fixed`` pass), on the GPU;
- ``crosschecks``: every ``scripts/gpu_crosscheck_*.py`` (``--out FILE``; exit 2 means no CUDA).

``DIR/summary.md`` is rewritten after every part (a run cut short keeps what it had), beside
``results.json`` (every record) and ``log.txt`` (every process's output).

Exit status: 0 every part ran as expected, 1 a part failed or ran out of time, 2 no CUDA GPU here (without
``--cpu-dry-run``), 3 the GPU is there but this Python's torch cannot use it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Optional

#: Each `scripts/gpu_crosscheck_*.py` gets this long (the CUDA-graph one runs 18 cases, a process each:
#: about 11 s a case on an H200, so 120 s cut it short at 11 cases).
CROSSCHECK_SECONDS = 240

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
sys.path.insert(0, str(SCRIPTS))

import gpu_corpus  # noqa: E402 - beside this script; imports no torch

PARTS = ("info", "corpus", "invariants", "tests", "examples", "crosschecks")
NO_CUDA = "no CUDA"
#: Characters of one process's output kept in log.txt (its start and its end).
LOG_LIMIT = 60_000
#: Example suites run on the GPU; the seed bug needs pytorch-lightning 1.5 (scripts/run-examples.sh) and no GPU.
EXAMPLE_SUITES = ("examples/dataloaders", "examples/step_checks", "examples/seed_tips")
CUSTOM_INVARIANT = ROOT / "examples" / "custom_invariant"

INFO = r"""
import datetime, glob, json, os, re, sys
import importlib.metadata as md
info = {"python": sys.version.split()[0], "executable": sys.executable,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
for name in ("pytest", "pytest-xdist", "pytorch-lightning", "lightning", "transformers", "accelerate"):
    try:
        info[name] = md.version(name)
    except md.PackageNotFoundError:
        info[name] = None
stub = os.environ.get("GPU_CHECK_STUB", "")
info["plugin_installed"] = sorted({
    str(getattr(d, "_path", "?")) for d in md.distributions()
    if (d.metadata["Name"] or "").lower() == "pytest-torchperf" and not str(getattr(d, "_path", "")).startswith(stub)
})
import pytest_torchperf
info["plugin"] = pytest_torchperf.__version__
info["plugin_from"] = os.path.dirname(pytest_torchperf.__file__)
import torch
info["torch"] = torch.__version__
info["torch_cuda"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
try:
    p = torch.cuda.get_device_properties(0) if info["cuda_available"] else None
except Exception as exc:
    info["cuda_error"], p = repr(exc), None
if p is not None:
    info["device"] = p.name
    info["capability"] = "%d.%d" % (p.major, p.minor)
    info["memory_gib"] = round(p.total_memory / 2**30, 1)
    info["device_count"] = torch.cuda.device_count()
    info["cudnn"] = torch.backends.cudnn.version()
    try:
        info["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:
        info["nccl"] = None
include = os.path.join(os.path.dirname(torch.__file__), "include")
calls = []
headers = [h for sub in ("c10", "ATen") for h in glob.glob(os.path.join(include, sub, "cuda", "*.h"))]
for path in sorted(headers):
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError:
        continue
    for number, text in enumerate(lines, 1):
        if "warn_or_error_on_sync()" not in text or "C10_CUDA_API void warn_or_error_on_sync" in text:
            continue
        function = "?"
        for above in reversed(lines[:number - 1]):
            found = re.findall(r"(\w+)\(", above) if above[:1] not in (" ", "\t", "/", "#", "") else []
            if found:
                function = found[0]
                break
        calls.append("%s:%d in %s" % (os.path.relpath(path, include), number, function))
info["sync_warning_calls"] = calls
print("GPU_CHECK_INFO " + json.dumps(info))
"""


# -- processes --------------------------------------------------------------------------------------------


class Runner:
    """Runs each part's process in its own session with a time limit, within one deadline; logs everything."""

    def __init__(self, log: Path, deadline: float) -> None:
        self.log = log
        self.deadline = deadline
        self.lock = threading.RLock()  # RLock: the SIGTERM handler may run while this thread holds it
        self.active: set[subprocess.Popen[bytes]] = set()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, name: str, command: list[str], env: dict[str, str], limit: float) -> dict[str, Any]:
        limit = min(limit, self.left())
        began = time.monotonic()
        if limit < 5:
            self._write(name, command, "not started: the budget is spent\n")
            return {"rc": None, "seconds": 0.0, "output": "", "status": "not run (budget spent)"}
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                start_new_session=True)
        with self.lock:
            self.active.add(proc)
        timed_out = False
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(proc)
            out, _ = proc.communicate()
        finally:
            with self.lock:
                self.active.discard(proc)
        text = out.decode("utf-8", errors="replace")
        seconds = round(time.monotonic() - began, 1)
        logged = text
        if len(text) > LOG_LIMIT:
            left_out = f"\n[... {len(text) - LOG_LIMIT} characters left out ...]\n"
            logged = text[: LOG_LIMIT // 5] + left_out + text[-LOG_LIMIT * 4 // 5:]
        self._write(name, command, logged + f"\n[{name}: rc {proc.returncode}, {seconds} s"
                                          f"{', timed out' if timed_out else ''}]\n")
        if timed_out:
            status = f"timed out after {limit:.0f} s"
        else:
            status = "ok" if proc.returncode == 0 else f"rc {proc.returncode}"
        return {"rc": None if timed_out else proc.returncode, "seconds": seconds, "output": text, "status": status}

    def kill_all(self) -> None:
        with self.lock:
            procs = list(self.active)
        for proc in procs:
            self._kill(proc)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def _write(self, name: str, command: list[str], text: str) -> None:
        with self.lock, self.log.open("a", encoding="utf-8") as log:
            log.write(f"\n===== {name}: {' '.join(command)}\n{text}")


def make_stub(where: Path) -> Path:
    """A ``site`` folder whose metadata declares the plugin's entry points (the package itself stays in the tree)."""
    site = where / "site"
    version = re.search(r'__version__\s*=\s*"([^"]+)"', (ROOT / "pytest_torchperf" / "_version.py").read_text())
    entry_points = "[pytest11]\ntorchperf = pytest_torchperf.glue.plugin\n"
    _dist_info(site, "pytest-torchperf", version.group(1) if version else "0", entry_points)
    return site


def make_custom_invariant_stub(where: Path) -> Optional[Path]:
    """The same for examples/custom_invariant (its ``pytest_torchperf.invariants`` entry point), or None."""
    try:
        import tomllib
    except ImportError:  # Python < 3.11
        return None
    project = tomllib.loads((CUSTOM_INVARIANT / "pyproject.toml").read_text())["project"]
    groups = project.get("entry-points", {})
    text = "".join(f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in points.items())
                   for group, points in groups.items())
    site = where / "custom-site"
    _dist_info(site, project["name"], project["version"], text)
    return site


def _dist_info(site: Path, name: str, version: str, entry_points: str) -> None:
    folder = site / f"{name.replace('-', '_')}-{version}.dist-info"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (folder / "entry_points.txt").write_text(entry_points)


def junit_cases(path: Path) -> list[dict[str, str]]:
    """``[{id, outcome, message}]`` from a JUnit XML file ([] when pytest wrote none)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return []
    cases = []
    for case in root.iter("testcase"):
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome, message = {"failure": "failed"}.get(tag, tag), element.get("message", "")
                break
        cases.append({"id": f"{case.get('classname')}::{case.get('name')}", "outcome": outcome,
                      "message": message.splitlines()[0][:200] if message else ""})
    return cases


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            pass
    return records


# -- the summary ------------------------------------------------------------------------------------------


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(head: list[str], rows: list[list[Any]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def plugin_cell(record: Optional[dict[str, Any]], line: str) -> tuple[str, Optional[bool]]:
    """The plugin's verdict in words, and whether it blamed the pattern (its line, or the loader via pin_memory)."""
    if record is None:
        return "not run", None
    if record.get("error"):
        return f"error: {record['error'][:120]}", None
    parts, flagged, elsewhere = [], False, []
    for name, check in record.get("checks", {}).items():
        status = check["status"]
        at_line = [s for s in check["sites"] if s["where"] == line]
        if name == "pin_memory":
            if status == "failed":
                flagged = True
                parts.append("pin_memory failed")
            continue
        for site in check["sites"]:
            if site["where"] and site["where"] != line:
                elsewhere.append(f"{name} {site['label']} @ {site['where']}")
        if at_line:
            flagged = True
            site = at_line[0]
            confirmed = " (CUDA-confirmed)" if site["confirmed"] else ""
            parts.append(f"{name} {status}: {site['label']} ×{site['count']}{confirmed}")
        elif status == "failed":
            parts.append(f"{name} failed elsewhere")
    if elsewhere:
        parts.append("also " + "; ".join(elsewhere[:3]))
    return "; ".join(parts) or "passed", flagged


def cuda_cell(record: Optional[dict[str, Any]], line: str) -> tuple[str, Optional[bool]]:
    if record is None:
        return "not run", None
    if record.get("error"):
        return f"error: {record['error'][:120]}", None
    warnings_ = record.get("warnings", [])
    at_line = [w for w in warnings_ if w["where"] == line]
    others = [f"{w['where']} ×{w['count']}" for w in warnings_ if w["where"] != line]
    text = f"warns ×{at_line[0]['count']}" if at_line else "silent"
    if at_line and at_line[0].get("via"):
        text += f" (raised inside {', '.join(at_line[0]['via'][:2])})"
    if others:
        text += " (also " + "; ".join(others[:3]) + ")"
    return text, bool(at_line)


def agreement(plugin: Optional[bool], cuda: Optional[bool], pattern: gpu_corpus.Pattern) -> tuple[str, str]:
    """``(agree?, why)``: a sync only CUDA sees is a defect unless the pattern names it as a known gap."""
    if plugin is None or cuda is None:
        return "—", ""
    if plugin == cuda:
        return "yes", ""
    side = "cuda" if cuda else "plugin"
    default = ("DEFECT: CUDA reports a sync the plugin misses" if cuda else
               "the plugin reports a sync CUDA does not see: a wrong CPU-side proxy or a gap of the debug mode "
               "(unexplained)")
    return ("no: CUDA only" if cuda else "no: plugin only"), pattern.gaps.get(side, default)


class Summary:
    """Everything learned so far, rendered to ``summary.md`` after each part (atomically)."""

    def __init__(self, out: Path, dry_run: bool, budget: float, patterns: str = "") -> None:
        self.out = out
        self.patterns = patterns
        self.dry_run = dry_run
        self.budget = budget
        self.began = time.monotonic()
        self.lock = threading.RLock()  # RLock: the SIGTERM handler may run while this thread holds it
        self.info: dict[str, Any] = {}
        self.parts: dict[str, dict[str, Any]] = {}
        self.corpus: dict[str, list[dict[str, Any]]] = {}
        self.invariants: list[dict[str, Any]] = []
        self.tests: list[dict[str, str]] = []
        self.examples: list[dict[str, str]] = []
        self.crosschecks: list[dict[str, Any]] = []

    def part(self, name: str, result: dict[str, Any]) -> None:
        with self.lock:
            self.parts[name] = {k: v for k, v in result.items() if k != "output"}
        self.write()

    def ok(self) -> bool:
        return all(p["status"] in ("ok", "no CUDA") for p in self.parts.values())

    def write(self) -> None:
        with self.lock:  # both lanes write: one at a time
            text = "\n".join(self.render()) + "\n"
            data = {"info": self.info, "parts": self.parts, "corpus": self.corpus, "invariants": self.invariants,
                    "tests": self.tests, "examples": self.examples, "crosschecks": self.crosschecks}
            for name, content in (("summary.md", text), ("results.json", json.dumps(data, indent=1, default=str))):
                tmp = self.out / f".{name}.tmp"
                tmp.write_text(content, encoding="utf-8")
                os.replace(tmp, self.out / name)

    def render(self) -> list[str]:
        i = self.info
        elapsed = time.monotonic() - self.began
        title = "GPU check (CPU dry run: the CUDA columns say \"no CUDA\")" if self.dry_run else "GPU check"
        lines = [f"# {title}", "",
                 f"{i.get('date', '?')}; {elapsed:.0f} s so far of a {self.budget:.0f} s budget; "
                 f"parts finished: {', '.join(self.parts) or 'none yet'}.", ""]
        driver = f"{i['driver']}, CUDA {i.get('driver_cuda', '?')}" if i.get("driver") else NO_CUDA
        capability = f"{i['capability']}, {i.get('memory_gib', '?')} GiB" if i.get("capability") else NO_CUDA
        lines += table(["", ""], [
            ["GPU", i.get("gpu") or i.get("device") or NO_CUDA],
            ["driver (nvidia-smi)", driver],
            ["compute mode", i.get("compute_mode", NO_CUDA)],
            ["compute capability, memory", capability],
            ["torch", f"{i.get('torch', '?')} (CUDA {i.get('torch_cuda')}, cuDNN {i.get('cudnn', '-')})"],
            ["Python", f"{i.get('python', '?')} ({i.get('executable', '?')})"],
            ["pytest, Lightning, transformers, accelerate",
             ", ".join(str(i.get(k)) for k in ("pytest", "pytorch-lightning", "transformers", "accelerate"))],
            ["plugin", f"{i.get('plugin', '?')} from {i.get('plugin_from', 'the working tree')} "
                       f"({i.get('commit', 'commit unknown')}); "
                       f"installed copies: {', '.join(i.get('plugin_installed') or []) or 'none'}"],
        ])
        lines += ["", "## Parts", ""]
        lines += table(["part", "status", "seconds"], [[n, p["status"], p["seconds"]] for n, p in self.parts.items()])
        lines += self._corpus() + self._invariants()
        lines += self._junit("CUDA-gated tests", self.tests, expected=None)
        lines += self._junit("Example suites on this machine's device", self.examples, expected=True)
        lines += self._crosschecks() + self._gaps()
        return lines

    def _corpus(self) -> list[str]:
        lines = ["", "## Cross-check: the plugin's claims against CUDA's sync debug mode", "",
                 "Each pattern is one training step run 6 times (`scripts/gpu_corpus.py`; the line is the "
                 "pattern's marked line). *CPU-only run*: the plugin with CUDA hidden, the claim under test. "
                 "*Plugin on CUDA*: the plugin on the GPU (it also listens to the debug mode). *CUDA sync debug*: "
                 "`torch.cuda.set_sync_debug_mode(\"warn\")` inside each step, no plugin. *agree?* compares the "
                 "CPU-only run with CUDA, then the plugin on CUDA with CUDA.", ""]
        by_mode = {mode: {r["pattern"]: r for r in records} for mode, records in self.corpus.items()}
        rows = []
        chosen = set(filter(None, self.patterns.split(",")))
        for pattern in gpu_corpus.PATTERNS:
            if chosen and pattern.name not in chosen:
                continue
            line = f"gpu_corpus.py:{pattern.line}"
            cpu_text, cpu_flag = plugin_cell(by_mode.get("plugin-cpu", {}).get(pattern.name), line)
            if self.dry_run:
                gpu_text, gpu_flag, dbg_text, dbg_flag = NO_CUDA, None, NO_CUDA, None
            else:
                gpu_text, gpu_flag = plugin_cell(by_mode.get("plugin-cuda", {}).get(pattern.name), line)
                dbg_text, dbg_flag = cuda_cell(by_mode.get("syncdebug", {}).get(pattern.name), line)
            agree_cpu, why_cpu = agreement(cpu_flag, dbg_flag, pattern)
            agree_gpu, why_gpu = agreement(gpu_flag, dbg_flag, pattern)
            why = "; ".join(dict.fromkeys(w for w in (why_cpu, why_gpu) if w))
            rows.append([f"`{pattern.name}` ({pattern.claim or 'clean'})", f":{pattern.line}", cpu_text, gpu_text,
                         dbg_text, f"{agree_cpu} / {agree_gpu}", why])
        return lines + table(["pattern (claimed by)", "line", "plugin, CPU-only run", "plugin on CUDA",
                              "CUDA sync debug", "agree? (CPU / CUDA run)", "why they differ"], rows)

    def _invariants(self) -> list[str]:
        lines = ["", "## GPU-only invariants on buggy and fixed twins", "",
                 "`scripts/gpu_invariants.py`: every other invariant off; a twin's verdict against what it "
                 "should be.", ""]
        rows = []
        for r in self.invariants:
            got = r.get("status")
            note = r.get("error") or r.get("summary", "")
            if r["invariant"] == "max_overhead" and r.get("figures"):
                fits = re.findall(r'"(device|unit)": "([^"]*)"', r["figures"])
                note += " [" + ", ".join(f"{k} {v}" for k, v in dict(fits).items()) + "]" if fits else ""
            rows.append([r["invariant"], r["twin"], r.get("device"), r.get("expected"), got,
                         "yes" if got == r.get("expected") else "**no**", note, r.get("seconds")])
        head = ["invariant", "twin", "device", "expected", "verdict", "as expected", "summary", "s"]
        return lines + table(head, rows)

    def _junit(self, title: str, cases: list[dict[str, str]], expected: Optional[bool]) -> list[str]:
        lines = ["", f"## {title}", ""]
        if not cases:
            return lines + ["(no result: not run yet, or pytest wrote no report; see log.txt)"]
        counts: dict[str, int] = {}
        for c in cases:
            counts[c["outcome"]] = counts.get(c["outcome"], 0) + 1
        lines += [", ".join(f"{n} {k}" for k, n in sorted(counts.items())) + f" of {len(cases)}", ""]
        if expected:
            rows = [[c["id"], c["expected"], c["outcome"], "yes" if c["ok"] else "**no**", c["message"]] for c in cases]
            return lines + table(["test", "expected", "outcome", "as expected", "message"], rows)
        return lines + table(["test", "outcome", "message"], [[c["id"], c["outcome"], c["message"]] for c in cases])

    def _crosschecks(self) -> list[str]:
        lines = ["", "## Other cross-checks (`scripts/gpu_crosscheck_*.py`)", ""]
        if not self.crosschecks:
            return lines + ["(none present, or not run yet)"]
        for c in self.crosschecks:
            lines += [f"### {c['script']}: {c['status']} ({c['seconds']} s)", "",
                      c["text"].rstrip() or "(no output)", ""]
        return lines

    def _gaps(self) -> list[str]:
        calls = self.info.get("sync_warning_calls")
        lines = ["", "## Where the sync debug mode can warn (the installed torch's headers)", ""]
        if not calls:
            return lines + ["(no header found, or not read yet)"]
        return lines + [f"`warn_or_error_on_sync()` is called at: {', '.join(calls)}. A synchronising call that "
                        "goes through neither (`cudaDeviceSynchronize`, `cudaEventSynchronize`, a pageable "
                        "`cudaMemcpyAsync`, `cudaHostAlloc` when pinning) is not reported by the debug mode."]


# -- the parts --------------------------------------------------------------------------------------------


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        for stale in ("summary.md", "results.json", "log.txt"):
            (self.out / stale).unlink(missing_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.python = args.python
        self.dry_run = args.cpu_dry_run
        self.runner = Runner(self.out / "log.txt", time.monotonic() + args.budget)
        self.summary = Summary(self.out, self.dry_run, args.budget, args.patterns)
        stub = make_stub(self.tmp)
        paths = [str(ROOT), str(SCRIPTS), str(stub)]
        paths += [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "GPU_CHECK_STUB": str(stub),
                    "PYTHONUNBUFFERED": "1"}
        if self.dry_run:
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.device = "cpu" if self.dry_run else "cuda"
        # A module that cannot be imported here (a framework this machine lacks) must not stop the others,
        # nor one hung test (a collective waiting forever) the rest of its part.
        self.pytest_options = ["--continue-on-collection-errors"]
        if importlib.util.find_spec("pytest_timeout") is not None and args.python == sys.executable:
            self.pytest_options.append("--timeout=100")

    def selected(self, part: str) -> bool:
        return part in self.args.parts

    def info(self) -> bool:
        """The machine, the versions; False when torch cannot use the GPU (not in a dry run)."""
        info = self.summary.info
        smi = shutil.which("nvidia-smi")
        if smi and not self.dry_run:
            query = subprocess.run([smi, "--query-gpu=name,driver_version,memory.total,compute_mode",
                                    "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
            fields = [f.strip() for f in query.stdout.splitlines()[0].split(",")] if query.stdout.strip() else []
            if len(fields) == 4:
                info.update(gpu=f"{fields[0]} ({fields[2]})", driver=fields[1], compute_mode=fields[3])
            header = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
            found = re.search(r"CUDA Version:\s*([0-9.]+)", header)
            info["driver_cuda"] = found.group(1) if found else "?"
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        if commit.returncode == 0:
            info["commit"] = "commit " + commit.stdout.strip()
        result = self.runner.run("info", [self.python, "-c", INFO], self.env, 90)
        for line in result["output"].splitlines():
            if line.startswith("GPU_CHECK_INFO "):
                info.update(json.loads(line[len("GPU_CHECK_INFO "):]))
        if not info.get("date"):
            info["date"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        self.summary.part("info", result)
        return self.dry_run or bool(info.get("cuda_available"))

    def corpus(self, mode: str) -> None:
        """One of the three runs of the corpus: ``plugin-cpu`` (CUDA hidden), ``plugin-cuda``, ``syncdebug``."""
        path = self.tmp / f"corpus-{mode}.jsonl"
        env = dict(self.env)
        if mode == "plugin-cpu":
            env["CUDA_VISIBLE_DEVICES"] = ""
        command = [self.python, str(SCRIPTS / "gpu_corpus.py"), "--mode", mode.split("-")[0],
                   "--device", "cpu" if mode == "plugin-cpu" else "cuda", "--out", str(path)]
        if self.args.patterns:
            command += ["--only", self.args.patterns]
        result = self.runner.run(f"corpus {mode}", command, env, 90)
        with self.summary.lock:
            self.summary.corpus[mode] = read_jsonl(path)
        self.summary.part(f"corpus {mode}", result)

    def invariants(self) -> None:
        path = self.tmp / "invariants.jsonl"
        command = [self.python, str(SCRIPTS / "gpu_invariants.py"), "--device", self.device, "--out", str(path)]
        if self.args.invariants:
            command += ["--only", self.args.invariants]
        result = self.runner.run("invariants", command, self.env, 150)
        with self.summary.lock:
            self.summary.invariants = read_jsonl(path)
        self.summary.part("invariants", result)

    def tests(self) -> None:
        junit = self.tmp / "tests.xml"
        command = [self.python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "cuda_gated", "--cuda-gated", "-q",
                   "-rs", f"--junitxml={junit}", "tests"] + self.pytest_options
        result = self.runner.run("CUDA-gated tests", command, self.env, 180)
        with self.summary.lock:
            self.summary.tests = junit_cases(junit)
        if result["rc"] == 5:
            result["status"] = "no CUDA-gated test was collected"
        elif self.dry_run and result["rc"] == 0:
            result["status"] = NO_CUDA if all(c["outcome"] == "skipped" for c in self.summary.tests) else "ok"
        self.summary.part("tests", result)

    def examples(self) -> None:
        spec = importlib.util.spec_from_file_location("examples_run", ROOT / "examples" / "run.py")
        assert spec is not None and spec.loader is not None
        run_py = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(run_py)
        runs: list[tuple[str, list[str], dict[str, str]]] = [("examples", list(EXAMPLE_SUITES), self.env)]
        custom = make_custom_invariant_stub(self.tmp)
        if custom is not None:
            path = os.pathsep.join([self.env["PYTHONPATH"], str(CUSTOM_INVARIANT), str(custom)])
            env = dict(self.env, PYTHONPATH=path)
            runs.append(("examples custom_invariant", [str(CUSTOM_INVARIANT / "tests")], env))
        for name, paths, env in runs:
            junit = self.tmp / f"{name.replace(' ', '-')}.xml"
            command = [self.python, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:warnings", "-q",
                       f"--junitxml={junit}", *paths] + self.pytest_options
            result = self.runner.run(name, command, env, 150)
            cases = junit_cases(junit)
            for case in cases:
                case["expected"] = run_py.expected_outcome(case["id"].rsplit("::", 1)[-1], "by-name")
                case["ok"] = case["outcome"] in (case["expected"], "skipped")
            with self.summary.lock:
                self.summary.examples += cases
            if result["rc"] is not None and cases:  # a buggy example fails on purpose: judge by the table
                result["status"] = "ok" if all(c["ok"] for c in cases) else "unexpected outcomes"
            self.summary.part(name, result)

    def crosschecks(self) -> None:
        for script in sorted(SCRIPTS.glob("gpu_crosscheck_*.py")):
            target = self.tmp / f"{script.stem}.out"
            command = [self.python, str(script), "--out", str(target)]
            result = self.runner.run(script.name, command, self.env, CROSSCHECK_SECONDS)
            text = target.read_text(encoding="utf-8", errors="replace") if target.exists() else ""
            if not text:
                text = "```text\n" + result["output"][-3000:] + "\n```"
            if result["rc"] == 2:
                result["status"] = NO_CUDA
            with self.summary.lock:
                self.summary.crosschecks.append({"script": script.name, "status": result["status"],
                                                 "seconds": result["seconds"], "text": text})
            self.summary.part(script.name, result)

    def main(self) -> int:
        if self.selected("info") and not self.info():
            self.summary.part("CUDA", {"rc": 3, "seconds": 0, "status": "torch in this Python cannot use the GPU"})
            print("gpu-check: torch in this Python cannot use the GPU: "
                  f"torch {self.summary.info.get('torch')} (CUDA {self.summary.info.get('torch_cuda')}); "
                  "run it with a Python that has a CUDA build of torch (--python)", file=sys.stderr)
            return 3
        # Two lanes: the GPU work of the cross-check and the twins in this thread; the CPU-only run of the
        # corpus, the tests and the examples beside it (unless the GPU takes one process at a time).
        lane_a: list[Callable[[], None]] = []
        lane_b: list[Callable[[], None]] = []
        if self.selected("corpus"):
            lane_b.append(lambda: self.corpus("plugin-cpu"))
            if not self.dry_run:
                lane_a += [lambda: self.corpus("plugin-cuda"), lambda: self.corpus("syncdebug")]
        if self.selected("invariants"):
            lane_a.append(self.invariants)
        if self.selected("crosschecks"):
            lane_a.append(self.crosschecks)
        if self.selected("tests"):
            lane_b.append(self.tests)
        if self.selected("examples"):
            lane_b.append(self.examples)
        exclusive = "exclusive" in str(self.summary.info.get("compute_mode", "")).lower()
        if exclusive or self.dry_run:  # the dry run's machine is small: one process at a time
            lane_a, lane_b = lane_a + lane_b, []

        def run_lane(lane: list[Callable[[], None]]) -> None:
            for step in lane:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001 - one broken part must not stop the others
                    self.summary.part(getattr(step, "__name__", "part"), {
                        "rc": None, "seconds": 0, "status": f"error in gpu_check.py: {type(exc).__name__}: {exc}"})

        beside = threading.Thread(target=run_lane, args=(lane_b,), daemon=True)
        beside.start()
        run_lane(lane_a)
        beside.join(max(0.0, self.runner.left()) + 10)
        self.summary.write()
        return 0 if self.summary.ok() else 1


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for summary.md, results.json and log.txt")
    parser.add_argument("--cpu-dry-run", action="store_true", help="run the same plumbing on a CPU (no CUDA needed)")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for everything (default 330)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated, of {', '.join(PARTS)} (default: all)")
    parser.add_argument("--patterns", default="", help="corpus patterns to run (default: all)")
    parser.add_argument("--invariants", default="", help="invariant twins to run (default: all)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter with torch (default: this one)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {', '.join(unknown)}; choose from {', '.join(PARTS)}")
    if not args.cpu_dry_run:
        smi = shutil.which("nvidia-smi")
        listed = smi and subprocess.run([smi, "-L"], capture_output=True, timeout=60).returncode == 0
        if not listed:
            print("gpu-check: no CUDA GPU on this machine (nvidia-smi is missing or lists no GPU).", file=sys.stderr)
            print("gpu-check: on a CPU, --cpu-dry-run runs the same plumbing; the tests: scripts/run-tests.sh.",
                  file=sys.stderr)
            return 2
    check = Check(args)

    def stop(signum: int, frame: Any) -> None:  # an outer timeout: end the children, keep the summary
        check.runner.kill_all()
        check.summary.write()
        os._exit(124)

    signal.signal(signal.SIGTERM, stop)
    try:
        status = check.main()
    finally:
        check.runner.kill_all()
        shutil.rmtree(check.tmp, ignore_errors=True)
    print((check.out / "summary.md").read_text(encoding="utf-8"))
    print(f"gpu-check: {'OK' if status == 0 else 'FAILED'} (summary: {check.out / 'summary.md'})")
    return status


if __name__ == "__main__":
    sys.exit(main())
