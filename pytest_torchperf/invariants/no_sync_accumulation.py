"""Invariant ``no_sync_accumulation``: with gradient accumulation under DDP, one all-reduce per optimizer step.

``DistributedDataParallel`` all-reduces every gradient bucket at the end of
each backward pass, unless the forward ran inside ``model.no_sync()``.
Accumulating N micro-batches per optimizer step without it sends the whole
model's gradients over the network N times where once would do: only the last
micro-batch's backward needs to sync (the reduced sum is the same). Lightning
does this for you with ``accumulate_grad_batches`` in automatic optimization;
a manual loop, manual optimization or Fabric must do it.

Seen through the probe :mod:`pytest_torchperf.probes.ddp`: every DDP forward
pass with gradients enabled is a micro-batch; every call of the reducer's
``prepare_for_backward`` arms one all-reduce round for the next backward (DDP
makes it after a forward outside ``no_sync()``; Lightning makes it before a
manual-optimization backward unless ``toggle_model(sync_grad=False)``). The
rounds between two optimizer steps (the ``optimizers`` probe) are what the step
paid for. Works on CPU with gloo exactly as on GPUs with NCCL: it counts DDP's
own decisions, not network traffic (checked against a counting comm hook).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack, capture, until_user_frame
from ..text import plural
from ._ddp import Context

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_sync_accumulation"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


class SyncAccumulationCheck(Check):
    """Per-run state and verdict of ``no_sync_accumulation``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.context = Context()
        self.micro_batches = 0  # in the current optimizer step
        self.rounds = 0
        #: (micro-batches, all-reduce rounds) of each optimizer step that followed DDP forwards.
        self.steps: list[tuple[int, int]] = []
        self.forwards = 0
        self.grad_bytes = 0
        self.first_extra: Optional[Stack] = None
        #: id(reducer) -> the bytes of gradients its DDP module all-reduces per round (no reference to the module:
        #: a rank must be able to free its DDP, and the process group it holds, before it exits).
        self._sizes: dict[int, int] = {}
        self._torch: Any = None
        #: FSDP2 seen; id(parameter group) -> forwards with gradients / reduce-scatter rounds in this optimizer step.
        self.fsdp = False
        self._fsdp_forwards: dict[int, int] = {}
        self._fsdp_rounds: dict[int, int] = {}
        #: Per entry of ``steps``: whether it was an FSDP2 step (no DDP round in it).
        self._fsdp_steps: list[bool] = []

    def on_framework_call(self, call: FrameworkCall) -> None:
        self.context.on_framework_call(call)

    def on_ddp_forward(self, module: Any) -> None:
        torch = self._torch
        if torch is None:
            import torch

            self._torch = torch
        self.forwards += 1
        key = id(getattr(module, "reducer", None))
        if key not in self._sizes:
            self._sizes[key] = sum(p.numel() * p.element_size() for p in module.module.parameters() if p.requires_grad)
        if torch.is_grad_enabled():
            self.micro_batches += 1

    def on_ddp_armed(self, reducer: Any) -> None:
        self.rounds += 1
        self.grad_bytes = max(self.grad_bytes, self._sizes.get(id(reducer), 0))
        if self.rounds == 2 and self.first_extra is None:
            self.first_extra = until_user_frame(capture(3))

    # FSDP2 (``fully_shard``): each parameter group's forwards and reduce-scattering post-backwards
    # (probe fsdp); a step's micro-batches and rounds are those of its busiest group.
    def on_fsdp_forward(self, group: Any) -> None:
        torch = self._torch
        if torch is None:
            import torch

            self._torch = torch
        if torch.is_grad_enabled():
            self.fsdp = True
            self._fsdp_forwards[id(group)] = self._fsdp_forwards.get(id(group), 0) + 1

    def on_fsdp_reduce(self, group: Any, reduces: bool) -> None:
        if not reduces:
            return
        rounds = self._fsdp_rounds[id(group)] = self._fsdp_rounds.get(id(group), 0) + 1
        if rounds == 2 and self.first_extra is None:
            self.first_extra = until_user_frame(capture(3))

    def on_optimizer_step(self, optimizer: Any) -> None:
        fsdp_micro = max(self._fsdp_forwards.values(), default=0)
        fsdp_rounds = max(self._fsdp_rounds.values(), default=0)
        micro = max(self.micro_batches, fsdp_micro)
        rounds = max(self.rounds, fsdp_rounds)
        if micro or rounds:
            self.steps.append((micro, rounds))
            self._fsdp_steps.append(bool(fsdp_micro or fsdp_rounds) and not self.rounds)
        self.micro_batches = self.rounds = 0
        self._fsdp_forwards.clear()
        self._fsdp_rounds.clear()

    def result(self) -> CheckResult:
        steps = self.steps
        fsdp_only = False
        if any(self._fsdp_steps):
            ddp_extra = any(r > 1 for (_, r), f in zip(steps, self._fsdp_steps) if not f)
            if not ddp_extra:  # judge FSDP2's steps (DDP's, if any, were fine), in FSDP2's words
                steps = [s for s, f in zip(steps, self._fsdp_steps) if f]
                fsdp_only = True
        micro = sum(m for m, _ in steps)
        rounds = sum(r for _, r in steps)
        extra = sum(max(r - 1, 0) for _, r in steps)
        worst = max((r for _, r in steps), default=0)
        figures: Figures = {
            "ddp_forwards": self.forwards,
            "optimizer_steps": len(steps),
            "micro_batches": micro,
            "all_reduce_rounds": rounds,
            "extra_rounds": extra,
            "max_rounds_per_step": worst,
            "gradient_bytes_per_round": self.grad_bytes,
        }
        if not steps:
            why = (
                "no DistributedDataParallel or FSDP2 forward pass with gradients in this process"
                if not self.forwards and not self.fsdp
                else "DDP or FSDP2 forward passes but no optimizer step after them"
            )
            return CheckResult(NAME, NOT_CHECKED, why, 0, [], figures)
        per_step = f"{micro / len(steps):g} micro-batches" if micro != len(steps) else "1 micro-batch"
        if not extra:
            sync = "reduce-scatter" if fsdp_only else "all-reduce"
            return CheckResult(
                NAME, PASSED,
                f"at most 1 {sync} per optimizer step over {plural(len(steps), 'step')} ({per_step} each)",
                0, [], figures,
            )
        bad = sum(1 for _, r in steps if r > 1)
        summary = (
            f"{rounds} all-reduce rounds for {plural(len(steps), 'optimizer step')}, up to {worst} per step: "
            f"{extra} not needed"
        )
        facts = [
            f"{bad} of {len(steps)} optimizer steps accumulated {per_step} and all-reduced the gradients after "
            f"each of them; only the last micro-batch's backward needs to sync",
        ]
        if self.grad_bytes:
            facts.append(
                f"each round all-reduces {_bytes(self.grad_bytes)} of gradients: {_bytes(self.grad_bytes * extra)} "
                "sent for nothing"
            )
        sites = [Site("an extra all-reduce armed by this forward", self.first_extra)] if self.first_extra else []
        if fsdp_only:
            sites = [Site("an extra reduce-scatter after this backward", self.first_extra)] if self.first_extra else []
            facts[0] = facts[0].replace("all-reduced the gradients", "reduce-scattered the gradients (FSDP2)")
            finding = Finding(
                f"gradients reduce-scattered on every micro-batch (FSDP2): {extra} extra reduce-scatter rounds",
                facts, sites, self._fsdp_hint(),
            )
            summary = summary.replace("all-reduce rounds", "reduce-scatter rounds")
            return CheckResult(NAME, FAILED, summary, extra, [finding], figures)
        finding = Finding(
            f"gradients all-reduced on every micro-batch: {extra} extra all-reduce rounds", facts, sites, self._hint()
        )
        return CheckResult(NAME, FAILED, summary, extra, [finding], figures)

    def _fsdp_hint(self) -> str:
        if self.context.lightning:
            return (
                "let Lightning accumulate: Trainer(accumulate_grad_batches=N) defers the reduce-scatter to the "
                "last micro-batch"
            )
        return (
            "call model.set_requires_gradient_sync(False) before every micro-batch but the last, and "
            "set_requires_gradient_sync(True) before the last: FSDP2 then reduce-scatters once per optimizer step"
        )

    def _hint(self) -> str:
        ctx = self.context
        if ctx.lightning and ctx.manual_optimization:
            return (
                "in manual optimization, run the micro-batches that do not step under "
                "`with optimizer.toggle_model(sync_grad=False):` (optimizer = self.optimizers())"
            )
        if ctx.lightning:
            return ("let Lightning accumulate: Trainer(accumulate_grad_batches=N) skips the all-reduce of the first "
                    "N-1 micro-batches")
        return (
            "run the forward and backward of every micro-batch but the last under `with model.no_sync():` "
            "(Fabric: `with fabric.no_backward_sync(model, enabled=is_accumulating):`)"
        )


class Figures(TypedDict, total=False):
    """The figures of a no_sync_accumulation verdict (see :mod:`pytest_torchperf.figures`)."""

    ddp_forwards: int
    optimizer_steps: int
    micro_batches: int
    all_reduce_rounds: int
    extra_rounds: int
    max_rounds_per_step: int
    gradient_bytes_per_round: int


INVARIANT = Invariant(
    name=NAME,
    doc=(
        "with gradient accumulation under DDP or FSDP2, gradients are synced once per optimizer step "
        "(no_sync / set_requires_gradient_sync(False))"
    ),
    check=SyncAccumulationCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("ddp", "optimizers", "fsdp"),
)
