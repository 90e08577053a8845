"""Adapter for the Hugging Face ``transformers.Trainer`` (see :mod:`pytest_torchperf.frameworks`).

Observed: ``Trainer.train()`` inside a watched run (``on_framework_call`` / ``on_framework_call_end``), and
its steps: each ``Trainer.training_step`` call (the user's override, if the
Trainer's class has one) begins a step, which lasts until the next one begins
or ``train()`` returns, so the Trainer's own work around the step (the nan/inf
filter of the loss, the optimizer step, logging) is part of it. Under gradient
accumulation each micro-batch's ``training_step`` is a step. The Trainer's
DataLoaders, backward passes, optimizer steps and DDP wrapper are torch's and
are seen by the probes as in any loop.

Frames in ``transformers`` are the framework's: its syncs are notes (failing
with ``fail_on_framework_syncs=True``), with the setting that removes them as
the hint. The user's ``compute_loss`` / ``training_step`` override and model
code are the user's.

Not observed: ``max_overhead`` (it times Lightning fits against their vanilla
loop; a Trainer's is not built: not checked), ``evaluate()`` / ``predict()``
called on their own (no steps), and Trainers whose ``training_step`` is an
instance attribute.
"""

from __future__ import annotations

import inspect
import linecache
from typing import Any, Callable

from .. import core
from ..patching import Patcher, wraps
from . import _calls

__all__ = ["NAME", "PACKAGES", "PLUMBING", "SETTINGS", "hint", "install", "launchers", "replay", "stage"]

NAME = "transformers"
PACKAGES = ("transformers",)
#: Modules that only pass a call on to torch (see :func:`~pytest_torchperf.frameworks.plumbing`): none known.
PLUMBING: tuple[str, ...] = ()
#: Settings that fix what an invariant found in an object the Trainer built (its DataLoaders and, through
#: accelerate, its DistributedDataParallel wrapper): the TrainingArguments that the user controls.
SETTINGS = {
    "no_unused_parameters_search": (
        "pass TrainingArguments(ddp_find_unused_parameters=False): the Trainer builds the DistributedDataParallel "
        "wrapper, and with the default (None) it searches unless gradient checkpointing is on"
    ),
    "no_iterator_reset": (
        "pass TrainingArguments(dataloader_persistent_workers=True): the Trainer builds this DataLoader from its "
        "arguments (dataloader_num_workers), and with persistent workers one pool serves every epoch"
    ),
}
#: Capabilities this framework does not provide (see :class:`pytest_torchperf.frameworks.Adapter`).
stage = None
replay = None
launchers = None

_TRAINER_MODULE = "transformers.trainer"

_NAN_INF = (
    "set `logging_nan_inf_filter=False` in TrainingArguments: with it on (the default) the Trainer checks every "
    "step's loss with `torch.isnan(loss) or torch.isinf(loss)`, two host syncs per step"
)


_LOGGING = "the Trainer reads the loss every `logging_steps` steps: a periodic sync (raise logging_steps to log less)"


def hint(frame: Any, op: str) -> str:
    """The TrainingArguments setting that removes the Trainer's own sync at ``frame``."""
    path = str(getattr(frame, "filename", "")).replace("\\", "/")
    if not path.endswith("transformers/trainer.py"):
        return ""
    source = _around(str(getattr(frame, "filename", "")), int(getattr(frame, "lineno", 0) or 0))
    if "logging_nan_inf_filter" in source and ("isnan" in source or "isinf" in source):
        return _NAN_INF
    if getattr(frame, "function", "") == "_maybe_log_save_evaluate" and "tr_loss" in (frame.source or ""):
        return _LOGGING
    return ""


def _around(filename: str, lineno: int, lines: int = 4) -> str:
    """The source ``lines`` lines around ``lineno`` (a condition spread over lines reports one of them)."""
    return "\n".join(linecache.getline(filename, n) for n in range(max(lineno - lines, 1), lineno + lines + 1))


def _wrap_step(fn: Callable[..., Any], observed: _calls.Observed) -> Callable[..., Any]:
    @wraps(fn)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        try:
            observed.begin_step()
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            core.probe_failed("transformers", exc)
        return fn(*args, **kwargs)

    return training_step


def _attach(observed: _calls.Observed, trainer: Any) -> None:
    """Make ``type(trainer).training_step`` begin a step, for the length of the call."""
    cls = type(trainer)
    if "training_step" in getattr(trainer, "__dict__", {}):
        return
    raw = inspect.getattr_static(cls, "training_step", None)
    if inspect.isfunction(raw):
        observed.call.patcher.setattr(cls, "training_step", _wrap_step(raw, observed))


def _wrap_train(original: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not core.active_runs() or _calls.in_call(self):
            return original(self, *args, **kwargs)
        call = _calls.FrameworkCall(NAME, "Trainer.train", self, package="transformers", args=args, kwargs=dict(kwargs))
        with _calls.Observed(call) as observed:
            try:
                _attach(observed, self)
            except Exception as exc:  # noqa: BLE001
                core.probe_failed("transformers", exc)
            return original(self, *args, **kwargs)

    return train


def install(patcher: Patcher) -> None:
    """Patch ``transformers.Trainer.train`` when ``transformers.trainer`` is (or gets) imported."""

    def attach(module: Any) -> None:
        try:
            trainer_cls = module.Trainer
            if "train" in vars(trainer_cls):
                patcher.setattr(trainer_cls, "train", _wrap_train(vars(trainer_cls)["train"]))
        except Exception as exc:  # noqa: BLE001 - never into the user's import
            core.probe_failed("transformers", exc)

    patcher.on_import(_TRAINER_MODULE, attach)
