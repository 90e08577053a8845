"""Probe ``tensors``: where a tensor was born, and when a host-born one is moved to a device.

``no_host_sync`` and ``on_device`` both need to know which tensors live on the
host *by construction*: a tensor made by a factory call (``torch.randn``,
``torch.tensor``, ``torch.zeros``...) without ``device=`` stays in host memory
even on a GPU run. ``.item()`` on it is not a device sync (``no_host_sync``
must not count it), and moving it to the device every step is exactly the bug
``on_device`` reports. On a CPU-only machine every tensor is on the CPU, so
this is the only way to tell "a host tensor" from "a tensor that would live on
the accelerator".

While installed, the probe (its registry is :mod:`._host`):

- wraps the factory functions of the ``torch`` namespace and records each
  host-born result. Factories called by torch itself (``nn.Linear`` building
  its weights) are recorded as host tensors but never blamed on anyone;
- follows a host-born tensor through views (``t._base``), dtype conversions
  (``.float()``, ``.long()``, ``.to(dtype)``...), the operations of
  :mod:`._propagate` and every other operation (:mod:`._follow`: a result
  computed only from host tensors is one), and through device moves
  (``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``,
  ``dst.copy_(t)``). A move is sent to the checks in scope as an ``on_move``
  event (:class:`Move`) and, when the move returns the very same tensor
  (always, on a CPU-only machine), the tensor stops counting as a host tensor:
  from then on it stands for the device copy. This is what keeps a buffer
  moved with its module, or a batch moved to the device, a device tensor. A
  move made by torch's own code (``module.to()``) or ``register_buffer``
  marks the tensor as travelling with its module. A host target written out
  (``.to("cpu")``) is not a move: the result stays a host tensor;
- reports python data built straight on the device inside a step
  (``torch.tensor(v, device=dev)``, ``x.new_tensor(data)``): on CUDA that is a
  blocking copy from host memory, every time (an ``on_move`` event of op
  :data:`DATA`);
- recognises a tensor built by a legacy constructor (``torch.Tensor(n).fill_(v)``,
  ``torch.FloatTensor(x)``, ``torch.Tensor(next_obs).to(dev)``) when it is moved
  in a step, by reading the source at the move (:class:`._propagate.LegacySites`),
  with the array or list it was given (:mod:`._inputs`);
- remembers the modules moved to a device (``module.to(dev)``, ``.cuda()``), so
  ``module.cpu()`` of a module that never left the host is not a copy;
- on a machine with an accelerator, remembers the tensors DataLoaders yield
  (and their conversions), so a real host-to-device copy of anything else can
  be told from a batch;
- marks an optimizer's ``step`` counters as host tensors when a step reads one
  (torch keeps them on the host on purpose unless ``capturable``/``fused``).
- tells the checks in scope of each ``non_blocking=True`` copy (``on_async_copy``,
  :class:`AsyncCopy`) and of each ``Tensor.pin_memory()`` call (``on_pin_memory``,
  told before the call: on a machine without an accelerator torch raises), in
  the thread that installed it (a DataLoader's pinning thread is not the step).

A tensor subclass with its own ``__torch_function__`` is handed to torch as if
nothing watched (the subclass sees torch's own method as ``func``), and is not
followed.

Known blind spots, by design: indexing with a tensor (``table[idx]``), the
first step's operations when the run's first host tensor is built inside
them (the wrappers are installed at that moment), factories and operations
imported by name before the run (``from torch import randn``), and legacy
constructors whose source cannot be read.
"""

from __future__ import annotations

import os
import sys
import threading
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core
from .._guard import caller_frame
from ..core import FLAGS
from ..patching import wraps
from . import Probe, _inputs, _propagate, accelerator_available, is_compiling_function
from ._host import (
    CONVERSIONS,
    DATA,
    FACTORIES,
    Birth,
    HostRegistry,
    Move,
    describe_data,
    is_cpu_string,
    subclass_dispatch,
)

#: ``to()``'s first argument when none was given.
_UNSET = object()

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["AsyncCopy", "Birth", "Move", "TensorsProbe", "FACTORIES", "CONVERSIONS", "DATA"]

