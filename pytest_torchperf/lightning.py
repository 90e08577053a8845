"""Observing Lightning: every ``Trainer.fit/validate/test/predict`` inside a watched run.

Supports ``pytorch_lightning`` (1.5 to 2.x) and ``lightning.pytorch``. Neither is
imported here: a Trainer class already imported is patched at once, one
imported later during the run is patched as soon as its module is loaded.

For a fit, the module's ``training_step`` is the step; the batch scope opens in
a callback placed first in ``trainer.callbacks`` (``on_train_batch_start``) and
closes after the module's own ``on_train_batch_end``. All of it, the callback
included, is removed when the call returns.

For checks that replay a fit (``max_overhead``): the arguments of the call in
flight (:func:`current_call`) and of the ``Trainer(...)`` that made it, when it
was built while a run watched (:func:`trainer_init_args`); Lightning calls made
by torchperf itself run :func:`unobserved`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from .patching import Patcher
from .watch import active_runs

__all__ = ["install", "current_trainer", "current_call", "trainer_init_args", "unobserved", "stage_label"]

#: Trainer module -> the package whose ``callbacks.Callback`` goes with it.
_TRAINER_MODULES = {
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
}
_TRAINER_CALLS = ("fit", "validate", "test", "predict")

#: Trainers inside an observed call, innermost last.
_trainers: list[Any] = []


@dataclass
class TrainerCall:
    """One observed ``Trainer.<kind>(*args, **kwargs)`` call, for checks that need its arguments."""

    kind: str
    trainer: Any
    package: str  # "pytorch_lightning" or "lightning.pytorch"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


#: Observed calls in flight, innermost last.
_calls: list[TrainerCall] = []
#: Trainer -> the (args, kwargs) of its ``__init__``, for Trainers built while a run was watching.
_init_args: "weakref.WeakKeyDictionary[Any, tuple[tuple, dict]]" = weakref.WeakKeyDictionary()
#: > 0 while torchperf runs Lightning itself (timing replays): calls then pass through unobserved.
_unobserved = [0]


def current_trainer() -> Optional[Any]:
    """The Trainer whose observed call is running now, if any."""
    return _trainers[-1] if _trainers else None


def current_call() -> Optional[TrainerCall]:
    """The observed Trainer call running now (checks read its arguments in ``on_trainer_call``)."""
    return _calls[-1] if _calls else None


def trainer_init_args(trainer: Any) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` the Trainer was built with, if it was built while a run was watching."""
    try:
        return _init_args.get(trainer)
    except TypeError:
        return None


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Trainers built and called inside are not observed by any run (torchperf's own fits)."""
    _unobserved[0] += 1
    try:
        yield
    finally:
        _unobserved[0] -= 1


def stage_label() -> Optional[tuple[str, bool]]:
    """``("epoch 2 (train)", is_sanity_check)`` for the running trainer, or None outside Lightning."""
    trainer = current_trainer()
    if trainer is None:
        return None
    sanity = bool(getattr(trainer, "sanity_checking", False))
    if sanity:
        return "sanity check", True
    stage = getattr(getattr(trainer, "state", None), "stage", None)
    stage_name = getattr(stage, "value", stage)
    epoch = getattr(trainer, "current_epoch", None)
    parts = [f"epoch {epoch}" if epoch is not None else "epoch ?"]
    if stage_name:
        parts.append(f"({stage_name})")
    return " ".join(parts), False


def _dispatch(event: str) -> None:
    for run in active_runs():
        getattr(run, event)()


def _make_callback(package: str) -> Any:
    """A Callback subclass of ``package`` that opens the batch scope first thing."""
    base = importlib.import_module(f"{package}.callbacks").Callback

    class TorchperfBatchScope(base):  # type: ignore[misc, valid-type]
        """Opens torchperf's batch scope; placed first so user callbacks run inside it."""

        def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
            _dispatch("_batch_started")

        def on_train_epoch_end(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
            _dispatch("_batch_ended")

    return TorchperfBatchScope


def _wrap_hook(name: str, fn: Callable[..., Any], before: Optional[str], after: Optional[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def hook(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a user's exception shows the user's frames, not ours
        if before:
            _dispatch(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                _dispatch(after)

    hook.__torchperf_hook__ = name  # type: ignore[attr-defined]
    return hook


def _attach_to_fit(patcher: Patcher, trainer: Any, model: Any, callback_cls: Any, batch_scope: bool) -> None:
    """Make the model's training_step the step; with ``batch_scope``, open/close the batch scope too.

    The callback is only added when a run asks for the batch scope: Lightning
    calls every hook of every callback, and a fit should pay for that only
    when it is needed.
    """
    step = getattr(model, "training_step", None)
    if callable(step):
        patcher.setattr(model, "training_step", _wrap_hook("training_step", step, "_step_started", "_step_ended"))
    if not batch_scope:
        return
    batch_end = getattr(model, "on_train_batch_end", None)
    if callable(batch_end):
        patcher.setattr(model, "on_train_batch_end", _wrap_hook("on_train_batch_end", batch_end, None, "_batch_ended"))
    callbacks = getattr(trainer, "callbacks", None)
    if isinstance(callbacks, list):
        callback = callback_cls()
        callbacks.insert(0, callback)

        def remove() -> None:
            current = getattr(trainer, "callbacks", None)
            if isinstance(current, list) and any(c is callback for c in current):
                current[:] = [c for c in current if c is not callback]

        patcher.callback(remove)


def _wrap_trainer_call(kind: str, original: Callable[..., Any], package: str) -> Callable[..., Any]:
    callback_cls: list[Any] = []

    @functools.wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a user's exception shows the user's frames, not ours
        runs = list(active_runs())
        if not runs or _unobserved[0] or any(t is self for t in _trainers):
            return original(self, *args, **kwargs)
        local = Patcher()
        _trainers.append(self)
        local.callback(_trainers.pop)
        _calls.append(TrainerCall(kind, self, package, args, dict(kwargs)))
        local.callback(_calls.pop)
        model = args[0] if args else kwargs.get("model")
        try:
            for run in runs:
                run._trainer_call_started(kind, self, model)
            if kind == "fit" and model is not None:
                if not callback_cls:
                    callback_cls.append(_make_callback(package))
                batch_scope = any(run.options.scope == "batch" for run in runs)
                _attach_to_fit(local, self, model, callback_cls[0], batch_scope)
            return original(self, *args, **kwargs)
        finally:
            local.undo()
            for run in runs:
                run._batch_ended()
                run._trainer_call_ended(kind, self, model)

    return call


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        if active_runs() and not _unobserved[0]:
            # Lists copied: pytorch-lightning 1.x appends its own callbacks to the list it was given.
            recorded = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
            with contextlib.suppress(TypeError):
                _init_args[self] = (tuple(list(a) if isinstance(a, list) else a for a in args), recorded)
        original(self, *args, **kwargs)

    return __init__


def _patch_trainer(patcher: Patcher, trainer_cls: Any, package: str) -> None:
    if "__init__" in vars(trainer_cls):
        patcher.setattr(trainer_cls, "__init__", _wrap_init(vars(trainer_cls)["__init__"]))
    for kind in _TRAINER_CALLS:
        if kind in vars(trainer_cls):
            patcher.setattr(trainer_cls, kind, _wrap_trainer_call(kind, vars(trainer_cls)[kind], package))


def install(patcher: Patcher) -> None:
    """Patch the Lightning Trainer classes already imported; patch the others when they are imported."""
    for module_name, package in _TRAINER_MODULES.items():
        patcher.on_import(
            module_name, lambda module, package=package: _patch_trainer(patcher, module.Trainer, package)
        )
