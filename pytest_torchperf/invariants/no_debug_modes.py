"""Invariant ``no_debug_modes``: no slow debugging switch is on during the training steps.

Switches made for debugging cost every step when they are left on:

- **anomaly detection** (``torch.autograd.set_detect_anomaly(True)``,
  ``torch.autograd.detect_anomaly()``, Lightning's ``Trainer(detect_anomaly=True)``):
  every backward records a Python stack per graph node and checks every
  gradient for NaN: 2-3x slower steps in Lightning users' reports;
- **the autograd profiler** (``torch.autograd.profiler.profile``,
  ``emit_nvtx``, a ``torch.profiler`` session): every operator is recorded;
- **``CUDA_LAUNCH_BLOCKING=1``**: every kernel launch waits for the kernel;
- **``torch.use_deterministic_algorithms(True)``** (``Trainer(deterministic=True)``):
  slower kernels, or errors where none is deterministic. Reproducibility is a
  legitimate choice, so this one is a note; ``allow_deterministic=False`` fails on it.

The check reads each state at the start of every training step (torch's C
function for each, called by the run: no Python call of the check's, see
``step_polls``) and the probe (:mod:`pytest_torchperf.probes.debug_modes`)
keeps where each was turned on during the run: your line, or the Trainer argument. The
anomaly mode torchperf turns on itself (``no_graph_retention``'s creation
traces, ``max_overhead``'s replays) is not counted.

Blind spots: a mode turned on before the run is reported without its line;
``torch.set_anomaly_enabled`` imported by name before the run is not seen
turning it on (its state still is); profilers other than torch's own (NVIDIA
Nsight attached from outside) are not seen.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable, Optional, TypedDict

from ..arguments import Argument, Flag
from ..core import Check
from ..glue import trace
from ..probes import debug_modes
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import FRAMEWORK, TORCHPERF, Stack, site_of
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_debug_modes"

_WHAT = {
    "anomaly": "anomaly detection",
    "profiler": "the autograd profiler",
    "launch_blocking": "CUDA_LAUNCH_BLOCKING=1",
    "deterministic": "torch.use_deterministic_algorithms(True)",
}
_TRAINER = {"anomaly": "Trainer(detect_anomaly=True)", "deterministic": "Trainer(deterministic=True)"}
_COST = {
    "anomaly": "every backward records a stack per graph node and checks each gradient for NaN (2-3x slower steps)",
    "profiler": "every operator is recorded with its inputs and timings",
    "launch_blocking": "every CUDA kernel launch waits until the kernel has finished: no overlap of host and device",
    "deterministic": "deterministic kernels are slower (scatter/index_add, cuBLAS workspace), some raise errors",
}
_HINT = {
    "anomaly": "anomaly detection is for finding a NaN's origin, not for training: remove "
    "set_detect_anomaly(True) / Trainer(detect_anomaly=True), or turn it on only in a test made to debug",
    "profiler": "profile a few steps on purpose (torch.profiler.schedule), not the whole run",
    "launch_blocking": "unset CUDA_LAUNCH_BLOCKING (it is for locating a failing kernel)",
    "deterministic": "keep it only where reproducibility is needed; allow_deterministic=True accepts it as a note",
}


class _Mode:
    def __init__(self) -> None:
        self.steps = 0


class DebugModesCheck(Check):
    """Per-run state and verdict of ``no_debug_modes``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.allow_deterministic: bool = run.options.allow_deterministic
        self.modes: dict[str, _Mode] = {}
        self.stacks: dict[str, Stack] = {}
        #: Training steps of the run (``run.steps``, read when it ends).
        self.steps = 0
        self._anomaly, self._profiler, self._deterministic = debug_modes.readers()
        self._modes = run.probe("debug_modes")
        #: The engine's graphs probe, installed by another invariant or not: its creation trace turns anomaly
        #: mode on, which is torchperf's, not the user's.
        self._graphs = run.engine.probe("graphs")
        #: ``CUDA_LAUNCH_BLOCKING`` was set when the run started (read again when it ends).
        self._launch_blocking = debug_modes.launch_blocking()
        if run.scope == "test":  # the whole test is the step: no step polls, the switches read at its ends
            self._read_switches()

    def step_polls(self) -> tuple[tuple[Callable[[], object], Callable[[], None]], ...]:
        """Each switch is read as every step starts: torch's own C functions, no Python call of ours a step."""
        return (
            (self._anomaly, self._anomaly_on),
            (self._profiler, self._profiler_on),
            (self._deterministic, functools.partial(self._on, "deterministic")),
        )

    def _anomaly_on(self) -> None:
        if self._graphs._restore is None:  # not torchperf's own creation trace
            self._on("anomaly")

    def _profiler_on(self) -> None:
        if not trace.recording():  # not torchperf's own --torchperf-trace
            self._on("profiler")

    def _on(self, mode: str) -> None:
        seen = self.modes.get(mode)
        if seen is None:
            seen = self.modes[mode] = _Mode()
        seen.steps += 1

    def _read_switches(self) -> None:
        for read, on in self.step_polls():
            if read():
                on()

    def on_run_end(self) -> None:
        self.steps = self.run.steps
        if self.run.scope == "test":
            self._read_switches()
            self.steps = 1
            for seen in self.modes.values():  # on at the start, the end or both: on in the one step
                seen.steps = 1
        if self.steps and (self._launch_blocking or debug_modes.launch_blocking()):
            # CUDA reads the variable once, when it starts: set before the run or during it, every step ran with it
            self.modes.setdefault("launch_blocking", _Mode()).steps = self.steps
        for mode in self.modes:
            stack = self._modes.turned_on.get(mode)
            if stack is not None:
                self.stacks[mode] = stack

    def _where(self, mode: str) -> tuple[str, list[Site]]:
        stack = self.stacks.get(mode)
        if mode == "launch_blocking":
            return "set in the environment (CUDA_LAUNCH_BLOCKING)", []
        if stack is None:
            return "turned on before the run started (where is not known)", []
        frame = site_of(stack)
        if frame is not None and frame.kind == TORCHPERF:
            return "turned on before the run started (where is not known)", []
        if frame is not None and frame.kind == FRAMEWORK and mode in _TRAINER:
            return f"turned on by the Trainer argument {_TRAINER[mode]}", [Site("turned on", stack)]
        where = f" at {frame.location()}" if frame is not None else ""
        return f"turned on{where}", [Site("turned on", stack)]

    def _finding(self, mode: str, seen: _Mode, note: bool) -> Finding:
        where, sites = self._where(mode)
        prefix = "note: " if note else ""
        title = f"{prefix}{_WHAT[mode]} was on {self._during(seen.steps)}"
        facts = [where] if not sites or "Trainer" in where else []
        facts.append(f"cost: {_COST[mode]}")
        if note:
            facts.append("a note, not a failure: allow_deterministic=False fails on it")
        return Finding(title, facts, sites, _HINT[mode])

    def _during(self, on: Optional[int] = None, short: bool = False) -> str:
        """``"in 3 of 8 training steps"``, ``"in 3 steps"`` (short), ``"in 8 training steps"``; under
        ``scope="test"``: ``"in the whole test"``."""
        if self.run.scope == "test":
            return "in the whole test"
        if on is None:
            return f"in {plural(self.steps, 'training step')}"
        return f"in {on} steps" if short else f"in {on} of {plural(self.steps, 'training step')}"

    def result(self) -> CheckResult:
        figures: Figures = {
            "steps": self.steps,
            "modes": {mode: seen.steps for mode, seen in self.modes.items()},
            "allow_deterministic": self.allow_deterministic,
        }
        accepted = ("deterministic",) if self.allow_deterministic else ()
        failing = [m for m in debug_modes.MODES if m in self.modes and m not in accepted]
        noted = [m for m in debug_modes.MODES if m in self.modes and m not in failing]
        findings = [self._finding(m, self.modes[m], False) for m in failing]
        findings += [self._finding(m, self.modes[m], True) for m in noted]
        if failing:
            summary = ", ".join(f"{_WHAT[m]} on {self._during(self.modes[m].steps, short=True)}" for m in failing)
            return CheckResult(NAME, FAILED, summary, len(failing), findings, figures)
        if not self.steps:
            return CheckResult(
                NAME, NOT_CHECKED, "no training step was seen: no step to find a debug mode on in", 0, findings,
                figures,
            )
        summary = f"no debug mode on {self._during()}"
        if noted:
            summary += "; deterministic algorithms on (noted)"
        return CheckResult(NAME, PASSED, summary, 0, findings, figures)


class Figures(TypedDict, total=False):
    """The figures of a no_debug_modes verdict (see :mod:`pytest_torchperf.figures`)."""

    steps: int
    modes: dict[str, int]
    allow_deterministic: bool


INVARIANT = Invariant(
    name=NAME,
    doc="no debugging switch left on in the training steps: anomaly detection, the autograd profiler, "
    "CUDA_LAUNCH_BLOCKING (deterministic algorithms: a note)",
    check=DebugModesCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("debug_modes",),
    arguments=(
        Argument(
            "allow_deterministic",
            Flag(),
            True,
            "no_debug_modes only notes torch.use_deterministic_algorithms(True) during the steps; False fails on it",
            meaning="whether deterministic algorithms are accepted",
        ),
    ),
)
