"""Observing Lightning: every ``Trainer.fit/validate/test/predict`` inside a watched run.

Supports ``pytorch_lightning`` (1.5 to 2.x) and ``lightning.pytorch``. Neither is
imported here: a Trainer class already imported is patched at once, one
imported later during the run is patched as soon as its module is loaded.
Every run needs this observer: it is installed with the first probe and sends
``on_trainer_call`` / ``on_trainer_call_end`` to the checks.

For a fit, the module's ``training_step`` is the step: it is wrapped on the
module's *class* for the length of the call (never on the instance, so the
module pickles, deep-copies and ``torch.save``\\ s exactly as it would; a copy's
``training_step`` runs the copy). A module compiled with ``torch.compile`` is
observed through the module it wraps. The batch scope opens when Lightning
dispatches ``on_train_batch_start`` to the callbacks and closes after the
module's own ``on_train_batch_end``: Lightning's hook dispatchers are wrapped
for the call (``trainer.call`` in 2.x, the Trainer's methods in 1.x), so
nothing is added to ``trainer.callbacks``. All of it is undone when the call
returns.

For checks that replay a fit (``max_overhead``): the arguments of the call in
flight (:func:`current_call`) and of the ``Trainer(...)`` that made it, when it
was built while a run watched (:func:`trainer_init_args`); Lightning calls made
by torchperf itself run :func:`unobserved`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from .. import core
from ..patching import Patcher, wraps

__all__ = [
    "NAME",
    "PACKAGES",
    "ObservedCall",
    "TrainerCall",
    "install",
    "current_trainer",
    "current_call",
    "trainer_init_args",
    "unobserved",
    "stage_label",
]

NAME = "lightning"
#: Lightning's packages (torchmetrics is a library the user calls: judged at the user's calling line).
PACKAGES = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")

#: Trainer module -> the package it belongs to.
_TRAINER_MODULES = {
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
}
_TRAINER_CALLS = ("fit", "validate", "test", "predict")
#: Lightning's hook dispatchers: module functions of ``<package>.trainer.call`` (2.x) or Trainer methods (1.x).
_CALLBACK_DISPATCHERS = ("_call_callback_hooks", "call_hook")
_MODULE_DISPATCHERS = ("_call_lightning_module_hook", "call_hook")

@dataclass
class TrainerCall:
    """One observed ``Trainer.<kind>(*args, **kwargs)`` call, for checks that need its arguments."""

    kind: str
    trainer: Any
    package: str  # "pytorch_lightning" or "lightning.pytorch"
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


class _Observer:
    """What the Lightning observer holds (one object for the process)."""

    def __init__(self) -> None:
        #: Trainers inside an observed call, innermost last.
        self.trainers: list[Any] = []
        #: Observed calls in flight, innermost last.
        self.calls: list[TrainerCall] = []
        #: Trainer -> the (args, kwargs) of its ``__init__``, for Trainers built while a run was watching.
        self.init_args: "weakref.WeakKeyDictionary[Any, tuple[tuple, dict]]" = weakref.WeakKeyDictionary()
        #: > 0 while torchperf runs Lightning itself (timing replays): calls then pass through unobserved.
        self.unobserved = 0


OBSERVER = _Observer()


def current_trainer() -> Optional[Any]:
    """The Trainer whose observed call is running now, if any."""
    return OBSERVER.trainers[-1] if OBSERVER.trainers else None


def current_call() -> Optional[TrainerCall]:
    """The observed Trainer call running now (checks read its arguments in ``on_trainer_call``)."""
    return OBSERVER.calls[-1] if OBSERVER.calls else None


def trainer_init_args(trainer: Any) -> Optional[tuple[tuple, dict]]:
    """``(args, kwargs)`` the Trainer was built with, if it was built while a run was watching."""
    try:
        return OBSERVER.init_args.get(trainer)
    except TypeError:
        return None


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Trainers built and called inside are not observed by any run (torchperf's own fits)."""
    OBSERVER.unobserved += 1
    try:
        yield
    finally:
        OBSERVER.unobserved -= 1


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


