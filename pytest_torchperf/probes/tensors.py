"""Probe ``tensors``: where a tensor was born, and when a host-born one is moved to a device.

``no_host_sync`` and ``on_device`` both need to know which tensors live on the
host *by construction*: a tensor made by a factory call (``torch.randn``,
``torch.tensor``, ``torch.zeros``...) without ``device=`` stays in host memory
even on a GPU run. ``.item()`` on it is not a device sync (``no_host_sync``
must not count it), and moving it to the device every step is exactly the bug
``on_device`` reports. On a CPU-only machine every tensor is on the CPU, so
this is the only way to tell "a host tensor" from "a tensor that would live on
the accelerator".

While installed, the probe:

- wraps the factory functions of the ``torch`` namespace and records each
  host-born result in a registry keyed by ``id`` with a weak reference (an
  entry disappears with its tensor; the registry is emptied when the probe is
  removed). Factories called by torch itself (``nn.Linear`` building its
  weights) are recorded as host tensors but never blamed on anyone;
- follows a host-born tensor through views (``t._base``), dtype conversions
  (``.float()``, ``.long()``, ``.to(dtype)``...) and device moves (``.to(device)``,
  ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``dst.copy_(t)``). A move is sent
  to the checks in scope as an ``on_move`` event (:class:`Move`) and, when the
  move returns the very same tensor (always, on a CPU-only machine), the
  tensor stops counting as a host tensor: from then on it stands for the device
  copy. This is what keeps a buffer moved with its module, or a batch moved to
  the device, a device tensor. A move made by torch's own code (``module.to()``)
  or ``register_buffer`` marks the tensor as travelling with its module;
- on a machine with an accelerator, remembers the tensors DataLoaders yield
  (and their conversions), so a real host-to-device copy of anything else can
  be told from a batch;
- marks an optimizer's ``step`` counters as host tensors when it steps (torch
  keeps them on the host on purpose unless ``capturable``/``fused``).

A tensor subclass with its own ``__torch_function__`` is handed to torch as if
nothing watched (the subclass sees torch's own method as ``func``), and is not
followed.

Known blind spots, by design (catching them would mean intercepting every torch
call, 1.3-1.9x on a small step): tensors derived by arithmetic (``torch.rand(n) < p``),
``torch.stack``/``torch.cat`` of host tensors, factories imported by name before
the run (``from torch import randn``), and the legacy ``torch.FloatTensor(...)``
constructors.
"""

from __future__ import annotations

import functools
import importlib
import sys
import weakref
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core
from ..core import FLAGS
from ..frames import StackCache, caller, describe_frame, kind_of
from ..stacks import TORCH, Frame, Stack
from . import Probe, accelerator_available, is_compiling_function

if TYPE_CHECKING:
    from ..core import Run
    from ..patching import Patcher

__all__ = ["Birth", "Move", "PROBE", "TensorsProbe", "FACTORIES", "CONVERSIONS"]

#: ``torch.<name>`` functions that build a tensor from nothing or from host data.
FACTORIES = (
    "tensor", "as_tensor", "asarray", "from_numpy",
    "zeros", "ones", "empty", "full", "eye", "empty_strided", "scalar_tensor",
    "arange", "linspace", "logspace",
    "rand", "randn", "randint", "randperm", "normal",
    "tril_indices", "triu_indices",
    "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
)
#: Factories whose first argument is data: a tensor there is converted, not built.
_DATA_FACTORIES = frozenset(("tensor", "as_tensor", "asarray"))
#: Tensor methods that convert the dtype and so return a new tensor with the same provenance.
CONVERSIONS = ("float", "double", "half", "bfloat16", "long", "int", "short", "bool")


