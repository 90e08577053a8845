"""Invariant ``no_graph_retention``: no autograd graph built in a training step outlives the next step.

The classic training-loop leak: a tensor that still carries its autograd
graph is kept past its step (``self.losses.append(loss)``, ``running_loss +=
loss``, predictions collected for an epoch-end metric, an auxiliary output
that is not part of the loss, so backward never frees its saved activations).
Each step adds a graph that nothing frees, and memory grows until the run
dies, usually on the GPU, hours in.

How it is seen (:mod:`pytest_torchperf.invariants._graphs`):

1. **Dating.** At the start of each training step the check reads torch's
   autograd sequence number (a per-thread counter stamped on every graph node
   torch builds; reading it builds nothing), so any node can later be dated
   to the step that built it.
2. **Tagging, sampled.** The probe :mod:`pytest_torchperf.probes.graphs` hands
   over a sample of the backward passes before they run (the first one, then
   at a cadence that keeps this work near 0.5% of the run's time). The check
   walks the graph from its roots and puts one *sentinel* object in the
   ``metadata`` of every node built since its step started; a node's metadata
   dies with the node, so the sentinel is alive exactly while some node of
   that step is.
3. **Judging, every step.** When a step starts (a Lightning ``training_step``,
   a ``run.step()`` block), the sentinels of the steps before the previous one
   (whose optimizer step has run; in a run where no optimizer steps, whose next
   backward pass has run) must be gone; after each Lightning fit and
   at the end of the run, those of every step but the last. The previous step
   is not judged yet: a plain loop's locals (``loss``, ``out``) hold it until
   this step rebinds them, and Lightning holds a step's loss and outputs until
   its batch ends. So a graph is a finding once a whole step has run after
   the one that built it.
4. **Diagnosis, only once something survived.** The step that starts then is
   run under a *creation trace* (torch's anomaly mode without NaN checks:
   every node built keeps the Python stack that built it). Two steps later,
   again at doubling step counts, after each fit and at the end of the run,
   the check *scans*: every tensor alive in the process that carries
   a graph (the garbage collector's list of objects), the steps its graph
   spans, the saved activations its old nodes still hold, and what holds it
   (:func:`gc.get_referrers` up to an object attribute, a module global, a
   closure or a local of a running function). The scan costs tens of
   milliseconds; a clean run never pays it.

In the sampled steps every module's output is tagged too, as it is built (a
global module forward hook for that step only): an output the loss never reads
(an auxiliary head, predictions appended to a list for an epoch-end metric,
even fed from a detached input) shares no node with the backward pass and is
seen that way. When several holders grow, the one that gains a graph most often
(every step, for a list appended to in each step, even one cleared at each
epoch's end), then the one that gained one in the most steps, is named first.

Blind spots: a graph held only from C++ (a hook, another graph's saved tensor)
is reported without a holder; a retained tensor that is neither a module's
output nor part of a backward pass, built from a detached input (``(h.detach()
* w).sum()`` kept in a list), and a retention that lasts exactly one extra step (``self.last = out``, rebound
every step) are not seen; graph nodes built on other threads (DataParallel
replicas, CUDA backward threads under ``create_graph=True``) carry another
thread's counter and may be dated wrongly in the diagnosis.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..arguments import Flag
from ..clocks import perf_counter
from ..core import Check
from ..probes import cuda_available
from ..probes.optimizers import parameters
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack
from ..text import plural
from ._graphs import NO_SEQUENCE, Scan, find_holders, frame_locals, scan, sequence_now, tag_graph, tensors_of
from ._memory import MemoryFigures, MemoryTrace, format_bytes

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_graph_retention"

#: Scans at doubling step counts stop after this many (the fit's end and the run's end still scan).
MAX_SCANS = 4
#: Holders are searched for at most this many retained tensors per round (the rest are claimed by container).
HOLDER_SAMPLE = 16
HOLDER_ROUNDS = 4
#: Pending tagged steps kept per run (a leaking run keeps tagging steps whose graphs never die).
MAX_PENDING = 64


class _Sentinel:
    """Lives in the metadata of a step's graph nodes: it is alive while one of them is."""

    __slots__ = ("__weakref__",)