def _each_run(method: str) -> None:
    for run in list(core.active_runs()):
        getattr(run, method)()


def _wrap_step(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A ``training_step`` that marks the step for every active run (a plain function: it binds like the original)."""

    runs = core.active_runs()

    @wraps(fn)
    def training_step(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a user's exception shows the user's frames, not ours
        # ``_each_run`` for the one run watching (the common case), inlined: this runs every step.
        one = runs[0] if len(runs) == 1 else None
        if one is not None:
            one.step_started()
        else:
            _each_run("step_started")
        try:
            return fn(*args, **kwargs)
        finally:
            if one is not None and len(runs) == 1 and runs[0] is one:
                one.step_ended()
            else:
                _each_run("step_ended")

    training_step.__torchperf_hook__ = "training_step"  # type: ignore[attr-defined]
    return training_step


def _wrap_dispatcher(fn: Callable[..., Any], role: str, bound: bool) -> Callable[..., Any]:
    """Lightning's hook dispatcher, opening the batch scope before ``on_train_batch_start`` reaches the
    callbacks and closing it after ``on_train_batch_end`` reached the module (``role``: which dispatcher).
    ``bound``: a Trainer method (1.x), whose first argument after ``self`` is the hook's name."""

    @wraps(fn)
    def dispatch(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        hook = args[1] if len(args) > 1 else kwargs.get("hook_name")
        if hook == "on_train_batch_start" and role in ("callbacks", "both"):
            _each_run("batch_started")
        try:
            return fn(*args, **kwargs)
        finally:
            if (hook == "on_train_batch_end" and role in ("module", "both")) or hook == "on_train_epoch_end":
                _each_run("batch_ended")

    return dispatch


def _module_class(model: Any) -> Optional[type]:
    """The class whose ``training_step`` runs: the module's, or the one ``torch.compile`` wraps."""
    inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
    target = inner if inner is not None and hasattr(inner, "training_step") else model
    if "training_step" in getattr(target, "__dict__", {}):
        return None  # an instance attribute: wrapping the class would not see it
    return type(target)


def _attach_to_fit(patcher: Patcher, trainer: Any, model: Any, package: str, batch_scope: bool) -> None:
    """Make the model's training_step the step; with ``batch_scope``, open/close the batch scope too.

    The hook dispatchers are only wrapped when a run asks for the batch scope:
    Lightning dispatches dozens of hooks per batch, and a fit should pay for
    that only when it is needed.
    """
    cls = _module_class(model)
    raw = inspect.getattr_static(cls, "training_step", None) if cls is not None else None
    if isinstance(raw, (staticmethod, classmethod)):
        patcher.setattr(cls, "training_step", type(raw)(_wrap_step(raw.__func__)))
    elif inspect.isfunction(raw):
        patcher.setattr(cls, "training_step", _wrap_step(raw))
    if not batch_scope:
        return
    call_module = sys.modules.get(f"{package}.trainer.call")
    owners: list[tuple[Any, bool]] = []
    if call_module is not None and hasattr(call_module, "_call_callback_hooks"):
        owners.append((call_module, False))  # Lightning 2.x: module functions
    else:
        owners.append((type(trainer), True))  # Lightning 1.x: Trainer methods
    for owner, bound in owners:
        callbacks = next((n for n in _CALLBACK_DISPATCHERS if callable(getattr(owner, n, None))), None)
        module_hook = next((n for n in _MODULE_DISPATCHERS if callable(getattr(owner, n, None))), None)
        if callbacks is not None and callbacks == module_hook:
            patcher.wrap(owner, callbacks, lambda fn: _wrap_dispatcher(fn, "both", bound))
            continue
        if callbacks is not None:
            patcher.wrap(owner, callbacks, lambda fn: _wrap_dispatcher(fn, "callbacks", bound))
        if module_hook is not None:
            patcher.wrap(owner, module_hook, lambda fn: _wrap_dispatcher(fn, "module", bound))


class ObservedCall:
    """Observe one Trainer call for ``runs`` (default: the active runs) while the ``with`` block runs it.

    What the ``Trainer.fit/validate/test/predict`` wrappers do around the
    original call: the call is current (:func:`current_call`), the checks get
    ``on_trainer_call`` / ``on_trainer_call_end``, and a fit's
    ``training_step`` marks the steps. A rank process started by a launcher
    (``ddp_spawn``) runs the call its parent began, without going through
    ``Trainer.fit``: it observes it with this. A plain class, not a generator:
    an exception of the user's passes through without torchperf frames.
    """

    def __init__(self, call: TrainerCall, model: Any, runs: Optional[list[Any]] = None) -> None:
        self.call = call
        self.model = model
        self.runs = list(core.active_runs()) if runs is None else runs
        self._local = Patcher()

    def __enter__(self) -> "ObservedCall":
        call, model, local = self.call, self.model, self._local
        try:
            OBSERVER.trainers.append(call.trainer)
            local.callback(OBSERVER.trainers.pop)
            OBSERVER.calls.append(call)
            local.callback(OBSERVER.calls.pop)  # type: ignore[arg-type]
            for run in self.runs:
                run.notify("on_trainer_call", call.kind, call.trainer, model)
            if call.kind == "fit" and model is not None:
                batch_scope = any(run.scope == "batch" or getattr(run, "wants_batches", False) for run in self.runs)
                _attach_to_fit(local, call.trainer, model, call.package, batch_scope)
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            core.probe_failed("lightning", exc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self._local.undo()
        call = self.call
        for run in self.runs:
            run.batch_ended()
            run.notify("on_trainer_call_end", call.kind, call.trainer, self.model)


def _wrap_trainer_call(kind: str, original: Callable[..., Any], package: str) -> Callable[..., Any]:
    @wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a user's exception shows the user's frames, not ours
        runs = list(core.active_runs())
        observer = OBSERVER
        if not runs or observer.unobserved or any(t is self for t in observer.trainers):
            return original(self, *args, **kwargs)
        model = args[0] if args else kwargs.get("model")
        with ObservedCall(TrainerCall(kind, self, package, args, dict(kwargs)), model, runs):
            return original(self, *args, **kwargs)

    return call


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        if core.active_runs() and not OBSERVER.unobserved:
            # Lists copied: pytorch-lightning 1.x appends its own callbacks to the list it was given.
            try:
                recorded = {k: list(v) if isinstance(v, list) else v for k, v in kwargs.items()}
                OBSERVER.init_args[self] = (tuple(list(a) if isinstance(a, list) else a for a in args), recorded)
            except Exception:  # noqa: BLE001 - an unhashable Trainer subclass: no replay for it
                pass
        original(self, *args, **kwargs)

    return __init__


def _patch_trainer(patcher: Patcher, trainer_cls: Any, package: str) -> None:
    # The wrappers read only the observer when called: kept from watch to watch (built again only when the
    # Trainer's own function is no longer the one they wrap).
    with patcher.reusing(("lightning", package)):
        if "__init__" in vars(trainer_cls):
            patcher.wrap(trainer_cls, "__init__", _wrap_init)
        for kind in _TRAINER_CALLS:
            if kind in vars(trainer_cls):
                patcher.wrap(trainer_cls, kind, functools.partial(_wrap_trainer_call, kind, package=package))


def install(patcher: Patcher) -> None:
    """Patch the Lightning Trainer classes already imported; patch the others when they are imported."""
    for module_name, package in _TRAINER_MODULES.items():

        def attach(module: Any, package: str = package) -> None:
            try:
                _patch_trainer(patcher, module.Trainer, package)
            except Exception as exc:  # noqa: BLE001 - never into the user's import
                core.probe_failed("lightning", exc)

        patcher.on_import(module_name, attach)
