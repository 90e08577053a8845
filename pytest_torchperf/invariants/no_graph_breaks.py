"""Invariant ``no_graph_breaks``: a ``torch.compile``'d training step compiles into one graph.

Where dynamo meets code it cannot put in a graph (``loss.item()``, an operator
whose output shape depends on the data, ``print``, an unsupported library
call) it *breaks* the graph: the part before runs compiled, the construct runs
in Python, and dynamo compiles the rest as another function. Each break costs
a round trip through Python (and, for ``.item()``, a device sync) every step,
splits the optimisations across graphs, and often leaves a compiled step
slower than eager. Only a counter shows it, unless ``fullgraph=True``.

Every break dynamo takes while it compiles during a training step (the step of
``run.step()``, Lightning's ``training_step``: a compiled module, a compiled
``training_step``, or a compiled function the step calls) is one finding per
site: the type of break, dynamo's explanation, your line and its stack, and a
hint for the kind of break. ``max_graph_breaks=N`` accepts N distinct break
sites. The check is "not checked" when nothing was compiled during the run.

The probe (:mod:`pytest_torchperf.probes.graph_breaks`) wraps the method
dynamo calls once per break it takes; compiles are counted with dynamo's
compile-start callback (probe ``recompiles``). Nothing changes what dynamo
does. Any backend works (``backend="eager"`` on CPU).

Code compiled before the first step (``c = torch.compile(model)``, then a
loop whose first call compiles before the first automatic step begins), in an
earlier test (dynamo reuses what it compiled for the same class, whatever
instance) or before the watch is judged where a step runs it: the first time
a step calls a compiled function, the probe reads the breaks dynamo compiled
into it from dynamo's own compiled versions of its code (see
:mod:`pytest_torchperf.probes._compiled`), with the reason torchperf or
dynamo's compilation records kept. Nothing is compiled again for it.

Blind spots: frames dynamo skips as a whole (a loop with a break in it,
"skipping frame") are reported with the reason dynamo gives, once; a compiled
function called only from another compiled one is read through its caller
(a module's submodules are read with it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Argument, Flag, Integer
from ..core import Check
from ..probes.graph_breaks import GraphBreak
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import USER, Frame, site_of
from ..text import plural, times

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_graph_breaks"

_ITEM_HINT = (
    "a Python number read from a tensor (`.item()`, `float(t)`, `int(t)`, `.tolist()`) ends the graph and "
    "syncs with the device: keep the value a tensor (`torch.where(cond, a, b)` instead of `if t.item():`, "
    "log the tensor itself), or move the read out of the compiled region (after the step)"
)
_SHAPE_HINT = (
    "the output's shape depends on the tensor's values (`nonzero`, boolean masks, `unique`...): use a "
    "fixed-shape form (`torch.where`, a mask multiplied in), or set "
    "`torch._dynamo.config.capture_dynamic_output_shape_ops = True`"
)
_CALL_HINT = (
    "dynamo cannot trace this call: move it out of the compiled region, or put the unsupported part in a "
    "helper decorated with `@torch.compiler.disable` so that only that call runs in Python"
)
_DISABLED_HINT = (
    "a function marked `torch.compiler.disable` breaks the graph at each call: call it outside the compiled "
    "region, or accept the break with max_graph_breaks=N"
)


def _hint(event: GraphBreak) -> str:
    text = f"{event.kind} {event.explanation}".lower()
    if "item()" in text or "capture_scalar_outputs" in text or "tolist" in text or "data-dependent" in text:
        return _ITEM_HINT
    if "dynamic shape operator" in text or "output shape depends" in text:
        return _SHAPE_HINT
    if "disable" in text:
        return _DISABLED_HINT
    return _CALL_HINT


def _site_frame(event: GraphBreak) -> Optional[Frame]:
    frame = site_of(event.stack)
    return frame


class _Site:
    def __init__(self, event: GraphBreak, step: Optional[int]) -> None:
        self.event = event
        self.count = 1
        self.steps: list[int] = [step] if step is not None else []
        #: The step that first ran it, compiled before (None: compiled in a step).
        self.ran_in: Optional[int] = None
        #: Compiled before this run began (an earlier test), not while it watched.
        self.earlier = False


class GraphBreakCheck(Check):
    """Per-run state and verdict of ``no_graph_breaks``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.limit: int = run.options.max_graph_breaks
        self.compiles = 0
        self.sites: dict[tuple, _Site] = {}
        #: Break sites taken while compiling outside the steps (validation, a warm-up call) and not run
        #: in a step since: not counted.
        self.outside: set[tuple] = set()
        #: Compiled functions a step called whose code dynamo had compiled before (outside the steps, earlier).
        self.ran_compiled = 0
        self.attached: Optional[bool] = None
        self._graph_breaks = run.probe("graph_breaks")

    def on_run_end(self) -> None:
        self.attached = self._graph_breaks.attached

    def on_compile(self) -> None:
        self.compiles += 1

    def on_graph_break(self, event: GraphBreak) -> None:
        key = self._key(event)
        if not self.run.in_scope:
            self.outside.add(key)
            return
        site = self.sites.get(key)
        if site is None:
            self.sites[key] = _Site(event, self.run.unit)
        else:
            site.count += 1
            if self.run.unit is not None and self.run.unit not in site.steps:
                site.steps.append(self.run.unit)

    def on_compiled_code_run(self, codes: list[Any], breaks: list[GraphBreak]) -> None:
        """A compiled function a step calls, compiled before (before the first step, in an earlier test)."""
        self.ran_compiled += 1
        for event in breaks:
            key = self._key(event)
            site = self.sites.get(key)
            if site is None:
                site = self.sites[key] = _Site(event, None)
                site.ran_in = self.run.unit
                site.earlier = key not in self.outside
            elif site.ran_in is None:
                site.ran_in = self.run.unit
            self.outside.discard(key)

    @staticmethod
    def _key(event: GraphBreak) -> tuple:
        frame = _site_frame(event)
        return (frame.filename, frame.lineno, event.kind) if frame is not None else ("", 0, event.kind)

    def _finding(self, site: _Site) -> Finding:
        event = site.event
        frame = _site_frame(event)
        where = f" at {frame.location()}" if frame is not None else ""
        whose = "" if frame is None or frame.kind == USER else f" ({frame.kind} code)"
        title = f"graph break{where}{whose}: {event.kind}"
        facts = []
        if event.explanation and event.explanation != event.kind:
            facts.append(f"reason: {event.explanation}")
        facts.extend(f"dynamo's hint: {h}" for h in event.hints[:2])
        if site.count > 1:
            facts.append(f"taken {times(site.count)} (each compile of the function breaks there again)")
        if site.steps:
            facts.append(f"compiled in {self.run.unit_name} {site.steps[0]}")
        elif site.ran_in is not None:
            when = "before this test was watched" if site.earlier else f"before {self.run.unit_name} 1"
            facts.append(
                f"compiled {when} (dynamo reuses the compiled code), run in {self.run.unit_name} {site.ran_in}"
            )
        return Finding(title, facts, [Site("graph break", event.stack, site.count)], _hint(event))

    def result(self) -> CheckResult:
        sites = list(self.sites.values())
        figures: Figures = {
            "compiles": self.compiles,
            "graph_breaks": len(sites),
            "graph_breaks_taken": sum(s.count for s in sites),
            "graph_breaks_outside_steps": len(self.outside),
            "compiled_functions_reused": self.ran_compiled,
            "max_graph_breaks": self.limit,
            "reasons": sorted({s.event.kind for s in sites}),
        }
        if self.attached is False:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                "this torch version's dynamo has no graph-break hook torchperf knows",
                figures=figures,
            )
        if not self.compiles and not sites and not self.ran_compiled:
            return CheckResult(
                NAME, NOT_CHECKED, "nothing was compiled with torch.compile during the run", figures=figures
            )
        findings = [self._finding(s) for s in sites]
        if len(sites) > self.limit:
            summary = f"{plural(len(sites), 'graph break')} in the compiled training step"
            if self.limit:
                summary += f" (max_graph_breaks={self.limit})"
            return CheckResult(NAME, FAILED, summary, len(sites), findings, figures)
        if sites:
            summary = f"{plural(len(sites), 'graph break')}, within max_graph_breaks={self.limit}"
        else:
            summary = f"{plural(self.compiles, 'compile')}, no graph break in the training step"
            if not self.compiles:
                summary = "compiled code reused from before the watch, no graph break in it"
            if self.outside:
                summary += f" ({plural(len(self.outside), 'break')} outside the steps, not counted)"
        return CheckResult(NAME, PASSED, summary, 0, findings, figures)


class Figures(TypedDict, total=False):
    """The figures of a no_graph_breaks verdict (see :mod:`pytest_torchperf.figures`)."""

    compiles: int
    graph_breaks: int
    graph_breaks_taken: int
    graph_breaks_outside_steps: int
    compiled_functions_reused: int
    max_graph_breaks: Optional[int]
    reasons: list[str]


INVARIANT = Invariant(
    name=NAME,
    doc="a torch.compile'd training step is one graph: no graph break while it compiles",
    check=GraphBreakCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("recompiles", "graph_breaks"),
    conditional=True,  # a run that compiles nothing has no graph to break
    arguments=(
        Argument(
            "max_graph_breaks",
            Integer(minimum=0, optional=False),
            0,
            "the number of distinct graph-break sites no_graph_breaks accepts in the compiled training step",
            meaning="the distinct graph-break sites accepted",
        ),
    ),
)