@dataclass(eq=False)
class Birth:
    """How a host tensor came to be: the factory, who called it, where, in which runs' steps."""

    #: The factory: ``"randn"``, ``"tensor"``...
    factory: str
    #: The frame kind that called the factory: user, framework, library or torch (torch's own code).
    caller_kind: str
    #: Where (the innermost frame outside torch), None for torch's own tensors.
    site: Optional[Frame]
    #: The stack of the first birth at that site.
    stack: Stack
    #: ``device="cpu"`` written out, or ``pin_memory=True``: placed on the host on purpose.
    explicit: bool
    #: ``(run, unit)`` for each run whose step checks applied at birth (unit None: between steps).
    in_scope: tuple[tuple["Run", Optional[int]], ...]
    #: The factory call's ``shape``/``dtype`` for the hint.
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: Moved to a device in place (the move returned the tensor itself): no longer a host tensor.
    moved: bool = False
    #: Registered as a buffer, or moved by torch's own code (``module.to()``): it travels with its module.
    with_module: bool = False
    #: Dtype conversions and views on the way from the factory to the move (``float``, ``view``...).
    path: tuple[str, ...] = field(default_factory=tuple)
    #: Functions on the stack at birth that an allow-list names (see :meth:`TensorsProbe.want_functions`).
    functions: frozenset[str] = frozenset()

    def in_scope_of(self, run: "Run") -> bool:
        return any(r is run for r, _ in self.in_scope)

    def unit_in(self, run: "Run") -> Optional[int]:
        """The step of ``run`` the tensor was born in (None: between steps or not in its scope)."""
        return next((unit for r, unit in self.in_scope if r is run), None)

    def derived(self, step: str) -> "Birth":
        return Birth(
            self.factory, self.caller_kind, self.site, self.stack, self.explicit, self.in_scope,
            self.shape, self.dtype, False, False, self.path + (step,), self.functions,
        )


@dataclass
class Move:
    """A tensor sent to a device: ``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``copy_``."""

    op: str
    tensor: Any
    #: The host-born tensor's birth (None: a real copy of a tensor of unknown provenance).
    birth: Optional[Birth]
    #: The first move of that tensor (later ones copy the same host tensor again).
    first: bool
    #: The target: a ``torch.device``, a device string, or a tensor whose device is meant.
    target: Any
    frame: Optional[FrameType]
    #: Source on the CPU and result on an accelerator: a real host-to-device copy.
    real_copy: bool = False


