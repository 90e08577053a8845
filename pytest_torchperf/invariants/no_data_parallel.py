"""Invariant ``no_data_parallel``: no ``torch.nn.DataParallel`` in the run.

``DataParallel`` drives every GPU from one Python process: on each forward it
copies the module's parameters to every device, scatters the batch, runs the
replicas in threads (under the GIL) and gathers the outputs on the first GPU,
where the loss and all gradients are reduced. ``DistributedDataParallel`` runs
one process per GPU and only all-reduces gradients, overlapped with the
backward pass; PyTorch recommends it even on a single machine, and Lightning 2
dropped its ``"dp"`` strategy.

Seen three ways, so it is caught on a CPU-only machine (where
``DataParallel`` just calls the module):

- ``DataParallel.forward`` is wrapped (:mod:`pytest_torchperf.probes.data_parallel`): every forward pass
  of any instance is counted (a Lightning 1.x ``"dp"`` strategy's wrapper included), with the line
  that called it;
- ``DataParallel.__init__`` is wrapped: an instance built during the run has
  its creation site; one that is never run (no forward pass, not driven, not in
  a Trainer's model: built to test unwrapping) is a note, not a finding;
- a subclass driven through another method (mmcv's ``MMDataParallel.train_step``)
  is seen where that method reads the wrapped ``.module``;
- at each Lightning Trainer call the model's modules are scanned
  (``isinstance``), and the strategy is named when it is Lightning 1.x's
  ``DataParallelStrategy`` / ``DataParallelPlugin``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..probes.data_parallel import DataParallelProbe
from ..registry import Invariant
from ..report import FAILED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_data_parallel"

#: Lightning 1.x strategy (1.6-1.9) and training-type plugin (1.5) classes that wrap the model in DataParallel.
_DP_STRATEGIES = ("DataParallelStrategy", "DataParallelPlugin")



class _Instance:
    def __init__(self, module: Any, probe: DataParallelProbe) -> None:
        self.ref = weakref.ref(module)
        inner = getattr(module, "module", None)
        self.description = f"{type(module).__name__}({type(inner).__name__})"
        self.device_ids = list(getattr(module, "device_ids", None) or [])
        self.created: Optional[Stack] = probe.created.get(module)
        #: The subclass's name when it is not torch's own DataParallel (``MMDataParallel``).
        self.subclass = "" if type(module).__module__.startswith("torch.") else type(module).__name__
        self.forwards = 0
        self.first_forward: Optional[Stack] = None
        #: Methods other than ``DataParallel.forward`` that drove it (``MMDataParallel.train_step``): calls each.
        self.used_by: dict[str, int] = {}
        self.first_use: Optional[Stack] = None
        self.in_model: Optional[str] = None  # "submodule 'net' of Regressor" when found in a Trainer's model

    @property
    def ran(self) -> bool:
        """It ran (a forward pass, a method that drove it) or a Trainer was handed it: a finding."""
        return bool(self.forwards or self.used_by or self.in_model)


class DataParallelCheck(Check):
    """Per-run state and verdict of ``no_data_parallel``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        #: Live modules by ``id``; a module freed meanwhile keeps its record in ``_freed`` (its ``id`` may be
        #: the next module's: a DataParallel built and dropped at once is still one that never ran).
        self._instances: dict[int, _Instance] = {}
        self._freed: list[_Instance] = []
        self._probe: DataParallelProbe = run.probe("data_parallel")
        self.strategies: list[str] = []

    def _record(self, module: Any) -> _Instance:
        rec = self._instances.get(id(module))
        if rec is None or rec.ref() is not module:
            if rec is not None:
                self._freed.append(rec)
            rec = self._instances[id(module)] = _Instance(module, self._probe)
        return rec

    # -- events ------------------------------------------------------------------------
    def on_data_parallel_forward(self, module: Any, stack: Callable[[], Stack]) -> None:
        rec = self._record(module)
        rec.forwards += 1
        if rec.first_forward is None:
            rec.first_forward = stack()

    def on_data_parallel_created(self, module: Any) -> None:
        self._record(module)

    def on_data_parallel_used(self, module: Any, function: str, stack: Callable[[], Stack]) -> None:
        rec = self._record(module)
        rec.used_by[function] = rec.used_by.get(function, 0) + 1
        if rec.first_use is None:
            rec.first_use = stack()

    def on_framework_call(self, call: FrameworkCall) -> None:
        trainer, model = call.trainer, call.model
        kind = call.kind if "." in call.kind else f"Trainer.{call.kind}"  # Lightning's kinds are method names
        strategy = getattr(trainer, "strategy", None) or getattr(trainer, "training_type_plugin", None)
        name = type(strategy).__name__
        if name in _DP_STRATEGIES and name not in self.strategies:
            self.strategies.append(name)
        if model is None or not hasattr(model, "named_modules"):
            return
        import torch

        for path, module in model.named_modules():
            if isinstance(module, torch.nn.DataParallel):
                rec = self._record(module)
                if rec.in_model is None:
                    where = f"submodule '{path}' of" if path else "the model passed to"
                    rec.in_model = f"{where} {type(model).__name__} ({kind})"

    # -- verdict ---------------------------------------------------------------------
    def _note(self, rec: _Instance) -> Finding:
        title = f"note: {'' if rec.subclass else 'torch.nn.'}{rec.description} was built and never ran"
        facts = ["no forward pass, no method drove it and no Trainer was given it: a note, not a failure"]
        sites = [Site("created", rec.created)] if rec.created is not None else []
        return Finding(title, facts, sites)

    def _finding(self, rec: _Instance) -> Finding:
        if rec.forwards:
            ran = f"ran {plural(rec.forwards, 'forward pass')}"
        elif rec.used_by:
            ran = "was driven through " + ", ".join(
                f"{name} ({plural(n, 'call')})" for name, n in sorted(rec.used_by.items())
            )
        elif rec.in_model:
            ran = "is in the model"
        else:
            ran = "was built in the run"
        title = f"{'' if rec.subclass else 'torch.nn.'}{rec.description} {ran}"
        facts = []
        if rec.subclass:
            facts.append(f"{rec.subclass} is a torch.nn.DataParallel subclass")
        if rec.used_by and rec.forwards:
            facts.append("also driven through " + ", ".join(sorted(rec.used_by)))
        if rec.in_model:
            facts.append(f"found as {rec.in_model}")
        if rec.device_ids:
            facts.append(f"device_ids={rec.device_ids}: each forward copies the parameters to every device")
        else:
            facts.append(
                "no GPU on this machine, so here it just calls the module; with GPUs it replicates "
                "the model and scatters/gathers every batch from one process"
            )
        sites = []
        if rec.created is not None:
            sites.append(Site("created", rec.created))
        if rec.first_forward is not None:
            sites.append(Site("forward called", rec.first_forward, max(rec.forwards, 1)))
        if rec.first_use is not None:
            sites.append(Site("wrapped module used", rec.first_use, max(sum(rec.used_by.values()), 1)))
        hint = (
            "use DistributedDataParallel, one process per GPU (Lightning: Trainer(strategy='ddp'); plain "
            "PyTorch: torch.nn.parallel.DistributedDataParallel launched with torchrun), and drop the "
            "DataParallel wrapper."
        )
        return Finding(title, facts, sites, hint)

    def result(self) -> CheckResult:
        instances = self._freed + list(self._instances.values())
        forwards = sum(r.forwards for r in instances)
        figures: Figures = {
            "data_parallel_modules": len(instances),
            "forward_calls": forwards,
            "lightning_strategy": self.strategies[0] if self.strategies else None,
            "modules": [
                {"module": r.description, "forward_calls": r.forwards, "device_ids": r.device_ids,
                 **({"used_by": dict(r.used_by)} if r.used_by else {})}
                for r in instances
            ],
        }
        ran = [r for r in instances if r.ran]
        findings = [self._finding(r) for r in ran]
        for name in self.strategies:
            findings.insert(
                0,
                Finding(
                    f"the Trainer runs Lightning's {name} (strategy='dp')",
                    ["it wraps the LightningModule in DataParallel on every fit"],
                    [],
                    "use Trainer(strategy='ddp') (one process per GPU).",
                ),
            )
        notes = [self._note(r) for r in instances if not r.ran]
        if findings:
            count = len(ran) or len(self.strategies)
            noun = "module" if count == 1 else "modules"
            summary = f"{count} DataParallel {noun}, {plural(forwards, 'forward pass')}"
            others = sorted({name for r in instances for name in r.used_by})
            if others:
                summary += f", driven through {', '.join(others)}"
            return CheckResult(NAME, FAILED, summary, count, findings + notes, figures)
        if notes:
            summary = f"no DataParallel ran; {plural(len(notes), 'DataParallel module')} built and never run (noted)"
            return CheckResult(NAME, PASSED, summary, 0, notes, figures)
        return CheckResult(NAME, PASSED, "no DataParallel in the run", 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a no_data_parallel verdict (see :mod:`pytest_torchperf.figures`)."""

    data_parallel_modules: int
    forward_calls: int
    lightning_strategy: Optional[str]
    modules: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="no torch.nn.DataParallel in the run (use DistributedDataParallel)",
    check=DataParallelCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("data_parallel",),
)