@dataclass
class _Tagged:
    step: int
    ref: weakref.ref[_Sentinel]
    #: Optimizer steps seen when the step was tagged: it is judged once one more has run.
    optimizer_steps: int
    #: Backward passes seen when the step was tagged (its own included): in a run without an optimizer
    #: (parameters updated by hand, pytorch/examples' word_language_model), it is judged once one more has run.
    backward_calls: int = 0


@dataclass
class Group:
    """Retained tensors with the same holder, as one scan saw them."""

    holder: str
    container: str
    user: bool
    tensors: int = 0
    own_steps: list[int] = field(default_factory=list)
    #: Steps (that had ended) whose graph nodes these tensors keep.
    steps: set[int] = field(default_factory=set)
    node_ids: set[int] = field(default_factory=set)
    storages: dict[tuple, int] = field(default_factory=dict)
    data_bytes: int = 0
    node_names: dict[str, int] = field(default_factory=dict)
    trace: Optional[Stack] = None

    @property
    def nodes(self) -> int:
        return len(self.node_ids)

    @property
    def saved_bytes(self) -> int:
        return sum(self.storages.values())

    @property
    def grew_in(self) -> int:
        """The steps in which this holder gained a graph: one per tensor's own step, or, for one graph spanning
        several steps (a running sum), each step it spans."""
        return len(self.steps) if self.spanning else len(set(self.own_steps))

    @property
    def growth_rate(self) -> float:
        """How often this holder gained a graph: 1.0 for one every step (a list appended to in each step), 0.125
        for one every 8th (a list appended to at each epoch's end), between the first and the last step it grew
        in; 0.0 when it grew in one step only (no rate to tell)."""
        grew = sorted(self.steps) if self.spanning else sorted(set(self.own_steps))
        if len(grew) < 2:
            return 0.0
        return (len(grew) - 1) / (grew[-1] - grew[0])

    @property
    def spanning(self) -> bool:
        """One tensor whose graph spans several steps (a running sum)."""
        return self.tensors == 1 and len(self.steps) > 1

    def describe(self) -> str:
        """``list of 12 tensors with autograd graphs, one per step`` / ``one graph spanning 12 steps``."""
        n_steps = len(self.steps)
        first, last = min(self.steps), max(self.steps)
        span = f"step {first}" if first == last else f"steps {first}-{last}"
        if self.spanning:
            return f"one graph spanning {n_steps} steps ({span})"
        if self.tensors > 1:
            what = plural(self.tensors, "tensor") + " with autograd graphs"
        else:
            what = "a tensor with an autograd graph"
        where = f"{self.container} of {what}" if self.container else what
        distinct = sorted(set(self.own_steps))
        if self.tensors > 1 and len(distinct) == self.tensors and last - first + 1 == self.tensors:
            return f"{where}, one per step ({span})"
        return f"{where} ({span})"

    def growth(self) -> str:
        """Per step: tensors, graph nodes, saved activations."""
        n = max(len(self.steps), 1)
        parts = []
        if not self.spanning:
            parts.append(f"{self.tensors / n:.3g} tensor{'s' if self.tensors != n else ''}")
        parts.append(f"{self.nodes / n:.3g} graph node{'s' if self.nodes != n else ''}")
        if self.saved_bytes:
            parts.append(f"{format_bytes(self.saved_bytes / n)} of saved activations")
        else:
            parts.append("no saved activations (backward already freed them)")
        return "growth per step: " + ", ".join(parts)


@dataclass
class Diagnosis:
    """A scan's result, with the holders named (the tensors themselves are not kept)."""

    at_step: int
    groups: list[Group]
    graph_tensors: int
    nodes_visited: int
    truncated: bool
    seconds: float

    @property
    def weight(self) -> tuple[int, int]:
        return (sum(len(g.steps) for g in self.groups), sum(g.tensors for g in self.groups))


