"""Invariant ``no_recompiles``: ``torch.compile``'d code is not compiled again after warm-up.

Dynamo specialises compiled code on *guards* (tensor shapes and dtypes, grad
mode, ``module.training``, the values of Python ints and floats it read...).
When a guard fails it compiles the function again: seconds with inductor, every
time. After ``torch._dynamo.config.recompile_limit`` (8) compiles of one
function it gives up and runs that function uncompiled for the rest of the
process, silently.

Some recompiles are warm-up: the first compile of each mode the code runs in
(the first validation: eval mode, no grad; autocast on or off). So **warm-up is
the first compile of each such signature**: a recompile whose failed guard is
only dynamo's global state (grad mode, autocast...) or a module's ``training``
flag does not count, whenever it happens; every other recompile counts, in
the first epoch too. The commonest is the ragged last batch of an epoch
(``drop_last=False``: 3 rows after batches of 8): dynamo compiles the function
again for its size, then a dynamic-shape version; it is reported with its guard
and the fixes (``drop_last=True``, ``torch.compile(..., dynamic=True)``,
``torch._dynamo.mark_dynamic(x, 0)``). A ``validate``/``test``/``predict``
call is warm-up from start to end. ``recompile_warmup_steps=N`` replaces all
of it with "the first N training steps". Hitting the recompile limit fails the
check whenever it happens. ``torch._dynamo.reset()`` during the run empties
dynamo's caches: the compiles after it are first compiles again (counted in
the figures as ``dynamo_resets``).

The probe (:mod:`pytest_torchperf.probes.recompiles`) patches two functions
in ``torch._dynamo.convert_frame`` (when dynamo is first imported, if that
happens during the run): ``get_and_maybe_log_recompilation_reasons``, called on every
recompile with the failing guards (the same text ``TORCH_LOGS=recompiles``
prints), and ``exceeds_recompile_limit``. Compiles are counted with dynamo's
compile-start callback. Nothing changes dynamo's behaviour or logging; the
backend does not matter (``backend="eager"`` works on CPU). The call site is
the innermost frame outside torch when the compiled function was called.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import frameworks
from ..arguments import Argument, Flag, Integer
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import Stack, display_path
from ..text import plural, times

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_recompiles"

#: Guards on the mode the code runs in: the first compile of each mode is warm-up.
_MODE_GUARDS = re.compile(r"GLOBAL_STATE changed|grad_mode|autocast|\.training\b|is_grad_enabled|is_inference")
_SIZE = re.compile(r"size mismatch at index (?P<dim>\d+)\. expected (?P<expected>\d+), actual (?P<actual>\d+)")
_COMPILE_ID = re.compile(r"^\s*\[?\d+/\d+\]?\s*:\s*")
_HINT = re.compile(r"\s*\(HINT:\s*(?P<hint>.*)\)\s*$")
_SOURCE = re.compile(r"\s+#\s+")


@dataclass
class _Recompile:
    code: CodeType
    guard: str
    source: str
    hint: str
    stack: Stack
    warm: bool
    label: str
    limit: Optional[str] = None

    @property
    def ragged(self) -> Optional[tuple[int, int, int]]:
        """``(dim, expected, actual)`` when the guard failed on a smaller size of a tensor's first dimension."""
        match = _SIZE.search(self.guard)
        if match is None:
            return None
        dim, expected, actual = (int(match.group(g)) for g in ("dim", "expected", "actual"))
        return (dim, expected, actual) if dim == 0 and actual < expected else None


def _mode_change(guard: str) -> bool:
    return _MODE_GUARDS.search(guard) is not None


def parse_reason(reason: str) -> tuple[str, str, str]:
    """``(guard, source line, dynamo's hint)`` from one of dynamo's guard failure reasons.

    ``"0/7: s.counter == 5   # return x * s.counter  # m.py:26 in forward (HINT: ...)"``
    gives ``("s.counter == 5", "return x * s.counter", "...")``.
    """
    lines = reason.strip().splitlines()
    first = _COMPILE_ID.sub("", lines[0]) if lines else ""
    hint = ""
    match = _HINT.search(first)
    if match:
        hint = match.group("hint").strip()
        first = first[: match.start()]
    parts = _SOURCE.split(first.strip())
    guard = parts[0].strip()
    source = parts[1].strip() if len(parts) > 2 else ""
    return guard, source, hint


