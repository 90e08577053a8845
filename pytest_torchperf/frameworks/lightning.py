"""Adapter for Lightning (see :mod:`pytest_torchperf.frameworks`): every ``Trainer.fit/validate/test/predict``
inside a watched run.

Supports ``pytorch_lightning`` (1.5 to 2.x) and ``lightning.pytorch``. Neither is
imported here: a Trainer class already imported is patched at once, one
imported later during the run is patched as soon as its module is loaded.
Installed with every run, like every adapter; the checks get
``on_framework_call`` / ``on_framework_call_end`` with a
:class:`~pytest_torchperf.frameworks._calls.FrameworkCall` (``framework``
``"lightning"``, ``kind`` ``"fit"``..., ``trainer``, ``model``, ``package``,
``args`` / ``kwargs``).

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

Its capabilities: :data:`stage` (the epoch and stage a pass or a recompile
happens in), :data:`replay` (``max_overhead`` rebuilds a fit from the
``Trainer(...)`` arguments, when it was built while a run watched, and runs its
own fits unobserved) and :data:`launchers` (a ``ddp_spawn`` rank re-runs the
call its parent began).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import weakref
from collections.abc import Iterator
from typing import Any, Callable, Optional

from .. import core
from ..patching import Patcher, wraps
from . import Stage, _calls
from ._calls import FrameworkCall, Observed

__all__ = [
    "NAME",
    "PACKAGES",
    "PLUMBING",
    "SETTINGS",
    "ObservedCall",
    "hint",
    "install",
    "launchers",
    "replay",
    "stage",
    "current_trainer",
    "current_call",
    "trainer_init_args",
    "unobserved",
]

NAME = "lightning"
#: Lightning's packages (torchmetrics is a library the user calls: judged at the user's calling line).
PACKAGES = ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_utilities")
#: Lightning's strategies and distributed helpers pass a callback's or a loop's ``broadcast`` / ``reduce`` on to
#: torch: a collective made inside them is their caller's (see :func:`~pytest_torchperf.frameworks.plumbing`).
PLUMBING = (
    "pytorch_lightning.strategies",
    "lightning.pytorch.strategies",
    "lightning_fabric.strategies",
    "lightning.fabric.strategies",
    "lightning_fabric.utilities.distributed",
    "lightning.fabric.utilities.distributed",
    "pytorch_lightning.utilities.distributed",
    "lightning.pytorch.utilities.distributed",
)
#: Settings that fix what an invariant found in an object Lightning built (see
#: :func:`~pytest_torchperf.frameworks.setting`): Lightning re-creates the user's DataLoader (a distributed
#: sampler) with the user's own arguments. (The DDP it builds is named by its strategy, which the run's
#: trainer tells: ``no_unused_parameters_search`` writes that hint itself.)
SETTINGS = {
    "no_iterator_reset": (
        "pass persistent_workers=True to the DataLoader your *_dataloader() hook (or fit's argument) returns: "
        "Lightning re-creates it with your arguments, and with persistent workers one pool serves every epoch"
    ),
}

#: Trainer module -> the package it belongs to.
_TRAINER_MODULES = {
    "pytorch_lightning.trainer.trainer": "pytorch_lightning",
    "lightning.pytorch.trainer.trainer": "lightning.pytorch",
}
_TRAINER_CALLS = ("fit", "validate", "test", "predict")
#: Lightning's hook dispatchers: module functions of ``<package>.trainer.call`` (2.x) or Trainer methods (1.x).
_CALLBACK_DISPATCHERS = ("_call_callback_hooks", "call_hook")
_MODULE_DISPATCHERS = ("_call_lightning_module_hook", "call_hook")


class _Observer:
    """What the Lightning observer holds (one object for the process)."""

    def __init__(self) -> None:
        #: Trainer -> the (args, kwargs) of its ``__init__``, for Trainers built while a run was watching.
        self.init_args: weakref.WeakKeyDictionary[Any, tuple[tuple, dict]] = weakref.WeakKeyDictionary()
        #: > 0 while torchperf runs Lightning itself (timing replays): calls then pass through unobserved.
        self.unobserved = 0


OBSERVER = _Observer()


def current_call() -> Optional[FrameworkCall]:
    """The observed Trainer call running now, if any."""
    return _calls.current(NAME)


def current_trainer() -> Optional[Any]:
    """The Trainer whose observed call is running now, if any."""
    call = current_call()
    return call.trainer if call is not None else None


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


def _stage(call: FrameworkCall) -> Optional[Stage]:
    """``Stage("epoch 2 (train)", sanity, training)`` for the running trainer of ``call``."""
    trainer = call.trainer
    if bool(getattr(trainer, "sanity_checking", False)):
        return Stage("sanity check", True, False)
    state = getattr(getattr(trainer, "state", None), "stage", None)
    stage_name = getattr(state, "value", state)
    epoch = getattr(trainer, "current_epoch", None)
    parts = [f"epoch {epoch}" if epoch is not None else "epoch ?"]
    if stage_name:
        parts.append(f"({stage_name})")
    return Stage(" ".join(parts), False, call.kind == "fit" and bool(getattr(trainer, "training", False)))


#: Capability (see :class:`pytest_torchperf.frameworks.Adapter`): where a Trainer call is now.
stage: Optional[Callable[[FrameworkCall], Optional[Stage]]] = _stage


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
            patcher.wrap(owner, callbacks, functools.partial(_wrap_dispatcher, role="both", bound=bound))
            continue
        if callbacks is not None:
            patcher.wrap(owner, callbacks, functools.partial(_wrap_dispatcher, role="callbacks", bound=bound))
        if module_hook is not None:
            patcher.wrap(owner, module_hook, functools.partial(_wrap_dispatcher, role="module", bound=bound))


class ObservedCall(Observed):
    """Observe one Trainer call for ``runs`` (default: the active runs) while the ``with`` block runs it.

    What the ``Trainer.fit/validate/test/predict`` wrappers do around the
    original call: the call is current, the checks get ``on_framework_call`` /
    ``on_framework_call_end``, and a fit's ``training_step`` marks the steps. A
    rank process started by a launcher (``ddp_spawn``) runs the call its parent
    began, without going through ``Trainer.fit``: it observes it with this
    (:data:`launchers`). A plain class, not a generator: an exception of the
    user's passes through without torchperf frames.
    """

    def __enter__(self) -> ObservedCall:
        call = self.call
        try:
            super().__enter__()
            if call.kind == "fit" and call.model is not None:
                batch_scope = any(run.scope == "batch" or getattr(run, "wants_batches", False) for run in self.runs)
                _attach_to_fit(call.patcher, call.trainer, call.model, call.package, batch_scope)
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            core.probe_failed(NAME, exc)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        for run in self.runs:
            run.batch_ended()
        super().__exit__(*exc_info)


def _wrap_trainer_call(kind: str, original: Callable[..., Any], package: str) -> Callable[..., Any]:
    @wraps(original)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True  # a user's exception shows the user's frames, not ours
        runs = list(core.active_runs())
        if not runs or OBSERVER.unobserved or _calls.in_call(self):
            return original(self, *args, **kwargs)
        model = args[0] if args else kwargs.get("model")
        with ObservedCall(FrameworkCall(NAME, kind, self, model, package, args, dict(kwargs)), runs):
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
    # The wrappers read only this module's state when called: kept from watch to watch, built again when the
    # Trainer's own function is no longer the one they wrap, or when this module was imported anew (its state
    # is then another object: a wrapper kept from before would read the old one).
    with patcher.reusing(("lightning", package, OBSERVER)):
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
                core.probe_failed(NAME, exc)

        patcher.on_import(module_name, attach)


#: (callback file, its function) -> what Lightning's own collective there is for, and the setting that changes it.
_COLLECTIVE_HINTS = {
    ("model_checkpoint.py", "on_train_batch_end"): (
        "ModelCheckpoint(train_time_interval=...) broadcasts rank 0's clock decision after every training batch: "
        "checkpoint by steps (every_n_train_steps=N) or at epoch ends (every_n_epochs, save_on_train_epoch_end) "
        "instead, or Trainer(enable_checkpointing=False) where this fit needs no checkpoint"
    ),
    ("model_checkpoint.py", "setup"): (
        "ModelCheckpoint broadcasts its directory from rank 0 once, in setup: nothing per step; "
        "Trainer(enable_checkpointing=False) drops it with the checkpoints"
    ),
    ("model_checkpoint.py", "*"): (
        "ModelCheckpoint makes the ranks agree (a broadcast or reduce_boolean_decision) each time it considers "
        "saving: save less often (every_n_train_steps, every_n_epochs, save_on_train_epoch_end, save_top_k), or "
        "Trainer(enable_checkpointing=False) where this fit needs no checkpoint"
    ),
    ("timer.py", "*"): (
        "Timer broadcasts rank 0's stop decision each time it checks: Timer(duration=..., interval='epoch') "
        "checks once per epoch instead of every step"
    ),
    ("early_stopping.py", "*"): (
        "EarlyStopping reduces its stop decision over the ranks each time it checks: check_on_train_epoch_end "
        "and the validation interval set how often"
    ),
}


def hint(frame: Any, op: str) -> str:
    """The Lightning setting behind one of its own collectives (``op`` ``"collective"``) made at ``frame``; its
    own syncs are notes without a setting to name (its logged values are read where the user logs them)."""
    if op != "collective":
        return ""
    path = str(frame.filename).replace("\\", "/")
    if "/callbacks/" not in path:
        return ""
    name = path.rsplit("/", 1)[-1]
    return _COLLECTIVE_HINTS.get((name, frame.function)) or _COLLECTIVE_HINTS.get((name, "*"), "")


class _Replay:
    """Capability for ``max_overhead`` (see :class:`pytest_torchperf.frameworks.Replay`)."""

    def init_args(self, trainer: Any) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
        return trainer_init_args(trainer)

    def rebuildable(self, trainer: Any) -> bool:
        cls = type(trainer)
        return "__init__" not in vars(cls) or cls.__module__ in _TRAINER_MODULES

    def unobserved(self) -> contextlib.AbstractContextManager[None]:
        return unobserved()


class _Launchers:
    """Capability for the rank launchers (see :class:`pytest_torchperf.frameworks.Launchers`): a ``ddp_spawn``
    strategy's launcher runs ``_wrapping_function`` in each rank, which re-runs the Trainer call."""

    def is_launch(self, fn: Any) -> bool:
        owner = getattr(fn, "__self__", None)
        module = type(owner).__module__ if owner is not None else ""
        return module.startswith(("pytorch_lightning.", "lightning.pytorch.")) and (
            getattr(fn, "__name__", "") == "_wrapping_function"
        )

    def observe(self, kind: str, package: str, args: tuple[Any, ...], runs: list[Any]) -> Optional[Observed]:
        trainer = args[0] if args else None
        if trainer is None or not hasattr(trainer, "strategy"):
            return None
        model = None
        call_args = args[2] if len(args) > 2 and isinstance(args[2], (tuple, list)) else ()
        for candidate in call_args:
            if hasattr(candidate, "training_step"):
                model = candidate
                break
        if model is None:
            model = getattr(trainer, "lightning_module", None)
        return ObservedCall(FrameworkCall(NAME, kind, trainer, model, package, (model,), {}), runs)


#: Capabilities (see :class:`pytest_torchperf.frameworks.Adapter`).
replay: Optional[_Replay] = _Replay()
launchers: Optional[_Launchers] = _Launchers()