#: Kept for the probes that import it from here.
_subclass_dispatch = subclass_dispatch


@dataclass(frozen=True)
class AsyncCopy:
    """A ``non_blocking=True`` copy inside the scope: ``.to(..., non_blocking=True)``, ``.cuda(non_blocking=True)``
    or ``dst.copy_(src, non_blocking=True)``, as the ``on_async_copy`` event carries it."""

    op: str
    source: Any
    #: The copy: the result of ``.to``/``.cuda``, the destination of ``copy_``.
    result: Any
    #: Device to host (the result is read on the host); else host to device.
    to_host: bool
    frame: Optional[FrameType]


class TensorsProbe(HostRegistry, Probe):
    """The registry of host-born tensors and the moves of those tensors (see the module's docstring)."""

    name = "tensors"
    events = {
        "on_async_copy": "(event): a `non_blocking=True` copy inside the scope (an AsyncCopy)",
        "on_pin_memory": "(frame): `Tensor.pin_memory()` was called inside the scope, told before torch runs it",
    }

    def __init__(self) -> None:
        Probe.__init__(self)
        HostRegistry.__init__(self)
        #: Lines that move (``.cuda()``, ``.type_as()``) or fill a tensor a legacy constructor built.
        self.legacy = _propagate.LegacySites(_propagate.MOVES)
        self.legacy_fills = _propagate.LegacySites(_propagate.INITIALIZERS)
        self.legacy_arguments = _inputs.LegacyArgument()
        #: id(code) -> the instruction offsets of moves whose line shows no legacy constructor. The code
        #: objects are held in ``_plain_codes`` (so an id here is never another object's), bounded together.
        self._plain: dict[int, set[int]] = {}
        self._plain_codes: list[Any] = []
        self.cpu_literals = _propagate.CpuLiterals()
        #: ``torch.optim.Optimizer`` and ``torch.Tensor`` once installed; the folder of torch's optimizers.
        self._optimizer_type: Any = None
        self._tensor_type: Any = None
        self._optimizer_dir = ""
        #: id(optimizer) -> (id, length) of its state at its last scan (:meth:`optimizer_counters`).
        self._scanned: dict[int, tuple[int, int]] = {}
        #: The thread the probe was installed in: the one whose ``non_blocking`` copies and pins are told.
        self.thread: Optional[int] = None

    def reset(self) -> None:
        Probe.reset(self)
        self.clear()
        # What a line's source shows (``legacy``, ``legacy_fills``, ``legacy_arguments``, ``_plain``,
        # ``cpu_literals``) is kept from watch to watch: it is a fact of the code object it is keyed by (held,
        # so its id stays its own), each cache bounded, and a statement parsed again at every watch was a
        # large part of what a watched fit paid once.

    def copied_async(self, op: str, source: Any, out: Any, target: Any, frame: Optional[FrameType]) -> None:
        """A ``non_blocking=True`` copy in a step: tell the checks in scope (an :class:`AsyncCopy`).

        Device to host when the result is on the CPU and the source is not (a real copy), or, where both are
        (a CPU-only machine), when the line writes the CPU out (``.to("cpu", non_blocking=True)``) or the
        destination of a ``copy_`` is a host tensor by construction.
        """
        try:
            if threading.get_ident() != self.thread or not core.handlers("on_async_copy", in_scope=True):
                return
            if not isinstance(out, self.tensor_type) or not isinstance(source, self.tensor_type):
                return
            if out.device.type != "cpu":
                to_host = False
            elif source.device.type != "cpu":
                to_host = True
            elif op == "copy_":
                to_host = self.is_host_tensor(out)
            else:
                to_host = is_cpu_string(target) and self.writes_cpu(frame)
            core.notify("on_async_copy", AsyncCopy(op, source, out, to_host, frame), in_scope=True)
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            self.failed(exc)

    def writes_cpu(self, frame: Optional[FrameType]) -> bool:
        return frame is None or self.cpu_literals.at(frame)

    def moved_module(self, module: Any) -> bool:
        """Whether ``module`` was moved to a device while watched (so its ``.cpu()`` copies)."""
        try:
            return module in self.moved_modules
        except TypeError:  # pragma: no cover - an unhashable module
            return True

    def legacy_filled(self, tensor: Any, frame: Optional[FrameType]) -> None:
        """A fresh tensor was filled in a step: recorded as host-born when a legacy constructor built it."""
        birth = _propagate.legacy_birth(self, self.legacy_fills, frame, tensor)
        if birth is not None:
            self.remember(tensor, birth)

    def _legacy_move(self, op: str, tensor: Any, target: Any, out: Any, frame: Optional[FrameType]) -> bool:
        """A move in a step of a tensor the registry does not know: built by a legacy constructor? (told if so)"""
        birth = _propagate.legacy_birth(self, self.legacy, frame, tensor)
        if birth is None:
            return False
        real = isinstance(out, self.tensor_type) and out.device.type not in ("cpu", "meta")
        self.tell(Move(op, tensor, birth, True, target, frame, real))
        return True

    def _plain_move(self, frame: FrameType) -> bool:
        """Whether the line moving a tensor at ``frame`` shows no legacy constructor: read once per line, then
        answered by the instruction offset (cheaper than the line number) for every batch moved there."""
        code = frame.f_code
        offsets = self._plain.get(id(code))
        if offsets is not None and frame.f_lasti in offsets:
            return True
        if self.legacy.at(frame) is not None:
            return False
        if offsets is None:
            if len(self._plain) > 5000:
                self._plain.clear()
                self._plain_codes.clear()
            offsets = self._plain[id(code)] = set()
            self._plain_codes.append(code)
        offsets.add(frame.f_lasti)
        return True

    def legacy_to(self, tensor: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                  frame: Optional[FrameType]) -> bool:
        """``.to(device)`` in a step of a fresh tensor the registry does not know: a legacy constructor given
        data (``torch.Tensor(next_obs).to(dev)``)? Told if so, with the data it was given."""
        if frame is None or self._plain_move(frame):
            return False
        target = self.target_of_to(args, kwargs)
        if target is None or (is_cpu_string(target) and self.writes_cpu(frame)):
            return False
        birth = _propagate.legacy_birth(self, self.legacy, frame, tensor)
        if birth is None:
            return False
        from ..frames import caller

        site = caller(frame)
        data = _inputs.legacy_data(self.legacy_arguments, site) if site is not None else None
        if data is not None:
            describe_data(birth, data, True)
            birth.data = "values"
        real = isinstance(out, self.tensor_type) and out.device.type not in ("cpu", "meta")
        self.tell(Move("to", tensor, birth, True, target, frame, real))
        return True

    # -- install ---------------------------------------------------------------------------
    def install(self, patcher: Patcher) -> None:
        """Patch torch's factories, conversions, moves and a few cheap operations; undone by ``patcher``.

        The wrappers are built once and kept for later watches (:meth:`~pytest_torchperf.patching.Patcher.
        reusing`): they read this probe's state when called, and the one value read here (is there an
        accelerator?) is part of their scope.
        """
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        self.thread = threading.get_ident()
        self.compiling = is_compiling_function()
        # A real host-to-device copy can only happen where an accelerator is present.
        accelerated = accelerator_available()
        with patcher.reusing((self, accelerated, self.compiling)):
            self._install(patcher, torch, accelerated)

    def _install(self, patcher: Patcher, torch: Any, accelerated: bool) -> None:
        self.tensor_type = tensor_type = torch.Tensor
        self.device_type = torch.device
        is_compiling = self.compiling
        flags = FLAGS
        getframe = caller_frame  # the wrapper's caller, past the engine's guard
        probe = self
        dispatch = subclass_dispatch(torch)

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

            return wraps(original)(make)

        for name in FACTORIES:
            if getattr(torch, name, None) is not None:
                patcher.wrap(torch, name, lambda original, name=name: factory(name, original))  # type: ignore[misc]

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

            return wraps(original)(convert)

        for name in CONVERSIONS:
            patcher.wrap(tensor_type, name, lambda original, name=name: conversion(name, original))  # type: ignore[misc]

        def after_to(
            self: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]
        ) -> None:
            target = probe.target_of_to(args, kwargs)
            birth = probe.birth_of(self)
            if is_cpu_string(target) and (birth is None or not flags.in_scope or probe.writes_cpu(frame)):
                # .to("cpu") written out: a host target on purpose, not a move to the device (a host-built
                # tensor moved to a variable that holds "cpu" here is moved to the training device)
                target = None
            fresh = birth is None and flags.in_scope and self._version == 0
            if fresh and probe.legacy_to(self, out, args, kwargs, frame):
                return
            if birth is None or (birth.moved and not flags.in_scope):
                if target is None:
                    if out is not self and accelerated and probe.loader_tensors and probe.from_loader(self):
                        probe.remember_loader(out)
                elif flags.in_scope and accelerated:
                    probe.on_move("to", self, target, out, frame)
                return
            if target is None:
                if out is not self and not birth.moved:
                    probe.remember(out, birth.derived("to"))
            else:
                probe.on_move("to", self, target, out, frame)

        births = self.births  # cleared in place (reset()), never replaced
        births_get = births.get
        plain_get = self._plain.get
        unset = _UNSET

        def wrap_to(original: Callable[..., Any]) -> Callable[..., Any]:
            # ``target`` apart: ``x.to(device)``, the usual call, passes its one argument without a
            # tuple and a dict built and unpacked (a third of what the wrapper costs a batch). Only the
            # paths that record something build the call's positional arguments: ``(target,)`` in the
            # usual call; in any other ``target`` is put into ``args`` and set back to ``unset``.
            def to(self: Any, target: Any = unset, /, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if target is not unset and not args and not kwargs and type(self) is tensor_type:
                    out = original(self, target)
                else:
                    if target is not unset:
                        args = (target,) + args
                        target = unset
                    if type(self) is not tensor_type and dispatch.overrides(self):
                        return dispatch.call(original, self, args, kwargs)
                    out = original(self, *args, **kwargs)
                    if kwargs and flags.in_scope and kwargs.get("non_blocking") is True:
                        probe.copied_async("to", self, out, probe.target_of_to(args, kwargs), getframe(1))
                if not accelerated and (
                    not births or (
                        births_get(id(self)) is None
                        and ((base := self._base) is None or births_get(id(base)) is None)
                    )
                ):
                    # Fast path: not a host-born tensor (a batch, a parameter), nor a view of one. It only
                    # reads, so ``is_compiling()`` (two Python calls) waits until something is to be recorded.
                    if flags.in_scope:  # maybe ``torch.Tensor(data).to(dev)``
                        frame = getframe(1)
                        # ``_plain_move``'s answer for a line read before, inlined: every batch's move. The
                        # line is looked up before the tensor's version is read (a property call): a batch is
                        # a fresh tensor at every step, and its line is known from the first.
                        offsets = plain_get(id(frame.f_code))
                        if (
                            (offsets is None or frame.f_lasti not in offsets)
                            and self._version == 0 and not is_compiling() and flags.active
                        ):
                            if target is not unset:
                                args = (target,)
                            try:
                                probe.legacy_to(self, out, args, kwargs, frame)
                            except Exception as exc:  # noqa: BLE001
                                probe.failed(exc)
                    return out
                if not is_compiling() and flags.active:
                    if target is not unset:
                        args = (target,)
                    try:
                        after_to(self, out, args, kwargs, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(to)

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
                        if birth is None:
                            birth = _propagate.legacy_birth(probe, probe.legacy, getframe(1), self)
                        if birth is not None and not birth.with_module:
                            # Told before the call: without CUDA the call raises; the code is still the bug.
                            probe.tell(Move("cuda", self, birth, not birth.moved, "cuda", getframe(1)))
                            told = True
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                out = original(self, *args, **kwargs)
                if flags.in_scope and (kwargs.get("non_blocking") is True or args[1:2] == (True,)):
                    probe.copied_async("cuda", self, out, "cuda", getframe(1))
                try:
                    probe.on_move("cuda", self, "cuda", out, getframe(1), told)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                return out

            return wraps(original)(cuda)

        def wrap_type_as(original: Callable[..., Any]) -> Callable[..., Any]:
            def type_as(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (other,) + args, kwargs)
                out = original(self, other, *args, **kwargs)
                if not is_compiling() and flags.active:
                    try:
                        if not (
                            flags.in_scope and probe.birth_of(self) is None
                            and probe._legacy_move("type_as", self, other, out, getframe(1))
                        ):
                            probe.on_move("type_as", self, other, out, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(type_as)

        def wrap_copy_(original: Callable[..., Any]) -> Callable[..., Any]:
            def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (src,) + args, kwargs)
                if flags.in_scope and not is_compiling() and isinstance(src, tensor_type):
                    try:
                        birth = probe.birth_of(src)
                        real = src.device.type == "cpu" and self.device.type not in ("cpu", "meta")
                        if (
                            birth is not None
                            and not birth.moved
                            and not birth.with_module
                            and not probe.is_host_tensor(self)
                        ):
                            probe.tell(Move("copy_", src, birth, True, self, getframe(1), real))
                        elif real:
                            probe.tell(Move("copy_", src, None, False, self, getframe(1), True))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                out = original(self, src, *args, **kwargs)
                if flags.in_scope and (kwargs.get("non_blocking") is True or args[:1] == (True,)):
                    probe.copied_async("copy_", src, self, self, getframe(1))
                return out

            return wraps(original)(copy_)

        def wrap_pin_memory(original: Callable[..., Any]) -> Callable[..., Any]:
            def pin_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if flags.in_scope and not is_compiling() and threading.get_ident() == probe.thread:
                    # Told before the call: without an accelerator torch raises; the code is still the bug.
                    try:
                        core.notify("on_pin_memory", getframe(1), in_scope=True)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return original(self, *args, **kwargs)

            return wraps(original)(pin_memory)

        def wrap_new_tensor(original: Callable[..., Any]) -> Callable[..., Any]:
            def new_tensor(self: Any, data: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (data,) + args, kwargs)
                out = original(self, data, *args, **kwargs)
                if flags.in_scope and not is_compiling() and not isinstance(data, tensor_type):
                    try:
                        device = kwargs.get("device", self.device)
                        if not is_cpu_string(device) and not probe.is_host_tensor(self):
                            probe.data_to_device("new_tensor", out, data, device, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(new_tensor)

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
                            probe.mark_batch(batch)
                        except Exception as exc:  # noqa: BLE001
                            probe.failed(exc)
                    return batch

                return wraps(original)(__next__)

            patcher.wrap(dataloader._BaseDataLoaderIter, "__next__", wrap_next)

        def wrap_initializer(original: Callable[..., Any]) -> Callable[..., Any]:
            def initialize(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, args, kwargs)
                # A fresh tensor (never written), not one the registry knows, filled in a step: maybe the
                # uninitialised memory of a legacy constructor (``torch.Tensor(n).fill_(v)``).
                fresh = (
                    not is_compiling() and flags.in_scope and self._version == 0
                    and births_get(id(self)) is None and not self.requires_grad
                )
                out = original(self, *args, **kwargs)
                if fresh:
                    try:
                        probe.legacy_filled(self, getframe(1))
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(initialize)

        for name in _propagate.INITIALIZERS:
            if hasattr(tensor_type, name):
                patcher.wrap(tensor_type, name, wrap_initializer)

        def wrap_register_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
            def register_buffer(self: Any, name: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                out = original(self, name, tensor, *args, **kwargs)
                if tensor is not None and probe.births:
                    try:
                        birth = probe.own_birth(tensor)
                        if birth is not None:
                            probe.no_longer_host(tensor, birth, with_module=True)  # it lives on the module's device
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(register_buffer)

        patcher.wrap(torch.nn.Module, "register_buffer", wrap_register_buffer)
        patcher.wrap(tensor_type, "to", wrap_to)
        patcher.wrap(tensor_type, "cuda", wrap_cuda)
        patcher.wrap(tensor_type, "type_as", wrap_type_as)
        patcher.wrap(tensor_type, "copy_", wrap_copy_)
        patcher.wrap(tensor_type, "new_tensor", wrap_new_tensor)
        patcher.wrap(tensor_type, "pin_memory", wrap_pin_memory)
        self._install_module_moves(patcher, torch)
        _propagate.install(self, patcher, torch, dispatch)
        self._install_optimizer_scan(patcher, torch)

    def _install_module_moves(self, patcher: Patcher, torch: Any) -> None:
        """Remember the modules moved to a device target (``.to(dev)``, ``.cuda()``), with their submodules."""
        probe = self
        flags = FLAGS
        is_compiling = self.compiling

        def remember(module: Any) -> None:
            for sub in module.modules():
                probe.moved_modules.add(sub)

        def wrap_to(original: Callable[..., Any]) -> Callable[..., Any]:
            def to(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                out = original(self, *args, **kwargs)
                if flags.active and not is_compiling():
                    try:
                        target = kwargs.get("device", args[0] if args else None)
                        if isinstance(target, (str, int, torch.device, torch.Tensor)) and not is_cpu_string(target):
                            remember(self)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return out

            return wraps(original)(to)

        def wrap_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
            def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if flags.active and not is_compiling():
                    try:
                        remember(self)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return original(self, *args, **kwargs)

            return wraps(original)(cuda)

        patcher.wrap(torch.nn.Module, "to", wrap_to)
        patcher.wrap(torch.nn.Module, "cuda", wrap_cuda)

    def _install_optimizer_scan(self, patcher: Patcher, torch: Any) -> None:
        """Optimizers keep their ``step`` counters on the host on purpose unless capturable or fused
        ("special device hosting for step"); a state built before the run was not seen being born. The
        first time a step reads a CPU tensor nobody is known to have put on the host from inside an
        optimizer's step, that optimizer's counters are marked (:meth:`optimizer_counters`): a scan
        when a read is in question, where a hook on every optimizer step cost each step a call."""
        optimizer_type = getattr(getattr(torch, "optim", None), "Optimizer", None)
        module = sys.modules.get(getattr(optimizer_type, "__module__", ""))
        if optimizer_type is None or module is None:  # pragma: no cover
            return
        self._optimizer_type, self._tensor_type = optimizer_type, torch.Tensor
        self._optimizer_dir = os.path.dirname(getattr(module, "__file__", "") or "") + os.sep
        patcher.callback(self._scanned.clear, deferred=True)

    def optimizer_counters(self, frame: Optional[FrameType]) -> bool:
        """Whether an optimizer stepping on the stack above ``frame`` had host ``step`` counters marked now."""
        optimizer_type, folder = self._optimizer_type, self._optimizer_dir
        if optimizer_type is None or self.disabled:
            return False
        try:
            # Only frames of torch's optimizers are read for their ``self`` (their locals' snapshot ends with
            # the step); the step wrapper every optimizer's ``step`` runs in is one of them, for any subclass.
            while frame is not None:
                if frame.f_code.co_filename.startswith(folder):
                    optimizer = frame.f_locals.get("self")
                    if isinstance(optimizer, optimizer_type):
                        return self._scan(optimizer)
                frame = frame.f_back
        except Exception as exc:  # noqa: BLE001 - an optimizer's own state may be anything
            self.failed(exc)
        return False

    def _scan(self, optimizer: Any) -> bool:
        state = optimizer.state
        seen = (id(state), len(state))
        if self._scanned.get(id(optimizer)) == seen:
            return False  # nothing new since the last scan
        self._scanned[id(optimizer)] = seen
        marked = False
        tensor_type = self._tensor_type
        for group in optimizer.param_groups:
            if group.get("capturable") or group.get("fused"):
                continue
            for param in group["params"]:
                param_state = state.get(param)
                step = param_state.get("step") if param_state else None
                if isinstance(step, tensor_type) and step.device.type == "cpu" and self.own_birth(step) is None:
                    self.mark_host(step)
                    marked = True
        return marked