class GraphRetentionCheck(Check):
    """Per-run state and verdict of ``no_graph_retention`` (see the module's docstring)."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.key = f"torchperf.{NAME}.{id(self):x}"
        self._sequence = sequence_now()
        #: The autograd sequence number at the start of each step (step i at index i - 1).
        self.starts: list[int] = []
        self.pending: list[_Tagged] = []
        self.tagged_steps = 0
        self.nodes_tagged = 0
        #: Tagged steps judged after their optimizer step had run (their graph gone or not).
        self.judged: set[int] = set()
        self._last_scan_at = -1
        #: Tagged step -> the newest ended step after which its graph was still seen alive.
        self.survived: dict[int, int] = {}
        #: (tagged step, the newest ended step when its graph was first seen alive).
        self.first_seen: Optional[tuple[int, int]] = None
        self.trace_step: Optional[int] = None
        self.traced_step: Optional[int] = None
        self.next_scan: Optional[int] = None
        self.scans = 0
        self.scan_seconds = 0.0
        self.diagnosis: Optional[Diagnosis] = None
        #: CUDA allocated memory at step ends, on a machine with CUDA (reads kept near 1% of the run's time).
        self.memory: Optional[MemoryTrace] = MemoryTrace(budget=0.01) if cuda_available() else None
        self.backward_passes = 0
        self.sampled_passes = 0
        self.sample_seconds = 0.0
        #: Module outputs tagged in sampled steps (an output the loss never reads is only seen this way).
        self.outputs_tagged = 0
        self._outputs_armed = False
        #: The probe that tags the graphs and samples the backward passes (this run's engine's).
        self._graphs = run.probe("graphs")

    # -- events -------------------------------------------------------------------------
    def on_step_start(self) -> None:
        # The hot path: one sequence number per step; the rest only while something is pending.
        self.starts.append(self._sequence())
        if self._outputs_armed:
            self._graphs.disarm_forward(self._tag_output)
            self._outputs_armed = False
        if self.pending or self.first_seen is not None or self.memory is not None:
            self._step_started(len(self.starts))
        if self.first_seen is None and self._graphs.due():
            # A sampled step: its module outputs are tagged too, the ones the loss never reads included.
            self._graphs.arm_forward(self._tag_output)
            self._outputs_armed = True

    def _sentinel(self, step: int, before_backward: bool = False) -> _Sentinel:
        """The sentinel of ``step`` (made, and the step made pending, at its first tag). ``before_backward``:
        tagged in the forward pass, so the step's own backward pass is still to come."""
        last = self.pending[-1] if self.pending else None
        sentinel = last.ref() if last is not None and last.step == step else None
        if sentinel is None:
            sentinel = _Sentinel()
            calls = self._graphs.calls + (1 if before_backward else 0)
            self.pending.append(_Tagged(step, weakref.ref(sentinel), self._graphs.optimizer_steps, calls))
            self._graphs.await_optimizer_step()
            self.tagged_steps += 1
            if len(self.pending) > MAX_PENDING:
                del self.pending[0]
        return sentinel

    def _tag_output(self, output: Any) -> None:
        """A module's output in a sampled step: its graph node gets the step's sentinel (see :meth:`on_step_start`)."""
        step = len(self.starts)
        if not step:
            return
        floor = self.starts[step - 1]
        for tensor in tensors_of(output):
            node = tensor.grad_fn
            if node is None:
                continue
            seq = node._sequence_nr()
            if seq < floor or seq == NO_SEQUENCE:
                continue
            metadata = node.metadata
            if self.key not in metadata:
                metadata[self.key] = self._sentinel(step, before_backward=True)
                self.outputs_tagged += 1

    def _step_started(self, step: int) -> None:
        if self.traced_step is not None and self.traced_step < step and self._graphs.tracing:
            self._graphs.stop_tracing()
        if self.memory is not None:
            self.memory.sample(step - 1)  # allocated memory at the boundary after step - 1
        self._judge(step - 2, scan_at=step - 1)
        if self.trace_step is not None and self.traced_step is None and self._graphs.trace_creations():
            self.traced_step = step

    def on_backward_sample(self, roots: tuple[Any, ...]) -> None:
        step = len(self.starts)
        if not step:
            return  # a backward pass before the first step: not a step's graph
        self.nodes_tagged += tag_graph(roots, self.starts[step - 1], self.key, self._sentinel(step))

    def on_framework_call_end(self, call: FrameworkCall) -> None:
        if call.kind == "fit":
            steps = len(self.starts)
            self._judge(steps - 1, scan_at=steps, final=True)

    def on_run_end(self) -> None:
        if self._outputs_armed:
            self._graphs.disarm_forward(self._tag_output)
            self._outputs_armed = False
        if self._graphs.tracing:
            self._graphs.stop_tracing()
        steps = len(self.starts)
        self._judge(steps - 1, scan_at=steps, final=True)
        self.backward_passes = self._graphs.calls
        self.sampled_passes = self._graphs.samples
        self.sample_seconds = self._graphs.sample_seconds

    # -- judging ------------------------------------------------------------------------
    def _judge(self, newest: int, scan_at: int, final: bool = False) -> None:
        """Look for sentinels of steps up to ``newest`` whose optimizer step ran; scan when one is due.

        Called when a step starts (``newest``: two steps back, the previous one may still be held by the
        loop's locals), after a fit and at the end of the run (``newest``: the step before the last one).
        ``scan_at``: a scan then counts nodes of steps before this one as old.
        """
        alive = []
        optimizer_steps = self._graphs.optimizer_steps
        by_hand = not optimizer_steps and not self._graphs.optimizers  # no optimizer has stepped in the run
        for tagged in self.pending:
            stepped = optimizer_steps > tagged.optimizer_steps or by_hand and self._graphs.calls > tagged.backward_calls
            if tagged.ref() is None:
                if stepped:
                    self.judged.add(tagged.step)
                continue
            alive.append(tagged)
            if tagged.step <= newest and stepped:
                self.judged.add(tagged.step)
                self.survived[tagged.step] = newest + 1
                if self.first_seen is None:
                    self.first_seen = (tagged.step, newest + 1)
                    self.trace_step = newest + 2
                    self.next_scan = newest + 4
        self.pending = alive
        if self.first_seen is None:
            return
        # Scanned on the way too, at doubling step counts: by the end of the run (or of the fit) what was held
        # may be gone (a plain loop's locals under the marker, a list cleared at each epoch's end).
        step = newest + 2
        due = self.next_scan is not None and step >= self.next_scan and self.scans < MAX_SCANS
        if final and self._last_scan_at == scan_at:
            return  # the fit's end just scanned this step
        if final or due:
            self._scan(scan_at)
            if due:
                self.next_scan = step * 2

    def _scan(self, step: int) -> None:
        self._last_scan_at = step
        skip_storages: set[int] = set()
        for optimizer in list(self._graphs.optimizers):
            for p in parameters(optimizer):
                try:
                    skip_storages.add(p.untyped_storage().data_ptr())
                except Exception:  # noqa: BLE001
                    pass
        # Read the user's locals first: that refreshes the snapshot a frame keeps of them since the last
        # scan read them, which would otherwise still hold that step's tensors.
        locals_index, snapshots = frame_locals(set())
        begin = perf_counter()
        found = scan(self.starts, step, skip_storages, self.traced_step)
        diagnosis = self._diagnose(found, locals_index, snapshots)
        self.scans += 1
        self.scan_seconds += perf_counter() - begin
        if self.diagnosis is None or (diagnosis.groups and diagnosis.weight >= self.diagnosis.weight):
            self.diagnosis = diagnosis

    def _diagnose(self, found: Scan, locals_index: dict[int, tuple[str, str]], snapshots: set[int]) -> Diagnosis:
        """Name the holders of what ``found`` retained, then let go of the tensors."""
        items = found.retained
        targets = [item.tensor for item in items]
        for item in items:
            item.tensor = None
        by_id = {id(t): i for i, t in enumerate(targets)}
        skip = {id(targets), id(items), id(found)} | snapshots
        holders: dict[int, Any] = {}
        unresolved = list(range(len(targets)))
        for _ in range(HOLDER_ROUNDS):
            if not unresolved:
                break
            # The newest retained tensors first, then a spread over the older ones.
            picked = _spread(unresolved, HOLDER_SAMPLE)
            sample = [targets[i] for i in picked]
            skip.add(id(sample))
            result = find_holders(sample, skip, locals_index)
            for i in picked:
                holders[i] = result.get(id(targets[i]), (None, None))
            for holder, container in list(result.values()):
                if isinstance(container, (list, tuple, set, frozenset, dict)):
                    values = container.values() if isinstance(container, dict) else container
                    for value in values:
                        j = by_id.get(id(value))
                        if j is not None and j not in holders:
                            holders[j] = (holder, container)
            del sample, result
            unresolved = [i for i in unresolved if i not in holders]
        groups: dict[str, Group] = {}
        for i, item in enumerate(items):
            holder = holders.get(i, (None, None))[0]
            if holder is None and id(targets[i]) in found.saved_ids:
                continue  # saved by another retained graph (torch keeps its Python object): part of that one
            label = holder.label if holder is not None else ""
            group = groups.get(label)
            if group is None:
                group = groups[label] = Group(
                    label, holder.container if holder else "", holder.user if holder else True
                )
            group.tensors += 1
            group.own_steps.append(item.own_step)
            group.steps.update(s for s in item.steps if s < found.at_step)
            group.node_ids.update(item.nodes)
            group.storages.update(item.storages)
            group.data_bytes += item.data_bytes
            group.node_names[item.node_name] = group.node_names.get(item.node_name, 0) + 1
            if group.trace is None and item.trace is not None:
                group.trace = item.trace
        holders.clear()
        del targets
        # The holder that grows most often first (every step: the leak the run is about; a list cleared at each
        # epoch's end holds few steps when scanned, yet grows in every one), then the one that grew in the most
        # steps, then by the steps its graphs span and the tensors it holds. A holder that grows once an epoch
        # may hold more steps' graphs (an epoch's outputs in one tensor) and still come after it.
        ordered = sorted(groups.values(), key=lambda g: (-g.growth_rate, -g.grew_in, -len(g.steps), -g.tensors))
        return Diagnosis(
            found.at_step, ordered, found.graph_tensors, found.nodes_visited, found.truncated, found.seconds
        )

    # -- verdict ------------------------------------------------------------------------
    def result(self) -> CheckResult:
        figures = self._figures()
        steps = self.run.steps
        if not steps:
            return CheckResult(NAME, NOT_CHECKED, "no training step was seen", 0, [], figures)
        if self.first_seen is None:
            if not self.tagged_steps or not self.backward_passes:
                return CheckResult(
                    NAME, NOT_CHECKED, f"no backward pass in the {plural(steps, 'step')} seen", 0, [], figures
                )
            if not self.judged:
                return CheckResult(
                    NAME,
                    NOT_CHECKED,
                    "no optimizer step and no second backward pass in the run: a step's graph is judged once "
                    "its optimizer step (without an optimizer, the next backward pass) has run",
                    0,
                    [],
                    figures,
                )
            summary = (
                f"no autograd graph outlived its step ({plural(steps, 'step')}, "
                f"graphs of {plural(self.tagged_steps, 'step')} tracked)"
            )
            return CheckResult(NAME, PASSED, summary, 0, [], figures)
        findings = self._findings()
        diagnosis = self.diagnosis
        retained_steps = len(self.survived)
        if diagnosis is not None and diagnosis.groups:
            top = diagnosis.groups[0]
            who = top.holder or "an unnamed holder"
            summary = f"graphs of {plural(len(top.steps), 'step')} kept by {who}"
            if len(diagnosis.groups) > 1:
                summary += f" (+{len(diagnosis.groups) - 1} more)"
            count = sum(len(g.steps) for g in diagnosis.groups)
        else:
            summary = f"graph nodes of {plural(retained_steps, 'step')} outlived their step"
            count = retained_steps
        return CheckResult(NAME, FAILED, summary, count, findings, figures)

    def _findings(self) -> list[Finding]:
        assert self.first_seen is not None
        tagged, seen = self.first_seen
        after = "its optimizer step had run" if self._graphs.optimizer_steps else "a later backward pass had run"
        first_fact = (
            f"first seen after step {seen} ended: the graph built in step {tagged} was still alive after "
            f"{after} and step {tagged + 1} had ended"
        )
        diagnosis = self.diagnosis
        if diagnosis is None or not diagnosis.groups:
            facts = [first_fact]
            if diagnosis is not None:
                facts.append(
                    f"no Python object alive at step {diagnosis.at_step} holds a tensor with those nodes: they are "
                    "held from C++ (a hook registered on a tensor, another graph's saved tensor, a custom "
                    "autograd.Function's context), or were only held until that scan"
                )
            title = f"autograd graphs of {plural(len(self.survived), 'step')} outlived their step"
            return [Finding(title, facts, [], _HINT)]
        findings = []
        for group in diagnosis.groups:
            title = f"{group.holder or 'held by an object torchperf could not name'}: {group.describe()}"
            facts = [group.growth()]
            if group.data_bytes:
                facts.append(f"tensor data kept: {format_bytes(group.data_bytes)}")
            names = ", ".join(f"{name} ({n})" if n > 1 else name for name, n in sorted(group.node_names.items()))
            facts.append(f"built by: {names}")
            if not group.user:
                facts.append("the holder is an object of torch or the framework")
            facts.append(f"counted when step {diagnosis.at_step} had run; " + first_fact)
            sites = []
            if group.trace:
                sites.append(Site("retained tensor created", group.trace))
            else:
                facts.append(
                    "the line that built it was not recorded (torch records it in the step after the retention "
                    "is first seen; the run ended before)"
                )
            findings.append(Finding(title, facts, sites, _hint(group)))
        if diagnosis.truncated:
            findings[-1].facts.append("the scan stopped after 200000 graph nodes: the figures are lower bounds")
        return findings

    def _figures(self) -> Figures:
        figures: Figures = {
            "steps": self.run.steps,
            "steps_tracked": self.tagged_steps,
            "steps_judged": len(self.judged),
            "graph_nodes_tagged": self.nodes_tagged,
            "module_outputs_tagged": self.outputs_tagged,
            "backward_passes": self.backward_passes,
            "backward_passes_sampled": self.sampled_passes,
            "sampling_ms": round(self.sample_seconds * 1e3, 3),
            "steps_retained": len(self.survived),
            "scans": self.scans,
            "scan_ms": round(self.scan_seconds * 1e3, 1),
        }
        diagnosis = self.diagnosis
        if diagnosis is not None and diagnosis.groups:
            steps = set().union(*(g.steps for g in diagnosis.groups))
            n = max(len(steps), 1)
            tensors = sum(g.tensors for g in diagnosis.groups)
            nodes = sum(g.nodes for g in diagnosis.groups)
            saved = sum(g.saved_bytes for g in diagnosis.groups)
            figures.update(
                {
                    "retained_tensors": tensors,
                    "retained_graph_nodes": nodes,
                    "retained_saved_bytes": saved,
                    "retained_tensors_per_step": round(tensors / n, 3),
                    "retained_nodes_per_step": round(nodes / n, 3),
                    "retained_saved_bytes_per_step": round(saved / n, 1),
                    "holders": [g.holder for g in diagnosis.groups],
                    "scanned_at_step": diagnosis.at_step,
                }
            )
        if self.memory is not None:
            figures.update(self.memory.figures())
        return figures