def _telling(reasons: list[str]) -> str:
    """The reason that explains the recompile: dynamo gives one per cached version of the function.

    A version compiled under another grad mode (or autocast state) fails on
    ``GLOBAL_STATE changed``: true, but it only says why the *other mode's*
    version does not fit. The first reason of another kind names the guard
    that broke the matching version (``self.level == 0``).
    """
    for reason in reasons:
        if "GLOBAL_STATE changed" not in reason:
            return reason
    return reasons[0]


def _function(code: CodeType) -> str:
    return f"{code.co_name} ({display_path(code.co_filename)}:{code.co_firstlineno})"


class RecompileCheck(Check):
    """Per-run state and verdict of ``no_recompiles``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.log = run.probe("loaders").log_for(run)
        self._recompiles = run.probe("recompiles")
        self.compiles = 0
        self.recompiles: list[_Recompile] = []
        #: torch._dynamo.reset() calls during the run.
        self.resets = 0
        #: Whether the probe could attach to dynamo (None: dynamo never imported), read at the run's end.
        self.attached: Optional[bool] = None

    def on_run_end(self) -> None:
        self.attached = self._recompiles.attached

    def _phase(self, guard: str) -> tuple[bool, str]:
        """(warm-up, where the run is) for a recompile happening now on ``guard``."""
        steps = self.run.steps
        limit = self.run.options.recompile_warmup_steps
        if limit is not None:
            return steps <= limit, f"step {steps}"
        warm = _mode_change(guard)
        call = frameworks.current_call()
        stage = frameworks.stage()
        if call is not None and stage is not None:
            if call.kind != "fit":
                return True, f"Trainer.{call.kind}"
            return warm, stage.label
        passes = self.log.most_passes
        if passes:
            return warm, f"epoch {passes - 1} (step {steps})"
        return warm, f"step {steps}"

    # -- events ----------------------------------------------------------------------
    def on_compile(self) -> None:
        self.compiles += 1

    def on_recompile(self, code: CodeType, reasons: list[str], stack: Stack) -> None:
        guard, source, hint = parse_reason(_telling(reasons)) if reasons else ("(dynamo gave no reason)", "", "")
        warm, label = self._phase(guard)
        self.recompiles.append(_Recompile(code, guard, source, hint, stack, warm, label))

    def on_dynamo_reset(self) -> None:
        self.resets += 1

    def on_recompile_limit(self, limit: str) -> None:
        if self.recompiles:
            self.recompiles[-1].limit = limit

    # -- verdict ---------------------------------------------------------------------
    def _warmup_text(self) -> str:
        limit = self.run.options.recompile_warmup_steps
        if limit is not None:
            return f"the first {limit} training steps"
        return "the first compile of each mode (grad mode, autocast, train/eval)"

    def _finding(self, events: list[_Recompile]) -> Finding:
        code = events[0].code
        compiled = [e for e in events if not e.limit]  # the attempt that hit the limit compiled nothing
        after = [e for e in compiled if not e.warm]
        limits = [e.limit for e in events if e.limit]
        parts = []
        if after:
            parts.append(f"was compiled again {plural(len(after), 'time')} after warm-up")
        if limits:
            parts.append(
                f"hit torch._dynamo.config.{limits[0]} ({_limit_value(limits[0])}) after {len(compiled)} "
                "recompiles: it runs uncompiled from then on"
            )
        title = f"{_function(code)} " + ", then ".join(parts)
        shown = after or events
        facts = [f"recompiled in: {_labels(shown)}"]
        guards: list[str] = []
        for e in reversed(shown):
            text = e.guard + (f"   ({e.source})" if e.source else "")
            if text not in guards:
                guards.append(text)
        for text in guards[:3]:
            facts.append(f"guard that failed: {text}")
        if len(guards) > 3:
            facts.append(f"... {len(guards) - 3} more distinct guards")
        warm = len(compiled) - len(after)
        if warm and after:
            facts.append(f"{warm} more during warm-up ({self._warmup_text()}), not counted")
        sites = merge_sites([Site("compiled function called", e.stack) for e in shown])
        ragged = next((e.ragged for e in shown if e.ragged), None)
        if ragged is not None:
            facts.insert(
                1,
                f"a smaller batch: {ragged[2]} rows where the compiled code expected {ragged[1]} (the ragged last "
                "batch of an epoch, drop_last=False): dynamo compiles again for it, then a dynamic-shape version",
            )
        dynamo_hint = next((e.hint for e in reversed(shown) if e.hint), "")
        hint = (
            "each failed guard is a value the compiled code was specialised on. Pass changing numbers as "
            "tensors kept on the device (built once, updated in place with `t.fill_(value)`: a new "
            "`torch.tensor(value, device=...)` every step is a blocking copy on CUDA), not Python ints/floats or "
            "module attributes; keep shapes fixed (drop_last=True) or mark "
            "them dynamic (torch._dynamo.mark_dynamic), and keep train/eval switches out of the steady state; "
            "TORCH_LOGS=recompiles shows every recompile."
        )
        if ragged is not None:
            hint = (
                "drop the ragged last batch (DataLoader(..., drop_last=True)), or compile for changing batch sizes "
                "from the start: torch.compile(..., dynamic=True), or torch._dynamo.mark_dynamic(x, 0) on the "
                "batch before the first call. " + hint[0].upper() + hint[1:]
            )
        if dynamo_hint:
            hint = f"dynamo says: {dynamo_hint} " + hint[0].upper() + hint[1:]
        return Finding(title, facts, sites, hint)

    def result(self) -> CheckResult:
        after = [e for e in self.recompiles if not e.warm and not e.limit]
        limits = [e for e in self.recompiles if e.limit]
        by_function: dict[tuple, list[_Recompile]] = {}
        for e in self.recompiles:
            key = (e.code.co_filename, e.code.co_firstlineno, e.code.co_name)
            by_function.setdefault(key, []).append(e)
        figures: Figures = {
            "compiles": self.compiles,
            "recompiles": len(self.recompiles) - len(limits),
            "recompiles_in_warmup": len(self.recompiles) - len(limits) - len(after),
            "recompiles_after_warmup": len(after),
            "recompile_limit_hits": len(limits),
            "warmup": self._warmup_text(),
            "ragged_batch_recompiles": sum(1 for e in after if e.ragged),
            "dynamo_resets": self.resets,
            "functions": [
                {
                    "function": _function(events[0].code),
                    "recompiles": sum(1 for e in events if not e.limit),
                    "after_warmup": sum(1 for e in events if not e.warm and not e.limit),
                    "guards": sorted({e.guard for e in events})[:10],
                    "limit_hit": any(e.limit for e in events),
                }
                for events in by_function.values()
            ],
        }
        if self.attached is False:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                "this torch version's dynamo has no recompilation hook torchperf knows",
                figures=figures,
            )
        bad = [events for events in by_function.values() if any(not e.warm or e.limit for e in events)]
        compiled = [e for e in self.recompiles if not e.limit]
        if bad:
            findings = [self._finding(events) for events in bad]
            parts = [f"{plural(len(after), 'recompile')} after warm-up"] if after else []
            if limits:
                parts.append(f"{plural(len(limits), 'recompile limit hit')}")
            return CheckResult(NAME, FAILED, ", ".join(parts), len(after) + len(limits), findings, figures)
        if not self.compiles and not self.recompiles:
            summary = "no torch.compile compilation during the run"
        else:
            summary = f"{plural(self.compiles, 'compile')}, no recompile after warm-up"
            if compiled:
                summary += f" ({len(compiled)} during warm-up)"
            if self.resets:
                summary += f"; torch._dynamo.reset() called {times(self.resets)}"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


def _labels(events: list[_Recompile]) -> str:
    labels: list[str] = []
    for e in events:
        if e.label not in labels:
            labels.append(e.label)
    shown = ", ".join(labels[:6])
    return shown + (f" and {len(labels) - 6} more" if len(labels) > 6 else "")


def _limit_value(name: str) -> Any:
    config = sys.modules.get("torch._dynamo.config")
    return getattr(config, name, "?")


class Figures(TypedDict, total=False):
    """The figures of a no_recompiles verdict (see :mod:`pytest_torchperf.figures`)."""

    compiles: int
    recompiles: int
    recompiles_in_warmup: int
    recompiles_after_warmup: int
    recompile_limit_hits: int
    warmup: str
    ragged_batch_recompiles: int
    dynamo_resets: int
    functions: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="torch.compile'd code is not compiled again after warm-up (the first compile of each mode)",
    check=RecompileCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("loaders", "recompiles"),
    arguments=(
        Argument(
            "recompile_warmup_steps",
            Integer(minimum=0),
            None,
            "count recompiles during the first N training steps as warm-up "
            "(default: only the first compile of each mode: grad mode, autocast, train/eval)",
            meaning="training steps whose recompiles count as warm-up",
        ),
    ),
)