def _is_cpu_string(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


class TensorsProbe(Probe):
    """The registry of host-born tensors and the moves of those tensors (see the module's docstring)."""

    name = "tensors"

    def __init__(self) -> None:
        super().__init__()
        #: id(tensor) -> (weak reference, birth).
        self.births: dict[int, tuple[Any, Birth]] = {}
        #: id(tensor) -> weak reference, for the births that are host tensors now (not moved): the hot
        #: paths' one-lookup answer to "is this a host tensor?".
        self.host: dict[int, Any] = {}
        #: id(tensor) -> weak reference: tensors a DataLoader produced (only where a real copy can happen).
        self.loader_tensors: dict[int, Any] = {}
        #: Function names some run's allow-list names: a birth inside one of them remembers it.
        self.functions: set[str] = set()
        self.stacks = StackCache()
        self.tensor_type: Any = None
        self.device_type: Any = None
        self.compiling: Callable[[], bool] = lambda: False

    def reset(self) -> None:
        super().reset()
        self.births.clear()
        self.host.clear()
        self.loader_tensors.clear()
        self.functions.clear()
        self.stacks.clear()

    # -- the registry ---------------------------------------------------------------------
    def _forget(self, key: int, ref: Any) -> None:
        entry = self.births.get(key)
        if entry is not None and entry[0] is ref:
            del self.births[key]
        if self.host.get(key) is ref:
            del self.host[key]

    def remember(self, tensor: Any, birth: Birth) -> None:
        key = id(tensor)
        try:
            ref = weakref.ref(tensor, lambda r, key=key: self._forget(key, r))
        except TypeError:  # pragma: no cover - a tensor type without weak references
            return
        self.births[key] = (ref, birth)
        if birth.moved:
            self.host.pop(key, None)
        else:
            self.host[key] = ref

    def own_birth(self, tensor: Any) -> Optional[Birth]:
        entry = self.births.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return None

    def birth_of(self, tensor: Any) -> Optional[Birth]:
        """The :class:`Birth` of a host-born tensor (or of the tensor it is a view of), else None."""
        if not self.births:
            return None
        birth = self.own_birth(tensor)
        if birth is None:
            base = getattr(tensor, "_base", None)
            if base is not None:
                birth = self.own_birth(base)
                if birth is not None and not birth.moved:
                    birth = birth.derived("view")
        return birth

    def is_host_tensor(self, tensor: Any) -> bool:
        """Whether ``tensor`` lives on the host by construction (a factory without ``device=``, not moved)."""
        ref = self.host.get(id(tensor))
        if ref is not None and ref() is tensor:
            return True
        birth = self.birth_of(tensor)
        return birth is not None and not birth.moved

    def mark_host(self, tensor: Any, caller_kind: str = TORCH) -> None:
        """Record ``tensor`` as a host tensor nobody is to blame for (``.cpu()`` results, optimizer steps)."""
        if self.own_birth(tensor) is None:
            self.remember(tensor, Birth("", caller_kind, None, (), True, ()))

    def _no_longer_host(self, tensor: Any, birth: Birth, with_module: bool = False) -> None:
        birth.moved = True
        birth.with_module = birth.with_module or with_module
        self.host.pop(id(tensor), None)

    def _mark_moved(self, tensor: Any, birth: Birth, with_module: bool) -> None:
        """``tensor`` was moved in place (on a CPU-only machine, always): it now stands for the device copy."""
        own = self.own_birth(tensor)
        if own is None:  # a view of a host tensor: it gets its own record
            own = birth.derived("view")
            self.remember(tensor, own)
        self._no_longer_host(tensor, own, with_module)

    def want_functions(self, names: "set[str] | frozenset[str]") -> None:
        """Births inside functions of these names remember them (for allow-list entries naming a function)."""
        self.functions.update(names)

    # -- tensors a DataLoader produced -----------------------------------------------------
    def _remember_loader(self, tensor: Any) -> None:
        key = id(tensor)
        table = self.loader_tensors
        try:
            ref = weakref.ref(tensor, lambda r, key=key: table.pop(key, None) if table.get(key) is r else None)
        except TypeError:  # pragma: no cover
            return
        table[key] = ref

    def _mark_batch(self, batch: Any, depth: int = 0) -> None:
        """Remember every tensor of a batch (tuples, lists, dicts, a few levels deep)."""
        if isinstance(batch, self.tensor_type):
            self._remember_loader(batch)
        elif depth < 4:
            if isinstance(batch, dict):
                for value in batch.values():
                    self._mark_batch(value, depth + 1)
            elif isinstance(batch, (list, tuple)):
                for value in batch:
                    self._mark_batch(value, depth + 1)

    def from_loader(self, tensor: Any) -> bool:
        """Whether ``tensor`` (or the tensor it is a view of) came out of a DataLoader during the run."""
        for t in (tensor, getattr(tensor, "_base", None)):
            if t is not None:
                ref = self.loader_tensors.get(id(t))
                if ref is not None and ref() is t:
                    return True
        return False

    # -- births ----------------------------------------------------------------------------
    def born(self, name: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]) -> None:
        tensor_type = self.tensor_type
        if not isinstance(out, tensor_type) or out.device.type != "cpu":
            return
        device = kwargs.get("device")
        if device is not None and not _is_cpu_string(device):
            # ``device=x.device`` / ``device=self.device``: the training device (the CPU on this machine).
            return
        if name in _DATA_FACTORIES and args and isinstance(args[0], tensor_type):
            return
        if name == "normal" and any(isinstance(a, tensor_type) for a in args):
            return  # normal(mean_tensor, std_tensor): follows its inputs
        explicit = device is not None or bool(kwargs.get("pin_memory"))
        site = caller(frame)
        kind = kind_of(site.f_code) if site is not None else TORCH
        if kind == TORCH or site is None:
            birth = Birth(name, TORCH, None, (), explicit, ())
        else:
            scope: tuple[tuple["Run", Optional[int]], ...] = ()
            if FLAGS.in_scope:
                scope = tuple((run, run.unit) for run in core.runs_in_scope())
            stack = self.stacks.get(("birth", site.f_code, site.f_lineno), site)
            birth = Birth(
                name, kind, describe_frame(site), stack, explicit, scope,
                tuple(out.shape), str(out.dtype).replace("torch.", ""),
            )
            if self.functions:
                from ..allow import function_names  # noqa: PLC0415 - only for allow-lists naming functions

                birth.functions = function_names(site, self.functions)
        self.remember(out, birth)

    def derive(self, name: str, source: Any, out: Any) -> None:
        """``out`` is ``source`` converted (dtype, ``.to(dtype)``): it keeps ``source``'s provenance."""
        birth = self.birth_of(source)
        if birth is not None and not birth.moved:
            self.remember(out, birth.derived(name))
        elif self.loader_tensors and self.from_loader(source):
            self._remember_loader(out)

    # -- moves -----------------------------------------------------------------------------
    def tell(self, event: Move) -> None:
        core.notify("on_move", event, in_scope=True)

    def on_move(self, op: str, tensor: Any, target: Any, out: Any, frame: Optional[FrameType], told: bool = False) -> None:
        """After a move: tell the checks in scope and update the registry.

        ``told``: the checks already heard of this move (``.cuda()`` tells them
        before the call, which raises on a machine without CUDA).
        """
        birth = self.birth_of(tensor)
        first = birth is not None and not birth.moved
        if FLAGS.in_scope and not told:
            real = (
                tensor.device.type == "cpu"
                and isinstance(out, self.tensor_type)
                and out.device.type not in ("cpu", "meta")
            )
            known = birth if birth is not None and not birth.with_module else None
            if known is not None or real:
                self.tell(Move(op, tensor, known, first, target, frame, real))
        if birth is not None and first and out is tensor:
            mover = caller(frame)
            self._mark_moved(tensor, birth, mover is None or kind_of(mover.f_code) == TORCH)

    def target_of_to(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The device a ``Tensor.to(...)`` call moves to (a device, str, int or tensor), None for dtype only."""
        device = kwargs.get("device")
        if device is not None:
            return device
        for arg in args:
            if isinstance(arg, (str, self.device_type, self.tensor_type)):
                return arg
            if isinstance(arg, int) and not isinstance(arg, bool):
                return arg
        other = kwargs.get("other")
        return other if isinstance(other, self.tensor_type) else None

    # -- install ---------------------------------------------------------------------------
    def install(self, patcher: "Patcher") -> None:
        """Patch torch's factories, conversions and moves; undone by ``patcher``."""
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        self.tensor_type = tensor_type = torch.Tensor
        self.device_type = torch.device
        self.compiling = is_compiling = is_compiling_function()
        flags = FLAGS
        getframe = sys._getframe
        probe = self
        dispatch = _subclass_dispatch(torch)

        def factory(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def make(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                out = original(*args, **kwargs)
                if not is_compiling() and flags.active:
                    try:
                        probe.born(name, out, args, kwargs, getframe(1))
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return out

            return functools.wraps(original)(make)

        for name in FACTORIES:
            original = getattr(torch, name, None)
            if original is not None:
                patcher.setattr(torch, name, factory(name, original))

        def conversion(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
            def convert(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, args, kwargs)
                out = original(self, *args, **kwargs)
                if out is not self and not is_compiling() and flags.active and (probe.births or probe.loader_tensors):
                    try:
                        probe.derive(name, self, out)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return functools.wraps(original)(convert)

        for name in CONVERSIONS:
            patcher.wrap(tensor_type, name, lambda original, name=name: conversion(name, original))

        # A real host-to-device copy can only happen where an accelerator is present.
        accelerated = accelerator_available()

        def after_to(self: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]) -> None:
            birth = probe.birth_of(self)
            if birth is None or (birth.moved and not flags.in_scope):
                if accelerated:
                    target = probe.target_of_to(args, kwargs)
                    if target is None:
                        if out is not self and probe.loader_tensors and probe.from_loader(self):
                            probe._remember_loader(out)
                    elif flags.in_scope:
                        probe.on_move("to", self, target, out, frame)
                return
            target = probe.target_of_to(args, kwargs)
            if target is None:
                if out is not self and not birth.moved:
                    probe.remember(out, birth.derived("to"))
            else:
                probe.on_move("to", self, target, out, frame)

        births_get = self.births.get

        def wrap_to(original: Callable[..., Any]) -> Callable[..., Any]:
            def to(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, args, kwargs)
                out = original(self, *args, **kwargs)
                if not is_compiling() and flags.active:
                    if not accelerated and births_get(id(self)) is None:
                        # Fast path: not a host-born tensor (a batch, a parameter), unless a view of one.
                        base = self._base
                        if base is None or births_get(id(base)) is None:
                            return out
                    try:
                        after_to(self, out, args, kwargs, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return functools.wraps(original)(to)

        def wrap_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
            def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, args, kwargs)
                if is_compiling() or not flags.active:
                    return original(self, *args, **kwargs)
                told = False
                try:
                    if flags.in_scope:
                        birth = probe.birth_of(self)
                        if birth is not None and not birth.with_module:
                            # Told before the call: without CUDA the call raises; the code is still the bug.
                            probe.tell(Move("cuda", self, birth, not birth.moved, "cuda", getframe(1)))
                            told = True
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                out = original(self, *args, **kwargs)
                try:
                    probe.on_move("cuda", self, "cuda", out, getframe(1), told)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                return out

            return functools.wraps(original)(cuda)

        def wrap_type_as(original: Callable[..., Any]) -> Callable[..., Any]:
            def type_as(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (other,) + args, kwargs)
                out = original(self, other, *args, **kwargs)
                if not is_compiling() and flags.active:
                    try:
                        probe.on_move("type_as", self, other, out, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return functools.wraps(original)(type_as)

        def wrap_copy_(original: Callable[..., Any]) -> Callable[..., Any]:
            def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (src,) + args, kwargs)
                if flags.in_scope and not is_compiling() and isinstance(src, tensor_type):
                    try:
                        birth = probe.birth_of(src)
                        real = src.device.type == "cpu" and self.device.type not in ("cpu", "meta")
                        if birth is not None and not birth.moved and not birth.with_module and not probe.is_host_tensor(self):
                            probe.tell(Move("copy_", src, birth, True, self, getframe(1), real))
                        elif real:
                            probe.tell(Move("copy_", src, None, False, self, getframe(1), True))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return original(self, src, *args, **kwargs)

            return functools.wraps(original)(copy_)

        if accelerated:
            # Batches are host tensors copied to the device by design: remember them, so the
            # check of real host-to-device copies leaves them alone.
            from torch.utils.data import dataloader

            def wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
                def __next__(self: Any) -> Any:
                    __tracebackhide__ = True
                    batch = original(self)
                    if flags.active:
                        try:
                            probe._mark_batch(batch)
                        except Exception as exc:  # noqa: BLE001
                            probe.failed(exc)
                    return batch

                return functools.wraps(original)(__next__)

            patcher.wrap(dataloader._BaseDataLoaderIter, "__next__", wrap_next)

        def wrap_register_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
            def register_buffer(self: Any, name: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                out = original(self, name, tensor, *args, **kwargs)
                if tensor is not None and probe.births:
                    try:
                        birth = probe.own_birth(tensor)
                        if birth is not None:
                            probe._no_longer_host(tensor, birth, with_module=True)  # it lives on the module's device
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return functools.wraps(original)(register_buffer)

        patcher.wrap(torch.nn.Module, "register_buffer", wrap_register_buffer)
        patcher.wrap(tensor_type, "to", wrap_to)
        patcher.wrap(tensor_type, "cuda", wrap_cuda)
        patcher.wrap(tensor_type, "type_as", wrap_type_as)
        patcher.wrap(tensor_type, "copy_", wrap_copy_)
        self._install_optimizer_hook(patcher, torch)

    def _install_optimizer_hook(self, patcher: "Patcher", torch: Any) -> None:
        """Optimizers keep their ``step`` counters on the host on purpose unless capturable or fused
        ("special device hosting for step"); a state loaded before the run was not seen being born,
        so mark it when the optimizer steps."""
        try:
            optimizer_module = importlib.import_module("torch.optim.optimizer")
        except ImportError:  # pragma: no cover
            return
        register = getattr(optimizer_module, "register_optimizer_step_pre_hook", None)
        if register is None:  # pragma: no cover - torch < 2.0
            return
        scanned: dict[int, tuple[int, int]] = {}
        tensor_type = torch.Tensor
        flags = FLAGS
        probe = self

        def optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not flags.in_scope or probe.disabled:
                return
            try:
                state = optimizer.state
                seen = (id(state), len(state))
                if scanned.get(id(optimizer)) == seen:
                    return  # nothing new since the last scan
                scanned[id(optimizer)] = seen
                for group in optimizer.param_groups:
                    if group.get("capturable") or group.get("fused"):
                        continue
                    for param in group["params"]:
                        param_state = state.get(param)
                        step = param_state.get("step") if param_state else None
                        if isinstance(step, tensor_type) and step.device.type == "cpu" and probe.own_birth(step) is None:
                            probe.mark_host(step)
            except Exception as exc:  # noqa: BLE001
                probe.failed(exc)

        handle = register(optimizer_pre_hook)
        patcher.callback(handle.remove, deferred=True)
        patcher.callback(scanned.clear, deferred=True)


class _SubclassDispatch:
    """Hands a tensor subclass with its own ``__torch_function__`` to torch as if nothing were patched.

    Unwatched, ``x.to(...)`` on such a subclass reaches its ``__torch_function__``
    with ``func`` = torch's own ``Tensor.to``. Inside a watch the class attribute is
    torchperf's wrapper, and torch would pass *that* as ``func`` (a subclass keyed
    on torch's functions would no longer recognise it). So a wrapper gives such a
    tensor straight to ``handle_torch_function`` with torch's own method.
    """

    def __init__(self, torch: Any) -> None:
        self._has = torch._C._has_torch_function_unary
        self._handle = torch.overrides.handle_torch_function
        self._has_any = torch._C._has_torch_function

    def overrides(self, tensor: Any) -> bool:
        return bool(self._has(tensor))

    def call(self, original: Callable[..., Any], this: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        relevant = (this,) + tuple(a for a in args if self._has_any((a,)))
        return self._handle(original, relevant, this, *args, **kwargs)


def _subclass_dispatch(torch: Any) -> _SubclassDispatch:
    return _SubclassDispatch(torch)


PROBE = TensorsProbe()