_HINT = (
    "keep values, not graphs: loss.detach() (loss.item() outside the hot path: it waits for the device), or a "
    "torchmetrics metric (MeanMetric, or the metric itself), which detaches what it accumulates."
)


def _hint(group: Group) -> str:
    if group.spanning:
        return (
            "each step adds its loss's graph to one running total, so no step's graph is ever freed: accumulate "
            "loss.detach() (total += loss.detach()), loss.item() outside the hot path, or a torchmetrics "
            "MeanMetric."
        )
    if group.saved_bytes:
        return (
            "these tensors were never part of a backward pass, so their graphs still hold every activation they "
            "saved: compute outputs you only look at under torch.no_grad(), or keep out.detach()."
        )
    if group.container:
        return (
            f"put .detach()ed tensors in this {group.container} (outputs.append(preds.detach())), or update a "
            "torchmetrics metric each step instead of collecting tensors for the epoch's end (it detaches)."
        )
    return _HINT


def _spread(indices: list[int], k: int) -> list[int]:
    """At most ``k`` of ``indices``: the last one, then evenly spread over the rest."""
    if len(indices) <= k:
        return list(indices)
    step = len(indices) / k
    picked = {indices[-1]}
    picked.update(indices[int(i * step)] for i in range(k - 1))
    return sorted(picked)


class Figures(MemoryFigures, total=False):
    """The figures of a no_graph_retention verdict (see :mod:`pytest_torchperf.figures`)."""

    steps: int
    steps_tracked: int
    steps_judged: int
    graph_nodes_tagged: int
    module_outputs_tagged: int
    backward_passes: int
    backward_passes_sampled: int
    sampling_ms: float
    steps_retained: int
    scans: int
    scan_ms: float
    retained_tensors: int
    retained_graph_nodes: int
    retained_saved_bytes: int
    retained_tensors_per_step: float
    retained_nodes_per_step: float
    retained_saved_bytes_per_step: float
    holders: list[str]
    scanned_at_step: Optional[int]


INVARIANT = Invariant(
    name=NAME,
    doc="no tensor carrying an autograd graph built in a training step is still reachable after the next step",
    check=GraphRetentionCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("graphs",),
)
