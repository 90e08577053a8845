"""Invariant ``mixed_precision``: on a GPU, training steps run under autocast or with 16-bit weights.

Tensor cores run float16/bfloat16 matrix products several times faster than
float32, and half-size activations halve the memory traffic. Training a CUDA
model in plain float32 leaves that on the table; ``torch.autocast`` (Lightning:
``Trainer(precision="16-mixed")`` or ``"bf16-mixed"``) keeps float32 weights and
runs the heavy ops in 16 bits.

What is seen while a run is active:

- ``torch.autocast.__enter__`` is wrapped (:mod:`pytest_torchperf.probes.autocast`) (``torch.cuda.amp.autocast``,
  Lightning's precision plugins and ``torch.amp`` regions in compiled graphs
  all go through it): an enabled region on a CUDA device is counted;
- after every optimizer step (:mod:`pytest_torchperf.probes.optimizers`), a step of parameters on a
  CUDA device is *mixed* if an autocast region was entered since that
  optimizer's previous step (or is active now), *16-bit* if all its parameters
  are float16/bfloat16 (``Trainer(precision="bf16-true")``, ``model.half()``),
  and *float32* otherwise.

The check fails when a float32 step ran on a CUDA device. On a machine without
CUDA, or when nothing was trained on a CUDA device, it is "not checked" with
that reason: float32 is the norm on a CPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..probes import cuda_available
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack, capture
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "mixed_precision"

#: Device types on which float32 training is reported.
ACCELERATORS: tuple[str, ...] = ("cuda",)
LOW_PRECISION = frozenset(("float16", "bfloat16"))


def _autocast_enabled(device: str) -> bool:
    import torch

    try:
        return bool(torch.is_autocast_enabled(device))
    except TypeError:  # pragma: no cover - torch < 2.4: the argument-less form is CUDA's
        return device == "cuda" and bool(torch.is_autocast_enabled())


class PrecisionCheck(Check):
    """Per-run state and verdict of ``mixed_precision``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self._optimizers = run.probe("optimizers")
        self.autocast_regions = 0
        self.autocast_dtypes: set[str] = set()
        self.steps = {"mixed": 0, "16-bit": 0, "float32": 0}
        self.steps_elsewhere = 0
        self.devices: set[str] = set()
        self.weights: set[str] = set()
        self.trainer_precision: Optional[str] = None
        self._regions_at_step: dict[int, int] = {}
        self._first_float32: Optional[Stack] = None

    # -- events ------------------------------------------------------------------------
    def on_framework_call(self, call: FrameworkCall) -> None:
        precision = getattr(call.trainer, "precision", None)
        if precision is not None:
            self.trainer_precision = str(precision)

    def on_autocast(self, device: str, dtype: Any) -> None:
        if device in ACCELERATORS:
            self.autocast_regions += 1
            self.autocast_dtypes.add(str(dtype).replace("torch.", ""))

    def on_optimizer_step(self, optimizer: Any) -> None:
        devices, dtypes = self._optimizers.placement(optimizer)
        on = sorted(devices & frozenset(ACCELERATORS))
        if not on:
            self.steps_elsewhere += 1
            return
        self.devices.update(on)
        self.weights.update(dtypes)
        before = self._regions_at_step.get(id(optimizer), 0)
        self._regions_at_step[id(optimizer)] = self.autocast_regions
        if dtypes and dtypes <= LOW_PRECISION:
            self.steps["16-bit"] += 1
        elif self.autocast_regions > before or any(_autocast_enabled(d) for d in on):
            self.steps["mixed"] += 1
        else:
            self.steps["float32"] += 1
            if self._first_float32 is None:
                self._first_float32 = capture(2)

    # -- verdict ---------------------------------------------------------------------
    def result(self) -> CheckResult:
        total = sum(self.steps.values())
        device = sorted(self.devices)[0] if self.devices else ACCELERATORS[0]
        figures: Figures = {
            "accelerator_available": cuda_available(),
            "optimizer_steps": total,
            "float32_steps": self.steps["float32"],
            "mixed_steps": self.steps["mixed"],
            "half_precision_steps": self.steps["16-bit"],
            "steps_on_other_devices": self.steps_elsewhere,
            "autocast_regions": self.autocast_regions,
            "autocast_dtypes": sorted(self.autocast_dtypes),
            "weight_dtypes": sorted(self.weights),
            "trainer_precision": self.trainer_precision,
        }
        names = "/".join(ACCELERATORS).upper()
        if not figures["accelerator_available"]:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                f"not applicable: no {names} device on this machine (float32 is the norm on a CPU)",
                figures=figures,
            )
        if not total:
            return CheckResult(
                NAME,
                NOT_CHECKED,
                f"not applicable: no optimizer stepped parameters on a {names} device",
                figures=figures,
            )
        fp32 = self.steps["float32"]
        if fp32:
            facts = [f"weights: {', '.join(sorted(self.weights))} on {device}; no autocast region was entered"]
            if self.trainer_precision is not None:
                facts.append(f"Trainer precision: {self.trainer_precision!r}")
            if self.steps["mixed"] or self.steps["16-bit"]:
                facts.append(f"{self.steps['mixed'] + self.steps['16-bit']} other steps did run in 16 bits")
            if self.trainer_precision is not None:
                hint = (
                    "train with Trainer(precision='bf16-mixed') (Ampere or newer GPUs) or "
                    "Trainer(precision='16-mixed')."
                )
            else:
                hint = (
                    f"run the forward pass and the loss under `with torch.autocast('{device}', "
                    "dtype=torch.bfloat16):` (float16 also needs torch.amp.GradScaler for the backward)."
                )
            sites = [Site("float32 optimizer step", self._first_float32)] if self._first_float32 else []
            title = f"{fp32} of {total} optimizer steps on {device} ran in float32 without autocast"
            summary = f"{plural(fp32, 'float32 optimizer step')} on {device}"
            return CheckResult(NAME, FAILED, summary, fp32, [Finding(title, facts, sites, hint)], figures)
        parts = []
        if self.steps["mixed"]:
            parts.append(f"{self.steps['mixed']} under autocast ({', '.join(sorted(self.autocast_dtypes))})")
        if self.steps["16-bit"]:
            parts.append(f"{self.steps['16-bit']} with 16-bit weights")
        summary = f"{total} optimizer steps on {device}: " + ", ".join(parts)
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a mixed_precision verdict (see :mod:`pytest_torchperf.figures`)."""

    accelerator_available: bool
    optimizer_steps: int
    float32_steps: int
    mixed_steps: int
    half_precision_steps: int
    steps_on_other_devices: int
    autocast_regions: int
    autocast_dtypes: list[str]
    weight_dtypes: list[str]
    trainer_precision: Any


INVARIANT = Invariant(
    name=NAME,
    doc="on a GPU, training steps run under autocast or in 16-bit (not applicable on CPU)",
    check=PrecisionCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("optimizers", "autocast"),
)
