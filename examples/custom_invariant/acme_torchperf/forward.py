"""Invariant ``no_host_to_device_in_forward``: a module's ``forward`` never copies a host tensor to the device.

Our models must be exportable and CUDA-graph friendly, so their ``forward``
may not build a tensor on the host and move it (``torch.arange(n).to(x.device)``),
even where pytest-torchperf's own ``on_device`` would accept it. This check
listens to the ``on_move`` events of pytest-torchperf's ``tensors`` probe (sent
inside training steps, on CPU-only CI too) and fails when the move happens
inside an ``nn.Module.forward``. ``max_forward_copies`` is a per-step budget.

Everything else comes with pytest-torchperf: validation of the arguments, the
failure report, the summary, the JSON report, JUnit properties and xdist.
"""

from __future__ import annotations

from types import FrameType
from typing import Any, Optional

from pytest_torchperf.extend import (
    Argument,
    Check,
    CheckResult,
    Finding,
    Flag,
    Integer,
    Invariant,
    MoveEvent,
    Run,
    Site,
    Status,
    describe_frame,
    stack_of,
)

NAME = "no_host_to_device_in_forward"


def _forward_frame(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost ``forward`` of an ``nn.Module`` on the stack, if the move happened inside one."""
    import torch

    f = frame
    while f is not None:
        if f.f_code.co_name == "forward" and isinstance(f.f_locals.get("self"), torch.nn.Module):
            return f
        f = f.f_back
    return None


class ForwardCopies(Check):
    """Per-run state and verdict: copies made inside forward passes, by line."""

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.budget: Optional[int] = self.settings.max_forward_copies
        self.sites: dict[tuple[str, int], dict[str, Any]] = {}
        self.per_step: dict[int, int] = {}

    def on_move(self, event: MoveEvent) -> None:
        forward = _forward_frame(event.frame)
        if forward is None:
            return
        mover = event.frame
        key = (mover.f_code.co_filename, mover.f_lineno)
        site = self.sites.get(key)
        if site is None:
            module = type(forward.f_locals["self"]).__name__
            site = self.sites[key] = {"module": module, "stack": stack_of(mover), "count": 0,
                                      "frame": describe_frame(mover)}
        site["count"] += 1
        step = self.run.unit
        if step is not None:
            self.per_step[step] = self.per_step.get(step, 0) + 1

    def result(self) -> CheckResult:
        count = sum(s["count"] for s in self.sites.values())
        worst = max(self.per_step.values(), default=0)
        figures = {"copies_in_forward": count, "worst_step": worst, "sites": len(self.sites)}
        over = worst > self.budget if self.budget is not None else count > 0
        if not over:
            return CheckResult(NAME, Status.PASSED, f"{count} host-to-device copies in forward passes", 0, [], figures)
        findings = [
            Finding(
                f"{s['module']}.forward copies a host tensor to the device: {s['count']} times",
                [f"at {s['frame'].location()}: {s['frame'].source}"],
                [Site("moved in forward", s["stack"], s["count"])],
                "build it on the device (`device=x.device`) or register it as a buffer in `__init__`",
            )
            for s in self.sites.values()
        ]
        summary = f"{count} host-to-device copies inside forward, at most {worst} in a step"
        return CheckResult(NAME, Status.FAILED, summary, count, findings, figures)


INVARIANT = Invariant(
    name=NAME,
    doc="no host tensor is copied to the device inside an nn.Module's forward",
    check=ForwardCopies,
    kind=Flag(),
    default=False,
    probes=("tensors",),
    arguments=(
        Argument(
            "max_forward_copies",
            Integer(minimum=0),
            None,
            "no_host_to_device_in_forward passes while no step makes more than N such copies",
            meaning="the most copies inside forward passes any step may make",
        ),
    ),
)
