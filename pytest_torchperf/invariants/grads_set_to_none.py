"""Invariant ``grads_set_to_none``: gradients are cleared by setting them to None, not by writing zeros.

``optimizer.zero_grad()`` sets every ``.grad`` to None (the default since torch
2.0): the next backward allocates each gradient and *writes* it. Zeroing in
place (``zero_grad(set_to_none=False)``, ``p.grad.zero_()``) costs a memset per
parameter per step, then makes the backward *accumulate* (read + add + write)
into the zeros, and keeps the gradients' memory alive between steps.

What is seen (the whole run: Lightning zeroes gradients outside
``training_step``, so ``scope`` does not narrow this check):

- ``Optimizer.zero_grad`` and ``Module.zero_grad`` are wrapped (:mod:`pytest_torchperf.probes.grads`): a call with
  ``set_to_none=False`` is recorded with its stack;
- ``Tensor.zero_`` is wrapped: zeroing a tensor that is (or aliases, like
  ``p.grad.data``) the current gradient of a parameter some optimizer stepped
  is recorded. The gradients of the parameters every optimizer stepped are
  indexed by storage address, lazily: at the first ``zero_`` call after each
  optimizer step (so a program that never calls ``zero_`` pays nothing), and a
  hit is confirmed against the parameter's current ``.grad``;
- the optimizer step hook (:mod:`pytest_torchperf.probes.optimizers`) compares each parameter's
  gradient with the one the previous step of that optimizer consumed: the
  *same tensor object* means it was never set to None in between (zeroed in
  place by any means, or never cleared), even where no call above was seen
  (``p.grad.mul_(0)``, an optimizer overriding ``zero_grad``).

Correct programs that keep gradients on purpose (CUDA graph capture needs
static ``.grad`` tensors; DDP with ``gradient_as_bucket_view=True`` reuses
them) should leave this invariant off.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..probes import optimizers as _optimizers
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site, merge_sites
from ..stacks import Stack, capture
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run

NAME = "grads_set_to_none"

ZERO_GRAD = "zero_grad"
MANUAL = "manual"


class GradsCheck(Check):
    """Per-run state and verdict of ``grads_set_to_none``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.events: dict[str, list[Site]] = {ZERO_GRAD: [], MANUAL: []}
        self.shapes: set[str] = set()
        self.optimizer_steps = 0
        self.steps_reusing_grads = 0
        self.most_reused = 0
        self._first_reuse: Optional[Stack] = None
        self._previous: weakref.WeakKeyDictionary[Any, list[Optional[weakref.ref]]] = weakref.WeakKeyDictionary()

    # -- events ------------------------------------------------------------------------
    def on_zero_grad(self, owner: str, stack: Stack) -> None:
        self.events[ZERO_GRAD].append(Site(f"{owner}.zero_grad(set_to_none=False)", stack))

    def on_grad_zeroed(self, shape: tuple, stack: Stack) -> None:
        self.events[MANUAL].append(Site("parameter gradient zeroed in place", stack))
        self.shapes.add("x".join(str(d) for d in shape) or "scalar")

    def on_optimizer_step(self, optimizer: Any) -> None:
        self.optimizer_steps += 1
        params = _optimizers.parameters(optimizer)
        previous = self._previous.get(optimizer)
        current: list[Optional[weakref.ref]] = []
        reused = 0
        for i, p in enumerate(params):
            grad = p.grad
            if grad is None:
                current.append(None)
                continue
            if previous is not None and i < len(previous):
                ref = previous[i]
                if ref is not None and ref() is grad:
                    reused += 1
            current.append(weakref.ref(grad))
        try:
            self._previous[optimizer] = current
        except TypeError:  # pragma: no cover - an optimizer that cannot be weakly referenced
            pass
        if reused:
            self.steps_reusing_grads += 1
            self.most_reused = max(self.most_reused, reused)
            if self._first_reuse is None:
                self._first_reuse = capture(2)

    # -- verdict ---------------------------------------------------------------------
    def result(self) -> CheckResult:
        zero_grads = merge_sites(self.events[ZERO_GRAD])
        manual = merge_sites(self.events[MANUAL])
        n_zero_grad = sum(s.count for s in zero_grads)
        n_manual = sum(s.count for s in manual)
        figures: Figures = {
            "optimizer_steps": self.optimizer_steps,
            "steps_reusing_grads": self.steps_reusing_grads,
            "most_grads_reused_in_a_step": self.most_reused,
            "zero_grad_set_to_none_false": n_zero_grad,
            "grads_zeroed_in_place": n_manual,
        }
        findings = []
        reuse_fact = (
            f"gradients were reused (zeroed in place, not freed) in {self.steps_reusing_grads} of "
            f"{self.optimizer_steps} optimizer steps, up to {self.most_reused} parameters per step"
        )
        if zero_grads:
            facts = [reuse_fact] if self.steps_reusing_grads else []
            findings.append(
                Finding(
                    f"zero_grad(set_to_none=False) called {plural(n_zero_grad, 'time')}",
                    facts,
                    zero_grads,
                    "call zero_grad() with the default set_to_none=True: the gradients are freed and the next "
                    "backward writes them afresh instead of adding into zeros (Lightning: drop the "
                    "set_to_none=False from your optimizer_zero_grad override, or the override itself).",
                )
            )
        if manual:
            facts = [f"gradient shapes: {', '.join(sorted(self.shapes)[:8])}"]
            if self.steps_reusing_grads and not zero_grads:
                facts.append(reuse_fact)
            findings.append(
                Finding(
                    f".grad.zero_() called {plural(n_manual, 'time')} on parameter gradients",
                    facts,
                    manual,
                    "replace the loop that zeroes each p.grad by optimizer.zero_grad() (or "
                    "model.zero_grad()), which sets the gradients to None.",
                )
            )
        if not findings and self.steps_reusing_grads:
            sites = [Site("optimizer step with reused gradients", self._first_reuse)] if self._first_reuse else []
            findings.append(
                Finding(
                    f"the same gradient tensors were consumed by {self.steps_reusing_grads} of "
                    f"{self.optimizer_steps} optimizer steps",
                    [
                        f"up to {self.most_reused} parameters per step kept their .grad tensor from the previous "
                        "step: it was zeroed in place by code torchperf did not see (p.grad.mul_(0), "
                        "p.grad[:] = 0, an optimizer overriding zero_grad) or never cleared",
                    ],
                    sites,
                    "clear gradients with optimizer.zero_grad() (set_to_none=True) between steps.",
                )
            )
        if findings:
            count = n_zero_grad + n_manual or self.steps_reusing_grads
            parts = []
            if n_zero_grad:
                parts.append(f"{n_zero_grad} zero_grad(set_to_none=False)")
            if n_manual:
                parts.append(f"{n_manual} .grad.zero_()")
            if not parts:
                parts.append(f"gradients reused in {self.steps_reusing_grads} optimizer steps")
            return CheckResult(NAME, FAILED, ", ".join(parts), count, findings, figures)
        if not self.optimizer_steps:
            return CheckResult(
                NAME, NOT_CHECKED, "no optimizer step in the run: no step between which gradients are cleared",
                0, [], figures,
            )
        summary = f"{self.optimizer_steps} optimizer steps, gradients set to None between them"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a grads_set_to_none verdict (see :mod:`pytest_torchperf.figures`)."""

    optimizer_steps: int
    steps_reusing_grads: int
    most_grads_reused_in_a_step: int
    zero_grad_set_to_none_false: int
    grads_zeroed_in_place: int


INVARIANT = Invariant(
    name=NAME,
    doc="gradients are cleared by setting them to None: no zero_grad(set_to_none=False), no .grad.zero_()",
    check=GradsCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("optimizers", "grads"),
)
