"""Invariant ``gpu_settings`` (opt-in): the GPU math switches suit the GPU and the steps.

Two global switches cost GPU runs the most when they are left at their defaults:

- **TF32 off for float32 matmuls** (PyTorch's default since 1.12:
  ``torch.get_float32_matmul_precision() == "highest"``) or for cuDNN
  convolutions (``torch.backends.cudnn.allow_tf32 = False``) on a GPU with
  TF32 tensor cores (Ampere and later, compute capability 8.0+): float32
  matmuls run on the slow path (2.2x on one transformer);
- **``cudnn.benchmark=False`` while every step's convolutions ran on the same
  shapes**: cuDNN would pick its fastest algorithm once per shape and reuse it
  (60 to 25 minutes an epoch in one report). Measured: the set of input shapes
  of the convolutions in each step, the same in every step of at least
  ``gpu_settings_min_steps`` (default 3) steps.

``gpu_settings=True`` judges the run's CUDA device; on a run without CUDA the
check is "not checked" (not applicable). ``gpu_settings="ampere"`` (or
``"volta"``, ``"turing"``, ``"ada"``, ``"hopper"``, ``"blackwell"``) judges the
settings and the shapes as they would be on that GPU, on any machine: a CPU CI
run catches a setting the GPU run will pay for.

The switches are read at the first step and at the end of the run; the probe
(:mod:`pytest_torchperf.probes.gpu_settings`) wraps ``torch.nn.functional``'s
convolutions (the shapes) and ``torch.set_float32_matmul_precision`` (who set it).

Blind spots: convolutions called as ``torch.conv2d`` / ``torch.ops.aten``
directly, or inside compiled code, are not measured (their shapes then do not
count); TF32 is judged from the switches, not from the matmuls that ran: a run
whose matmuls are all bfloat16/float16 (autocast) does not need it, which the
check says when it saw an autocast region in the steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, TypedDict, Union

from ..arguments import Argument, ArgumentKind, Integer, UsageError, suggest
from ..core import Check
from ..probes import cuda_available
from ..probes.gpu_settings import settings
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run

NAME = "gpu_settings"

#: GPU generations and their compute capability (major, minor).
GENERATIONS = {
    "volta": (7, 0),
    "turing": (7, 5),
    "ampere": (8, 0),
    "ada": (8, 9),
    "hopper": (9, 0),
    "blackwell": (10, 0),
}


@dataclass(frozen=True)
class Target(ArgumentKind):
    """``True`` (the run's CUDA device), a GPU generation name, or ``None``/``False`` (off)."""

    json_type = ["boolean", "string", "null"]

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None or value is False:
            return None
        if value is True:
            return True
        if isinstance(value, str) and value.lower() in GENERATIONS:
            return value.lower()
        hint = suggest(value.lower(), tuple(GENERATIONS)) if isinstance(value, str) else ""
        raise UsageError(f"{where}: {name} must be {self.describe()}, got {value!r}{hint}")

    def describe(self, meaning: str = "") -> str:
        names = ", ".join(repr(g) for g in GENERATIONS)
        return f"True (the run's CUDA device), a GPU generation ({names}) or None"

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [{"type": "boolean"}, {"enum": list(GENERATIONS)}, {"type": "null"}]}


def _device_capability() -> Optional[tuple[str, tuple[int, int]]]:
    """``(name, capability)`` of the current CUDA device, or None without CUDA."""
    if not cuda_available():
        return None
    import torch

    index = torch.cuda.current_device()
    return torch.cuda.get_device_name(index), tuple(torch.cuda.get_device_capability(index))  # type: ignore[return-value]


