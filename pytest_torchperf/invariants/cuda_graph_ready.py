"""Invariant ``cuda_graph_ready`` (opt-in): each training step judged as a CUDA-graph capture would judge it.

A captured step (``torch.cuda.graph``, ``torch.compile(mode="reduce-overhead")``)
replays its kernels with no Python and no host in the loop, so the capture
fails (``operation not permitted when stream is capturing``) or torch falls
back to eager on anything that needs the host inside the step. Each of these is
a *blocker*, reported at its line with the reason and the fix, every site of
it, periodic ones included (a capture fails on any of them):

- a host sync (``.item()``, ``float(t)``, ``if t:``, ``.cpu()``, ``.tolist()``...)
  and a data-dependent shape (``nonzero``, boolean-mask indexing, ``masked_select``,
  ``unique``...): the ``on_sync`` events of :mod:`~pytest_torchperf.probes.syncs`;
- ``torch.cuda.synchronize()`` (seen on CUDA machines: without CUDA torch
  refuses the call) and ``torch.cuda.empty_cache()`` (on CPU too) inside a step;
- a host-to-device copy of a tensor built in the step (``on_move`` of
  :mod:`~pytest_torchperf.probes.tensors`): a replay copies nothing, the graph
  reads the address the capture saw;
- CPU randomness deciding tensor values: ``torch.randn(...)`` built on the host
  in the step and moved, or a tensor built in the step from Python or NumPy
  data whose line calls ``random``: the replay repeats the captured values;
- an optimizer that is not capturable (a ``param_groups`` entry with
  ``capturable=False``: Adam, AdamW, NAdam, RAdam...); torch's own capture
  check raises on it. On a CPU-only run the setting is judged (torch refuses
  ``capturable=True`` for CPU parameters: see the docs page for the idiom);
- input shapes that change between steps: a DataLoader feeding the steps
  yielded batches of more than one shape (a ragged last batch): a graph is
  captured for one shape.

Blockers in a library's code inside the step are notes; the user's fail.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..frames import locate, owner_label, stack_of
from ..probes.syncs import Sync
from ..probes.tensors import Move
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import USER, Frame, Stack, capture, site_of
from ..text import plural
from ._steps import PerStep, extent, frequency

if TYPE_CHECKING:
    from ..core import Run

NAME = "cuda_graph_ready"

# -- the blockers: a figure name, what the title says, and the fix -----------------------------------------
SYNC = "host_syncs"
SHAPE = "dynamic_shapes"
SYNCHRONIZE = "synchronize_calls"
EMPTY_CACHE = "empty_cache_calls"
COPY = "host_copies"
RANDOM = "cpu_randomness"
OPTIMIZER = "non_capturable_optimizers"
SHAPES = "shape_changes"
KINDS = (SYNC, SHAPE, SYNCHRONIZE, EMPTY_CACHE, COPY, RANDOM, OPTIMIZER, SHAPES)

_REASONS = {
    SYNC: "the host reads a device value: a capture cannot wait for the device (\"operation not permitted when "
          "stream is capturing\"), and a replay would not run the Python that reads it",
    SHAPE: "the output size depends on the values: a graph is recorded for fixed sizes, and learning this one "
           "needs a sync",
    SYNCHRONIZE: "a device synchronisation is not permitted while a stream is capturing",
    EMPTY_CACHE: "returning cached blocks to the driver is not permitted while a stream is capturing; a graph's "
                 "memory comes from its own pool",
    COPY: "a host-to-device copy of a tensor built in the step: a replay does not run the Python that fills it, "
          "the graph reads the host memory the capture saw (from pageable memory the copy cannot be captured)",
    RANDOM: "host randomness decides these values: a replay repeats the values the capture drew",
    OPTIMIZER: "its `step` counters live on the host: torch refuses to capture `step()` "
               "(\"param_groups' capturable is False\")",
    SHAPES: "a graph is captured for one set of input shapes: another shape needs another capture (or falls "
            "back to eager)",
}
_HINTS = {
    SYNC: "keep the value on the device (`torch.where`, accumulate with tensor ops) and read it outside the "
          "captured step, or after `graph.replay()`",
    SHAPE: "keep shapes static: `torch.where(mask, x, 0)`, `x * mask`, a masked sum/mean; `unique`/`bincount` "
           "with a known size: `zeros(N).scatter_add_`",
    SYNCHRONIZE: "remove it from the step; synchronise outside the captured region (after `graph.replay()`)",
    EMPTY_CACHE: "remove it from the step; for fragmentation set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
    COPY: "build it on the device (`device=x.device`, `torch.zeros_like(x)`), or register it as a buffer once; "
          "a batch goes into a static input tensor before the replay (`static_x.copy_(x)`)",
    RANDOM: "draw on the device inside the step (`torch.randn(shape, device=x.device)`, `torch.rand_like(x)`): "
            "torch's CUDA generator is graph-safe and advances at each replay",
    OPTIMIZER: "build it with `capturable=True` on the GPU (`torch.optim.AdamW(params, capturable=True)`); "
               "SGD has no host state",
    SHAPES: "keep the shapes fixed: `DataLoader(..., drop_last=True)`, or pad every batch to one size",
}
_TITLES = {
    SYNC: "host sync",
    SHAPE: "data-dependent shape",
    SYNCHRONIZE: "`torch.cuda.synchronize()`",
    EMPTY_CACHE: "`torch.cuda.empty_cache()`",
    COPY: "host-to-device copy of a tensor built in the step",
    RANDOM: "CPU randomness decides tensor values",
    OPTIMIZER: "optimizer not capturable",
    SHAPES: "input shapes change between steps",
}
#: Factories whose values are drawn by the host's generator.
_RANDOM_FACTORIES = frozenset(("rand", "randn", "randint", "randperm", "normal", "bernoulli", "multinomial"))
_SHAPE_HINTS = frozenset(("shape", "unique", "bincount", "repeat", "one_hot"))


class _Blocker(PerStep):
    """One blocker at one site, as one run saw it."""

    def __init__(self, kind: str, label: str, stack: Stack, order: int, by_user: bool, facts: list[str]) -> None:
        super().__init__()
        self.kind = kind
        self.label = label
        self.stack = stack
        self.frame: Optional[Frame] = site_of(stack)
        #: When it was first seen (``(step, sequence)``): the first blocker of the run is reported first.
        self.order = order
        self.first_step: Optional[int] = None
        self.by_user = by_user
        self.facts = facts

    def to_dict(self, total: int) -> dict[str, Any]:
        frame = self.frame
        return {
            "kind": self.kind,
            "label": self.label,
            "site": frame.location() if frame else None,
            "function": frame.function if frame else None,
            "source": frame.source if frame else None,
            "code": "user" if self.by_user else "framework",
            "count": self.count,
            "first_step": self.first_step,
            "frequency": frequency(self.per_unit, self.outside, total),
        }


class CudaGraphReadyCheck(Check):
    """Per-run state and verdict of ``cuda_graph_ready``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self._blockers: dict[Any, _Blocker] = {}
        self._log = run.probe("loaders").log_for(run, batches=True)
        self._tensors = run.probe("tensors")
        self._log.contents = True

    def _add(self, key: Any, kind: str, label: str, stack: Any, by_user: bool, facts: list[str]) -> None:
        blocker = self._blockers.get(key)
        if blocker is None:
            stack = stack() if callable(stack) else stack
            blocker = self._blockers[key] = _Blocker(kind, label, stack, len(self._blockers), by_user, facts)
            blocker.first_step = self.run.unit
        blocker.add(self.run.unit if self.run.in_scope else None, 0)

    # -- events from the probes ------------------------------------------------------------
    def on_sync(self, event: Sync) -> None:
        located = event.located
        if located.frame is None or event.op.hint == "cuda":
            # A sync only CUDA's debug mode reported (no wrapper saw it) is a blocking copy: a batch copied in
            # is outside a captured graph (it is copied into the graph's static inputs), and any other host
            # copy is judged by on_move. The GPU cross-check failed every clean step on the batch's copy.
            return None
        hint = event.op.hint
        kind = SHAPE if hint in _SHAPE_HINTS else SYNCHRONIZE if hint == "synchronize" else SYNC
        key = (kind, event.op.name, located.frame.f_code, located.frame.f_lineno)
        self._add(key, kind, event.op.label, lambda: stack_of(event.frame), located.kind == USER, [])
        return None

    def on_empty_cache(self, stack: Stack) -> None:
        if not self.run.in_scope:
            return
        frame = site_of(stack)
        key = (EMPTY_CACHE, frame.location() if frame else None)
        self._add(key, EMPTY_CACHE, "`torch.cuda.empty_cache()`", stack, frame is not None and frame.is_user, [])

    def on_move(self, event: Move) -> None:
        run = self.run
        birth = event.birth
        if birth is None:
            # On an accelerator: a real copy of a host tensor that is no batch (and not pinned staging memory).
            if not event.real_copy or self._tensors.from_loader(event.tensor):
                return
        elif birth.caller_kind != USER or birth.explicit or birth.with_module or not event.first:
            return  # torch's or a library's tensors, a host buffer on purpose, or one moved before
        elif run.unit is None or birth.unit_in(run) != run.unit:
            return  # built before the step: on_device judges a constant copied again
        mover = locate(event.frame)
        if mover.frame is None:
            return
        kind = COPY
        facts: list[str] = []
        if birth is not None:
            source = birth.site.source if birth.site is not None else ""
            if birth.factory in _RANDOM_FACTORIES or ("random" in source and (birth.array or birth.content)):
                kind = RANDOM
            made = "x.new_tensor(...)" if birth.factory == "new_tensor" else f"torch.{birth.factory}(...)"
            if birth.site is not None:
                facts.append(f"{made} built on the host at {birth.site.location()}: {birth.site.source}")
        label = "copied to the device" if kind == COPY else "host-drawn values copied to the device"
        key = (kind, mover.frame.f_code, mover.frame.f_lineno, birth.site.location() if birth and birth.site else None)
        self._add(key, kind, label, lambda: stack_of(event.frame), mover.kind == USER, facts)

    def on_optimizer_step(self, optimizer: Any) -> None:
        groups = getattr(optimizer, "param_groups", ()) or ()
        if not any("capturable" in g and not g["capturable"] for g in groups):
            return
        if (OPTIMIZER, id(optimizer)) in self._blockers:
            self._blockers[(OPTIMIZER, id(optimizer))].add(self.run.unit if self.run.in_scope else None, 0)
            return
        stack = capture(2)
        mine = [i for i, frame in enumerate(stack) if frame.kind == USER]
        if mine:  # the setting is the user's: the line of theirs that stepped it, past any wrapper's
            stack = stack[: mine[-1] + 1]
        name = type(optimizer).__name__
        facts = [f"torch.optim.{name} with capturable=False keeps its step counters on the host"]
        if any(g.get("fused") for g in groups):
            facts.append("fused=True does not make it capturable: torch checks `capturable` alone")
        self._add((OPTIMIZER, id(optimizer)), OPTIMIZER, f"`{name}.step()` (capturable=False)", stack, True, facts)

    def on_run_end(self) -> None:
        for rec in self._log.training_loaders():
            if len(rec.shapes) < 2:
                continue
            first, *others = list(rec.shapes.items())
            changed = others[0]
            count, pass_number, batch = changed[1]
            facts = [
                f"{rec.describe()} yielded {len(rec.shapes)} batch shapes: "
                + "; ".join(f"{_shapes(shape)} x{n[0]}" for shape, n in rec.shapes.items()),
                f"the first other shape came at batch {batch} of pass {pass_number}"
                + (" (a ragged last batch)" if rec.batch_size and count <= rec.passes else ""),
            ]
            stack = rec.site or ()
            blocker = self._blockers[(SHAPES, id(rec))] = _Blocker(
                SHAPES, f"batches of {_shapes(changed[0])} after {_shapes(first[0])}", stack, len(self._blockers),
                True, facts,
            )
            blocker.count = sum(n[0] for _, n in others)

    # -- verdict -------------------------------------------------------------------------------
    def _finding(self, b: _Blocker) -> Finding:
        total = self.run.units
        unit = self.run.unit_name
        note = "" if b.by_user else "note: "
        where = f" in {b.frame.function}" if b.frame is not None and b.kind != SHAPES else ""
        if b.kind == SHAPES:
            title = f"{note}{_TITLES[b.kind]}: {b.label}"
        else:
            title = f"{note}{_TITLES[b.kind]}: {b.label}{where}: {frequency(b.per_unit, b.outside, total, unit)}"
        facts = list(b.facts)
        facts.append(f"blocks a capture: {_REASONS[b.kind]}")
        if b.first_step is not None and b.kind != SHAPES:
            facts.append(f"first seen in {unit} {b.first_step + 1}")
        if not b.by_user and b.frame is not None:
            facts.append(f"made by {owner_label(b.frame)}, not by your code: a note, not a failure")
        label = "loader built" if b.kind == SHAPES else _TITLES[b.kind]
        return Finding(title, facts, [Site(label, b.stack, b.count)], _HINTS[b.kind] if b.by_user else "")

    def result(self) -> CheckResult:
        run = self.run
        total = run.units
        blockers = sorted(self._blockers.values(), key=lambda b: b.order)
        failing = [b for b in blockers if b.by_user]
        noted = [b for b in blockers if not b.by_user]
        figures: Figures = {"scope": run.scope, "steps": total}
        for kind in KINDS:
            figures[kind] = sum(b.count for b in failing if b.kind == kind)  # type: ignore[literal-required]
        figures.update({
            "blockers": sum(b.count for b in failing),
            "sites": len(failing),
            "framework_blockers": sum(b.count for b in noted),
            "first_blocker": _one_line(failing[0]) if failing else None,
            "events": [b.to_dict(total) for b in blockers],
        })
        findings = [self._finding(b) for b in failing + noted]
        noted_text = f"; {plural(len(noted), 'library site')} noted" if noted else ""
        if failing:
            first = _one_line(failing[0])
            more = f" (+{plural(len(failing) - 1, 'more site')})" if len(failing) > 1 else ""
            summary = f"a step would not capture into a CUDA graph: {first}{more}{noted_text}"
            return CheckResult(NAME, FAILED, summary, sum(b.count for b in failing), findings, figures)
        if not total:
            return CheckResult(NAME, NOT_CHECKED, "no training step ran: nothing to judge", 0, findings, figures)
        return CheckResult(NAME, PASSED, f"every step would capture: no blocker {extent(run)}{noted_text}", 0,
                           findings, figures)


def _one_line(b: _Blocker) -> str:
    where = f" at {b.frame.location()}" if b.frame is not None else ""
    label = f" ({b.label})" if b.label != _TITLES[b.kind] else ""
    return f"{_TITLES[b.kind]}{label}{where}"


def _shapes(shape: tuple[Any, ...]) -> str:
    return ", ".join("x".join(str(d) for d in s) or "scalar" for s in shape) or "no tensor"


class Figures(TypedDict, total=False):
    """The figures of a cuda_graph_ready verdict (see :mod:`pytest_torchperf.figures`)."""

    scope: str
    steps: int
    host_syncs: int
    dynamic_shapes: int
    synchronize_calls: int
    empty_cache_calls: int
    host_copies: int
    cpu_randomness: int
    non_capturable_optimizers: int
    shape_changes: int
    blockers: int
    sites: int
    framework_blockers: int
    first_blocker: Optional[str]
    events: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="each training step would capture into a CUDA graph: no sync, dynamic shape, in-step host copy, host "
        "randomness, non-capturable optimizer or changing input shape",
    check=CudaGraphReadyCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("tensors", "syncs", "cuda_cache", "optimizers", "loaders"),
)
