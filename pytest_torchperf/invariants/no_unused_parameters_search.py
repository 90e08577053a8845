"""Invariant ``no_unused_parameters_search``: no ``find_unused_parameters=True`` when every parameter gets a gradient.

With ``find_unused_parameters=True`` (Lightning: ``strategy="ddp_find_unused_parameters_true"``),
``DistributedDataParallel`` walks the autograd graph from the outputs after
every forward pass to find the parameters that will get no gradient, so that
it does not wait for them. When every parameter does get one on every rank,
that walk is pure overhead, every step (DDP only warns once, after the first
iteration). The invariant fails then, and when some parameters were unused it
passes and names them.

Seen through the probe :mod:`pytest_torchperf.probes.ddp`: when a searching
DDP arms its next all-reduce (and after each optimizer step), the reducer's
map of the previous backward (how many ranks gave each parameter a gradient;
``reducer._get_local_used_map()``) is folded into a running minimum with one
device op, and read once when the run ends, so the check adds no host-device
synchronisation. A parameter used on every
rank in every synchronised iteration has a minimum equal to the world size.
A DDP with ``static_graph=True`` does not search each step and passes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import core, frameworks
from ..arguments import Flag
from ..core import Check
from ..probes.ddp import DDPProbe, reducer_parameter_names
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack, capture, until_user_frame
from ..text import plural
from ._ddp import Context

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_unused_parameters_search"


class _Module:
    """One DDP module as one run saw it."""

    def __init__(self, ddp: Any, probe: DDPProbe) -> None:
        self.ref = weakref.ref(ddp)
        self.searching = bool(getattr(ddp, "find_unused_parameters", False)) and not bool(
            getattr(ddp, "static_graph", False)
        )
        self.created: Optional[Stack] = probe.created.get(ddp)
        #: The framework that built it (None: the user did, or it was built before the run).
        self.built_by: Optional[str] = probe.built_by.get(ddp)
        self.first_forward: Optional[Stack] = None
        self.description = f"DistributedDataParallel({type(ddp.module).__name__})"
        self.names = reducer_parameter_names(ddp) if self.searching else []
        self.world = 1
        try:
            self.world = int(ddp.process_group.size())
        except Exception:  # noqa: BLE001 - the default group
            import torch.distributed as dist

            self.world = int(dist.get_world_size()) if dist.is_initialized() else 1
        self.forwards = 0
        self.iterations = 0  # synchronised backward passes folded into ``least``
        self.armed = False
        self.least: Any = None  # device tensor: the fewest ranks that used each parameter in one iteration
        self.counts: Optional[list[int]] = None
        self.unavailable = ""


class UnusedParametersCheck(Check):
    """Per-run state and verdict of ``no_unused_parameters_search``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.context = Context()
        self._modules: dict[int, _Module] = {}
        self._ddp: DDPProbe = run.probe("ddp")
        #: id(reducer) -> the record of its DDP module.
        self._by_reducer: dict[int, _Module] = {}
        self._torch: Any = None

    def on_framework_call(self, call: FrameworkCall) -> None:
        self.context.on_framework_call(call)

    def on_ddp_forward(self, ddp: Any) -> None:
        rec = self._modules.get(id(ddp))
        if rec is None or rec.ref() is not ddp:
            rec = self._modules[id(ddp)] = _Module(ddp, self._ddp)
            if rec.searching and rec.created is None:  # built before the run: show where it runs
                rec.first_forward = until_user_frame(capture(3))
        self._by_reducer[id(getattr(ddp, "reducer", None))] = rec
        rec.forwards += 1

    def on_ddp_armed(self, reducer: Any) -> None:
        rec = self._by_reducer.get(id(reducer))
        if rec is None or not rec.searching:
            return
        if rec.armed:  # the reducer still holds the previous backward's map
            self._fold(reducer, rec)
        rec.armed = True

    def on_optimizer_step(self, optimizer: Any) -> None:
        # The armed backward is done by now: fold it while the DDP module is surely alive.
        for rec in self._modules.values():
            ddp = rec.ref() if rec.armed else None
            if ddp is not None:
                self._fold(ddp.reducer, rec)

    def _fold(self, reducer: Any, rec: _Module) -> None:
        rec.armed = False
        get = getattr(reducer, "_get_local_used_map", None)
        if get is None:
            rec.unavailable = "this torch's DDP reducer does not expose its used-parameter map"
            return
        used = get()
        if self._torch is None:
            import torch

            self._torch = torch
        rec.least = used.clone() if rec.least is None else self._torch.minimum(rec.least, used)
        rec.iterations += 1

    def on_run_end(self) -> None:
        with core.suspended():  # torchperf's own reads: no probe records them
            for rec in self._modules.values():
                ddp = rec.ref()
                if ddp is not None and rec.armed:
                    self._fold(ddp.reducer, rec)
                if rec.least is not None:
                    rec.counts = [int(v) for v in rec.least.cpu().tolist()]
                    rec.least = None

    # -- verdict -------------------------------------------------------------------------
    def result(self) -> CheckResult:
        modules = list(self._modules.values())
        searching = [m for m in modules if m.searching]
        figures: Figures = {
            "ddp_modules": len(modules),
            "searching_modules": len(searching),
            "modules": [],
        }
        if not modules:
            return CheckResult(
                NAME, NOT_CHECKED, "no DistributedDataParallel forward pass in this process", 0, [], figures
            )
        if not searching:
            return CheckResult(
                NAME, PASSED, "DDP does not search for unused parameters (find_unused_parameters=False)", 0, [], figures
            )
        failing: list[Finding] = []
        notes: list[Finding] = []
        unchecked: list[str] = []
        for rec in searching:
            counts = rec.counts
            if counts is None:
                unchecked.append(rec.unavailable or f"{rec.description}: no synchronised backward pass to read")
                continue
            names = rec.names if len(rec.names) == len(counts) else [f"parameter {i}" for i in range(len(counts))]
            unused = [(n, c) for n, c in zip(names, counts) if c < rec.world]
            figures["modules"].append({
                "module": rec.description,
                "parameters": len(counts),
                "iterations": rec.iterations,
                "world_size": rec.world,
                "unused_parameters": [n for n, _ in unused],
            })
            if rec.created is not None:
                sites = [Site("DDP built with find_unused_parameters=True", rec.created)]
            elif rec.first_forward is not None:
                sites = [Site("first forward of the DDP built with find_unused_parameters=True", rec.first_forward)]
            else:
                sites = []
            if not unused:
                failing.append(
                    Finding(
                        f"{rec.description} searched for unused parameters after each of "
                        f"{plural(rec.iterations, 'iteration')}, "
                        f"and all {len(counts)} parameters got a gradient on every rank every time",
                        [
                            "find_unused_parameters=True walks the autograd graph from the outputs after every forward "
                            "pass",
                            f"world size {rec.world}: each parameter's gradient came from all {rec.world} ranks in "
                            "every iteration",
                        ],
                        sites,
                        self._hint(rec),
                    )
                )
            else:
                listed = ", ".join(
                    f"{n} ({'never' if c == 0 else f'on {c} of {rec.world} ranks'})" for n, c in unused[:8]
                )
                more = f" and {len(unused) - 8} more" if len(unused) > 8 else ""
                notes.append(Finding(
                    f"note: {rec.description} needs the search: {plural(len(unused), 'parameter')} got no gradient "
                    f"on some rank in some iteration: {listed}{more}",
                    ["a parameter that never gets a gradient could be frozen (requires_grad=False) or removed; "
                     "then the search can go"],
                    sites,
                ))
        figures["iterations"] = sum(m.iterations for m in searching)
        if failing:
            count = len(failing)
            first = figures["modules"][0] if figures["modules"] else {}
            summary = (
                f"find_unused_parameters=True, but all {first.get('parameters', '?')} parameters got a gradient "
                f"in all {plural(first.get('iterations', 0), 'iteration')}"
            )
            return CheckResult(NAME, FAILED, summary, count, failing + notes, figures)
        if unchecked and not notes:
            return CheckResult(NAME, NOT_CHECKED, "; ".join(unchecked), 0, [], figures)
        unused_total = sum(len(m["unused_parameters"]) for m in figures["modules"])
        return CheckResult(
            NAME,
            PASSED,
            f"the search is needed: {plural(unused_total, 'parameter')} went without a gradient",
            0,
            notes,
            figures,
        )

    def _hint(self, rec: _Module) -> str:
        """The setting the user controls: the framework's when a framework built the DDP module."""
        ctx = self.context
        built_by = rec.built_by if rec.created is not None else ctx.framework
        if built_by == "lightning" and ctx.lightning:
            return (
                f"use Trainer(strategy=\"{ctx.ddp_name}\") instead of \"{ctx.ddp_name}_find_unused_parameters_true\" "
                "(or DDPStrategy(find_unused_parameters=False)); Lightning's default does not search"
            )
        own = frameworks.setting(built_by, NAME)
        if own:
            return own
        return (
            "drop find_unused_parameters=True: DistributedDataParallel(model) does not search (Fabric: "
            "strategy=\"ddp\" or DDPStrategy(find_unused_parameters=False)); if the same parameters are unused in "
            "every step, static_graph=True handles them without searching each time"
        )


class Figures(TypedDict, total=False):
    """The figures of a no_unused_parameters_search verdict (see :mod:`pytest_torchperf.figures`)."""

    ddp_modules: int
    searching_modules: int
    modules: list[dict[str, Any]]
    iterations: int


INVARIANT = Invariant(
    name=NAME,
    doc="no DDP find_unused_parameters=True search when every parameter gets a gradient every step",
    check=UnusedParametersCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("ddp", "optimizers"),
)