class GpuSettingsCheck(Check):
    """Per-run state and verdict of ``gpu_settings``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.target = run.options.gpu_settings
        self.min_steps: int = run.options.gpu_settings_min_steps
        self.first: Optional[dict[str, Any]] = None
        self.last: Optional[dict[str, Any]] = None
        self.shapes: list[frozenset] = []
        self.autocast = 0
        self.precision_stack: Any = None
        self.precision_value: Optional[str] = None
        self._probe = run.probe("gpu_settings")

    def on_step_start(self) -> None:
        if self.first is None:
            self.first = settings()
        self._probe.current = set()

    def on_step_end(self) -> None:
        self.shapes.append(self._probe.take_step())

    def on_autocast(self, device: Any, dtype: Any) -> None:
        if self.run.in_scope:
            self.autocast += 1

    def on_run_end(self) -> None:
        self.last = settings()
        self.precision_stack = self._probe.precision_set
        self.precision_value = self._probe.precision_value

    def _gpu(self) -> Optional[tuple[str, tuple[int, int]]]:
        if isinstance(self.target, str):
            return f"an {self.target.capitalize()} GPU (gpu_settings={self.target!r})", GENERATIONS[self.target]
        found = _device_capability()
        if found is None:
            return None
        return f"{found[0]} (compute capability {found[1][0]}.{found[1][1]})", found[1]

    def _tf32(self, gpu: str, state: dict[str, Any]) -> Optional[Finding]:
        off = [what for what, key in (("float32 matmuls", "matmul_tf32"), ("cuDNN convolutions", "conv_tf32"))
               if not state[key]]
        if not off:
            return None
        facts = [f"on {gpu}, which has TF32 tensor cores"]
        sites = []
        if "float32 matmuls" in off:
            if self.precision_stack is not None:
                facts.append(f"torch.set_float32_matmul_precision({self.precision_value!r}) was called during the run")
                sites.append(Site("matmul precision set", self.precision_stack))
            else:
                facts.append(
                    f"torch.get_float32_matmul_precision() is {state['matmul_precision']!r}: PyTorch's default "
                    "(TF32 matmuls are off unless you turn them on)"
                )
        if "cuDNN convolutions" in off:
            facts.append("torch.backends.cudnn.allow_tf32 is False (PyTorch's default is True: it was turned off)")
        if self.autocast:
            facts.append(f"the steps entered autocast {plural(self.autocast, 'time')}: matmuls in it are not float32")
        hint = (
            "torch.set_float32_matmul_precision('high') (TF32 matmuls: 10 bits of mantissa, what most training "
            "needs) and leave torch.backends.cudnn.allow_tf32 True; keep 'highest' only where float32 accuracy "
            "is needed"
        )
        return Finding(f"TF32 is off for {' and '.join(off)}", facts, sites, hint)

    def _benchmark(self, state: dict[str, Any]) -> Optional[Finding]:
        with_convs = [s for s in self.shapes if s]
        if state["cudnn_benchmark"] or len(with_convs) < self.min_steps or len(set(with_convs)) != 1:
            return None
        shapes = sorted(with_convs[0])
        shown = ", ".join(f"{list(shape)} {dtype.replace('torch.', '')}" for shape, dtype in shapes[:3])
        more = f" and {len(shapes) - 3} more" if len(shapes) > 3 else ""
        facts = [
            f"every one of the {len(with_convs)} steps ran its convolutions on the same "
            f"{plural(len(shapes), 'input shape')}: {shown}{more}",
            "with fixed shapes cuDNN picks its fastest algorithm once per shape and reuses it",
        ]
        hint = "torch.backends.cudnn.benchmark = True (Lightning: Trainer(benchmark=True)) when input shapes are fixed"
        return Finding("cudnn.benchmark is False while every step's convolution shapes were identical", facts, [], hint)

    def result(self) -> CheckResult:
        state = self.last or settings()
        steps_with_convs = sum(1 for s in self.shapes if s)
        figures: dict[str, Any] = {
            "target": self.target,
            **{k: v for k, v in (self.first or state).items()},
            "steps": len(self.shapes),
            "steps_with_convolutions": steps_with_convs,
            "distinct_convolution_shape_sets": len({s for s in self.shapes if s}),
        }
        gpu = self._gpu()
        if gpu is None:
            return CheckResult(
                NAME, NOT_CHECKED,
                "not applicable: no CUDA device in this run (gpu_settings='ampere' judges the settings as they "
                "would be on that GPU)", figures=figures,
            )
        name, capability = gpu
        figures["compute_capability"] = list(capability)
        findings = []
        if capability >= (8, 0):
            tf32 = self._tf32(name, self.first or state)
            if tf32 is not None:
                findings.append(tf32)
        benchmark = self._benchmark(self.first or state)
        if benchmark is not None:
            findings.append(benchmark)
        if findings:
            summary = "; ".join(f.title for f in findings)
            return CheckResult(NAME, FAILED, summary, len(findings), findings, figures)
        summary = f"GPU settings suit {name}"
        if steps_with_convs:
            summary += f" ({plural(steps_with_convs, 'step')} with convolutions)"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a gpu_settings verdict (see :mod:`pytest_torchperf.figures`)."""

    target: Union[bool, str]
    matmul_tf32: bool
    matmul_precision: str
    conv_tf32: bool
    cudnn_benchmark: bool
    steps: int
    steps_with_convolutions: int
    distinct_convolution_shape_sets: int
    compute_capability: list[int]


INVARIANT = Invariant(
    name=NAME,
    doc="TF32 on for float32 matmuls/convolutions on GPUs that have it, cudnn.benchmark on with fixed conv shapes "
    "(True: the run's GPU; 'ampere'...: judged as on that GPU)",
    check=GpuSettingsCheck,
    figures=Figures,
    kind=Target(),
    default=None,
    probes=("gpu_settings", "autocast"),
    arguments=(
        Argument(
            "gpu_settings_min_steps",
            Integer(minimum=2, optional=False),
            3,
            "gpu_settings judges cudnn.benchmark only after this many steps ran convolutions on identical shapes",
            meaning="the steps with identical convolution shapes needed",
        ),
    ),
)
