"""Probe ``syncs``: the operations that make the host wait for the device, caught on CPU-only CI too.

An ``.item()`` in a training step makes the CPU wait until the GPU has run
every kernel queued so far, every step; so do ``float(t)``, ``if t > x:``, an
f-string or ``print`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``
and every operation whose output size depends on the data (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing...). On a CPU there is
nothing to wait for, so ``torch.cuda.set_sync_debug_mode`` cannot see them.

The probe patches only the operations of interest: the Tensor methods in
:data:`METHODS` and the ``torch`` functions in :data:`FUNCTIONS` (a Python
wrapper on a few methods costs about 1% of a small step; intercepting every
torch call with a ``TorchFunctionMode`` costs 30-90%). Outside a step a
wrapper does one attribute load and calls through. Inside a step an operation
is a :class:`Sync` event (sent to the checks in scope as ``on_sync``) when the
tensor it reads is one that lives on the accelerator:

- a tensor on a non-CPU device really synchronises;
- on a CPU-only machine, a CPU tensor *would* synchronise on an accelerator,
  unless it is a host tensor by construction (:mod:`.tensors`); reads of those
  are counted apart (:attr:`SyncsProbe.host_reads`) and are never events;
- on a machine where CUDA is in use, a CPU tensor is a host tensor;
- ``module.cpu()`` of a module that was never moved to a device (while
  watched) and holds only CPU tensors copies nothing: no event.

An operation made inside another one (``print`` reading the values with
``.item()``) is one event. Boolean-mask indexing is seen through
``Tensor.__getitem__``/``__setitem__``, patched with the class's type slots
kept as they were (see :mod:`pytest_torchperf._slots`); on an interpreter where
that cannot be guaranteed those two are not patched and the probe says so
(:attr:`~pytest_torchperf.probes.Probe.unavailable`). On CUDA,
``torch.cuda.set_sync_debug_mode("warn")`` is switched on inside steps and
restored outside them; its warnings confirm the events above and add the
synchronising operations no wrapper sees (blocking copies, ``index_put_``
with a mask...), at their lines.

It also keeps the results of device-to-host ``non_blocking`` copies a check
asked it to watch (:meth:`SyncsProbe.await_sync`): a read of one on the host
(``.item()``, ``.tolist()``, ``.numpy()``, ``print``...) before any
synchronisation (``torch.cuda.synchronize()``, a stream's or event's
``synchronize()``, ``torch.cpu``/``torch.accelerator.synchronize()``, or a read of
a device tensor) is an ``on_unsynced_read`` event. Indexing the result with an
int or handing it to NumPy without ``.numpy()`` is not seen.
"""

from __future__ import annotations

import re
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import _slots, core
from .._guard import caller_frame
from ..core import FLAGS
from ..frames import Located, locate
from ..patching import SlotPatchUnsupported, wraps
from . import Probe, compiling_parts
from .tensors import TensorsProbe, _subclass_dispatch

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["Op", "Sync", "UnsyncedRead", "SyncsProbe", "METHODS", "FUNCTIONS", "HOST", "WOULD"]


@dataclass(frozen=True)
class Op:
    """One caught operation: how the report names it and which hint goes with it."""

    name: str
    label: str
    hint: str


#: Tensor methods patched, and how the report names them.
METHODS = {
    "item": Op("item", "`.item()`", "value"),
    "__float__": Op("__float__", "`float(tensor)`", "value"),
    "__int__": Op("__int__", "`int(tensor)`", "value"),
    "__complex__": Op("__complex__", "`complex(tensor)`", "value"),
    "__index__": Op("__index__", "a tensor used as a Python int (`range(t)`, `seq[t]`)", "value"),
    "__bool__": Op("__bool__", "`bool(tensor)` (`if`/`while`/`assert`/`and`/`or` on a tensor)", "branch"),
    "__contains__": Op("__contains__", "`value in tensor`", "branch"),
    "equal": Op("equal", "`.equal()` (a Python bool)", "branch"),
    "allclose": Op("allclose", "`.allclose()` (a Python bool)", "branch"),
    "tolist": Op("tolist", "`.tolist()`", "host"),
    "numpy": Op("numpy", "`.numpy()`", "host"),
    "cpu": Op("cpu", "`.cpu()`", "host"),
    "__format__": Op("__format__", "an f-string or `format()` of a tensor", "print"),
    "__repr__": Op("__repr__", "`print`/`str`/`repr` of a tensor", "print"),
    "nonzero": Op("nonzero", "`nonzero`", "shape"),
    "argwhere": Op("argwhere", "`argwhere`", "shape"),
    "masked_select": Op("masked_select", "`masked_select`", "shape"),
    "unique": Op("unique", "`unique`", "unique"),
    "unique_consecutive": Op("unique_consecutive", "`unique_consecutive`", "unique"),
    "bincount": Op("bincount", "`bincount`", "bincount"),
    "repeat_interleave": Op("repeat_interleave", "`repeat_interleave` with tensor repeats", "repeat"),
    "__getitem__": Op("__getitem__", "boolean-mask indexing `x[mask]`", "shape"),
    "__setitem__": Op("__setitem__", "boolean-mask assignment `x[mask] = values`", "shape"),
}
#: ``torch`` functions patched (their Tensor-method twins are in METHODS).
FUNCTIONS = {
    "nonzero": METHODS["nonzero"],
    "argwhere": METHODS["argwhere"],
    "masked_select": METHODS["masked_select"],
    "unique": METHODS["unique"],
    "unique_consecutive": METHODS["unique_consecutive"],
    "bincount": METHODS["bincount"],
    "repeat_interleave": METHODS["repeat_interleave"],
    "equal": METHODS["equal"],
    "allclose": METHODS["allclose"],
    "is_nonzero": Op("is_nonzero", "`torch.is_nonzero`", "branch"),
    "where": Op("where", "`torch.where(condition)` with one argument", "shape"),
}
ONE_HOT = Op("one_hot", "`F.one_hot` without `num_classes`", "one_hot")
SYNCHRONIZE = Op("synchronize", "`torch.cuda.synchronize()`", "synchronize")
CUDA_REPORTED = Op("cuda_sync", "a synchronising CUDA operation", "cuda")

#: The hints of the operations that read a tensor's values on the host (a pending copy's result read early).
_READS = frozenset(("value", "host", "branch", "print"))

_SYNC_WARNING = re.compile(r"called a synchronizing CUDA operation")

#: Device verdicts for the tensor an operation reads, from "not an event" to "really synchronises".
HOST = "host"
WOULD = "cpu"  # a CPU tensor on a CPU-only machine: would synchronise on an accelerator

_UNARY = frozenset(("item", "__float__", "__int__", "__complex__", "__index__", "__bool__", "tolist"))


@dataclass(frozen=True)
class Sync:
    """One synchronising operation inside the scope, as the ``on_sync`` event carries it."""

    op: Op
    located: Located
    frame: Optional[FrameType]
    #: ``"cpu"`` (would synchronise on an accelerator) or the device it really synchronised on.
    device: str


@dataclass(frozen=True)
class UnsyncedRead:
    """A host read of a device-to-host ``non_blocking`` copy's result before any synchronisation."""

    op: Op
    located: Located
    frame: Optional[FrameType]
    #: What the check gave :meth:`SyncsProbe.await_sync` for that copy.
    token: Any


class SyncsProbe(Probe):
    """Wrappers of the synchronising operations (see the module's docstring)."""

    name = "syncs"
    needs = ("tensors",)

    events = {"on_unsynced_read": "(read): the host read the result of a device-to-host non_blocking copy before "
                                     "any synchronisation (an UnsyncedRead)"}

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, tuple[Any, Any]] = {}
        self.reset()

    def reset(self) -> None:
        super().reset()
        self.depth = 0
        #: What the handlers returned for the event being executed (a CUDA warning that follows confirms them).
        self.current: Optional[list[Any]] = None
        self.confirmed = False
        #: ``(weakref to the result, site key)`` of the last ``.cpu()`` event: reads chained on it at the
        #: same line (``x.cpu().numpy()``) are the same copy, counted once.
        self.chain: Optional[tuple[Any, Any]] = None
        self.thread: Optional[int] = None
        #: Reads of host tensors inside steps: not syncs, counted for the report.
        self.host_reads = 0
        #: The slot route of ``tensor[i]`` while a DataLoader fetches (:meth:`_route_fetches`), this watch's.
        self.route: Optional[_slots.SlotRoute] = None
        #: id(tensor) -> (weak reference, token): results of device-to-host ``non_blocking`` copies no
        #: synchronisation has followed yet (:meth:`await_sync`). Cleared in place, never replaced.
        self.pending.clear()

    # -- device-to-host copies not yet synchronised ------------------------------------------
    def await_sync(self, tensor: Any, token: Any) -> None:
        """``tensor`` holds the result of a device-to-host ``non_blocking`` copy: a read of it on the host before
        the next synchronisation is an ``on_unsynced_read`` event carrying ``token``."""
        try:
            self.pending[id(tensor)] = (weakref.ref(tensor), token)
        except TypeError:  # pragma: no cover - a tensor that cannot be weakly referenced
            pass

    def synchronised(self) -> None:
        """The host waited for the device: every copy queued before has landed."""
        self.pending.clear()

    def _read_pending(self, op: Op, this: Any, frame: Optional[FrameType]) -> bool:
        """A read of ``this``: an event when it is a pending copy's result (True), else a synchronisation when it
        reads a device tensor (the pending copies are then complete)."""
        entry = self.pending.get(id(this))
        if entry is None or entry[0]() is not this:
            return False
        del self.pending[id(this)]
        core.notify("on_unsynced_read", UnsyncedRead(op, locate(frame), frame, entry[1]), in_scope=True)
        return True

    def forked(self) -> None:
        """In a forked child: the thread that forked is this process's one thread, and no call is in flight."""
        super().forked()
        self.thread = threading.get_ident()
        self.depth = 0
        self.current = None
        self.chain = None

    @property
    def tensors(self) -> TensorsProbe:
        """The ``tensors`` probe this one needs (the engine's instance: :attr:`Probe.needed`)."""
        return self.needed["tensors"]  # type: ignore[return-value]

    # -- events ----------------------------------------------------------------------------
    def send(self, event: Sync) -> list[Any]:
        """Send ``event`` to the checks in scope; returns what they returned (their confirmable records)."""
        out = []
        for handler in core.handlers("on_sync", in_scope=True):
            try:
                record = handler(event)
            except Exception as exc:  # noqa: BLE001 - a check's bug is that check's
                _check_failed(handler, exc)
                continue
            if record is not None:
                out.append(record)
        return out

    def cuda_event(self, op: Op, frame: Optional[FrameType]) -> None:
        if threading.get_ident() != self.thread:
            return
        for record in self.send(Sync(op, locate(frame), frame, "cuda")):
            record.confirmed += 1

    # -- install ---------------------------------------------------------------------------
    def install(self, patcher: Patcher) -> None:
        """Patch the synchronising operations; undone by ``patcher``.

        The wrappers are built once and kept for later watches (:meth:`~pytest_torchperf.patching.Patcher.
        reusing`): they read the probe's state when called; whether CUDA is there, read here, is part of
        their scope.
        """
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        self.thread = threading.get_ident()
        cuda_available = torch.cuda.is_available()
        tensors = self.tensors
        with patcher.reusing((self, cuda_available, tensors, tensors.compiling)):
            self._install(patcher, torch, cuda_available)

    def _install(self, patcher: Patcher, torch: Any, cuda_available: bool) -> None:
        import torch.nn.functional as F

        tensor_type = torch.Tensor
        flags = FLAGS
        tensors = self.tensors
        is_compiling = tensors.compiling
        getframe = caller_frame  # the wrapper's caller, past the engine's guard
        probe = self
        masks = (torch.bool, torch.uint8)
        is_host_tensor = tensors.is_host_tensor
        dispatch = _subclass_dispatch(torch)

        def device_of(t: Any) -> Optional[str]:
            """The verdict for one tensor an operation reads."""
            if not isinstance(t, tensor_type):
                return None
            device = t.device
            kind = device.type
            if kind == "cpu":
                if is_host_tensor(t):
                    return HOST
                if cuda_available and torch.cuda.is_initialized():
                    return HOST
                return WOULD
            if kind == "meta":
                return None
            return str(device)

        def worst(*tensors: Any) -> Optional[str]:
            verdict = None
            for t in tensors:
                v = device_of(t)
                if v is None:
                    continue
                if v not in (HOST, WOULD):
                    return v
                if v == WOULD or verdict is None:
                    verdict = v
            return verdict

        def mask_in(index: Any) -> Any:
            if isinstance(index, tensor_type):
                return index if index.dtype in masks else None
            if isinstance(index, tuple):
                for item in index:
                    if isinstance(item, tensor_type) and item.dtype in masks:
                        return item
            return None

        def verdict(op: str, this: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[str]:
            """The device verdict for ``op`` applied to ``this``, None when the call cannot synchronise."""
            if op == "__getitem__":
                mask = mask_in(args[0]) if args else None
                return worst(mask) if mask is not None else None
            if op == "__setitem__":
                mask = mask_in(args[0]) if args else None
                value = args[1] if len(args) > 1 else None
                if mask is None or not isinstance(value, tensor_type):
                    return None  # a scalar value is a masked_fill_: no sync
                if value.numel() == 1 and device_of(value) == HOST:
                    return None
                return worst(mask, value)
            if op in ("masked_select", "equal", "allclose"):
                other = args[0] if args else kwargs.get("mask", kwargs.get("other"))
                return worst(this, other)
            if op == "where":
                return worst(this) if not args and not kwargs else None
            if op == "repeat_interleave":
                repeats = args[0] if args else kwargs.get("repeats")
                if kwargs.get("output_size") is not None or (len(args) >= 3 and args[2] is not None):
                    return None
                if repeats is None:
                    return worst(this)  # torch.repeat_interleave(repeats_tensor)
                return worst(repeats) if isinstance(repeats, tensor_type) else None
            if op == "one_hot":
                classes = args[0] if args else kwargs.get("num_classes", -1)
                return worst(this) if classes in (-1, None) else None
            return worst(this)

        def before(op: Op, this: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                   frame: Optional[FrameType]) -> Optional[tuple[list[Any], Located]]:
            """Decide whether the call is an event and send it; None: call through untouched."""
            if probe.depth or threading.get_ident() != probe.thread:
                return None
            pending = probe.pending and op.hint in _READS and probe._read_pending(op, this, frame)
            device = verdict(op.name, this, args, kwargs)
            if device == WOULD and tensors.optimizer_counters(frame):  # a state built before the run
                device = verdict(op.name, this, args, kwargs)
            if device is None:
                return None
            if device == HOST:
                probe.host_reads += 1
                return None
            if probe.pending and not pending:
                probe.synchronised()  # a read of a device tensor waits for the stream
            if not core.handlers("on_sync", in_scope=True):
                return None
            located = locate(frame)
            chain = probe.chain
            if chain is not None and chain[0]() is this and chain[1] == located.key:
                return None  # x.cpu().numpy(): one copy, counted at .cpu()
            return probe.send(Sync(op, located, frame, device)), located

        def after(op: Op, this: Any, out: Any, located: Located) -> None:
            if op.name == "cpu":
                if out is not this and isinstance(out, tensor_type):
                    tensors.mark_host(out)
                try:
                    probe.chain = (weakref.ref(out), located.key)
                except TypeError:  # pragma: no cover
                    probe.chain = None

        def observe(op: Op, original: Callable[..., Any], this: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any], frame: Optional[FrameType]) -> Any:
            try:
                seen = before(op, this, args, kwargs, frame)
            except Exception as exc:  # noqa: BLE001 - never into the user's code
                probe.failed(exc)
                seen = None
            if seen is None:
                return original(this, *args, **kwargs)
            records, located = seen
            probe.depth += 1
            previous, probe.current, probe.confirmed = probe.current, records, False
            try:
                out = original(this, *args, **kwargs)
            finally:
                probe.depth -= 1
                probe.current = previous
            try:
                after(op, this, out, located)
            except Exception as exc:  # noqa: BLE001
                probe.failed(exc)
            return out

        def method(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, args, kwargs)
                if not is_compiling() and flags.in_scope:
                    return observe(op, original, self, args, kwargs, getframe(1))
                return original(self, *args, **kwargs)

            return wraps(original)(wrapper)

        host_get = tensors.host.get
        pending = self.pending  # cleared in place, never replaced
        traced, session = compiling_parts()  # ``is_compiling()`` in one call: Adam reads 6 counters a step

        def unary(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(self: Any) -> Any:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (), {})
                if traced() or session._is_compiling_flag or not flags.in_scope:
                    return original(self)
                # Fast path for the most common read inside a step: a host tensor (an optimizer's step
                # counter read with .item() once per parameter per step).
                ref = host_get(id(self))
                if ref is not None and ref() is self and not pending:
                    probe.host_reads += 1
                    return original(self)
                return observe(op, original, self, (), {}, getframe(1))

            return wraps(original)(wrapper)

        #: What :func:`mask_in` can find a mask in.
        maybe_mask = (tensor_type, tuple)

        def getitem(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            # ``*rest`` (nothing: ``x[i]`` passes one index) keeps CPython from specialising ``x[i]`` into a
            # direct call of this function, which would pass by the slot a fetch points at torch's own code
            # (``_route_fetches``); ``x.__getitem__(i, j)`` still gets torch's own TypeError.
            def __getitem__(self: Any, index: Any, *rest: Any) -> Any:
                __tracebackhide__ = True
                if rest:
                    return original(self, index, *rest)
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (index,), {})
                # Only a tensor (or a tuple holding one) can be a mask: an int or a slice, as a dataset's
                # ``tensor[i]`` for every sample, costs one isinstance in a step, and nothing more outside.
                if (
                    flags.in_scope and isinstance(index, maybe_mask) and not is_compiling()
                    and _mask_or_none(mask_in, index) is not None
                ):
                    return observe(op, original, self, (index,), {}, getframe(1))
                return original(self, index)

            return wraps(original)(__getitem__)

        def setitem(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            def __setitem__(self: Any, index: Any, value: Any) -> None:
                __tracebackhide__ = True
                if type(self) is not tensor_type and dispatch.overrides(self):
                    dispatch.call(original, self, (index, value), {})
                    return
                if (
                    flags.in_scope and isinstance(index, maybe_mask) and not is_compiling()
                    and _mask_or_none(mask_in, index) is not None
                ):
                    observe(op, original, self, (index, value), {}, getframe(1))
                    return
                original(self, index, value)

            return wraps(original)(__setitem__)

        def function(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if args and not is_compiling() and flags.in_scope:
                    return observe(op, original, args[0], args[1:], kwargs, getframe(1))
                return original(*args, **kwargs)

            return wraps(original)(wrapper)

        def where(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                # Only the one-argument form synchronises; torch.where(c, a, b) is the cure and stays cheap.
                if len(args) == 1 and not kwargs and not is_compiling() and flags.in_scope:
                    return observe(op, original, args[0], (), {}, getframe(1))
                return original(*args, **kwargs)

            return wraps(original)(wrapper)

        for name, op in METHODS.items():
            if not hasattr(tensor_type, name):
                continue
            if name == "__getitem__":
                make = getitem
            elif name == "__setitem__":
                make = setitem
            elif name in _UNARY:
                make = unary
            else:
                make = method
            try:
                patcher.wrap(tensor_type, name, lambda original, op=op, make=make: make(op, original))  # type: ignore[misc]
            except SlotPatchUnsupported as exc:
                self.unavailable["mask_indexing"] = f"boolean-mask indexing is not watched here: {exc}"
        if "mask_indexing" not in self.unavailable:
            self._route_fetches(patcher, tensor_type)
        for name, op in FUNCTIONS.items():
            if getattr(torch, name, None) is not None:
                make_function = where if name == "where" else function
                patcher.wrap(torch, name, lambda original, op=op, make=make_function: make(op, original))  # type: ignore[misc]
        patcher.wrap(F, "one_hot", lambda original: function(ONE_HOT, original))

        def module_cpu(original: Callable[..., Any]) -> Callable[..., Any]:
            # ``module.cpu()`` of a module that never left the host copies nothing: no event for its tensors.
            def cpu(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                quiet = False
                if not is_compiling() and flags.in_scope:
                    try:
                        quiet = (
                            threading.get_ident() == probe.thread and not tensors.moved_module(self) and _on_host(self)
                        )
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                if not quiet:
                    return original(self, *args, **kwargs)
                probe.depth += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    probe.depth -= 1

            return wraps(original)(cpu)

        patcher.wrap(torch.nn.Module, "cpu", module_cpu)

        # Device-agnostic waits (``torch.get_device_module(device).synchronize()`` is ``torch.cpu``'s on a CPU):
        # they complete the pending device-to-host copies.
        for owner in (getattr(torch, "cpu", None), getattr(torch, "accelerator", None)):
            if callable(getattr(owner, "synchronize", None)):
                patcher.wrap(owner, "synchronize", self._clears_pending)
        if cuda_available:
            self._install_cuda(patcher, torch)

    def _clears_pending(self, original: Callable[..., Any]) -> Callable[..., Any]:
        probe = self

        def synchronize(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            probe.pending.clear()
            return original(*args, **kwargs)

        return wraps(original)(synchronize)

    def _route_fetches(self, patcher: Patcher, tensor_type: type) -> None:
        """While a DataLoader fetches samples outside the steps, ``tensor[i]`` goes straight to torch's C code.

        A mask outside a step is not counted, so the ``__getitem__`` patch has nothing to see there, and a
        ``TensorDataset`` indexes each of its tensors once per sample: the patch's call alone was a third of
        what a watched tiny Lightning fit paid. The slot is pointed back (:class:`~pytest_torchperf._slots.
        SlotRoute`) when the fetch ends, and the moment any step begins meanwhile (a step in another thread).
        """
        try:
            from torch.utils.data._utils import fetch as fetch_module

            route = _slots.SlotRoute(tensor_type, _slots.MP_SUBSCRIPT)
        except Exception:  # noqa: BLE001 - the patch then sees the fetches too, as it always did
            return
        if not route.live:
            return
        # This watch's route: the fetch wrapper, kept from watch to watch, reads it when called.
        self.route = route

        def close() -> None:
            route.close()
            if self.route is route:
                self.route = None

        patcher.callback(close)  # before the patch of ``__getitem__`` is undone
        flags = FLAGS
        listeners = FLAGS.listeners
        probe = self

        def wrap_fetch(original: Callable[..., Any]) -> Callable[..., Any]:
            def fetch(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                route = probe.route
                if flags.in_scope or route is None:
                    return original(self, *args, **kwargs)
                on_scope = route.on_scope
                listeners.append(on_scope)
                route.unpatched()
                try:
                    if flags.in_scope:  # a step began in another thread before the listener was there
                        route.patched(leaving=False)
                    return original(self, *args, **kwargs)
                finally:
                    route.patched()
                    try:
                        listeners.remove(on_scope)
                    except ValueError:  # pragma: no cover - already removed
                        pass

            return wraps(original)(fetch)

        for name in ("_MapDatasetFetcher", "_IterableDatasetFetcher"):
            fetcher = getattr(fetch_module, name, None)
            if fetcher is not None and callable(getattr(fetcher, "fetch", None)):
                patcher.wrap(fetcher, "fetch", wrap_fetch)

    def _install_cuda(self, patcher: Patcher, torch: Any) -> None:
        """On CUDA: count ``torch.cuda.synchronize()`` and listen to ``set_sync_debug_mode("warn")`` in steps."""
        probe = self
        cuda = torch.cuda
        is_compiling = self.tensors.compiling

        def synchronize_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            def synchronize(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                probe.synchronised()
                if FLAGS.in_scope and not is_compiling() and probe.depth == 0:
                    try:
                        probe.cuda_event(SYNCHRONIZE, caller_frame())
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                    probe.depth += 1
                    try:
                        return original(*args, **kwargs)
                    finally:
                        probe.depth -= 1
                return original(*args, **kwargs)

            return wraps(original)(synchronize)

        patcher.wrap(cuda, "synchronize", synchronize_wrapper)
        for owner in (cuda.Stream, cuda.Event):
            patcher.wrap(owner, "synchronize", self._clears_pending)

        previous: list[Any] = []

        def on_scope(in_scope: bool) -> None:
            try:
                if in_scope and not probe.disabled:
                    if cuda.is_initialized() and not previous:
                        previous.append(cuda.get_sync_debug_mode())
                        cuda.set_sync_debug_mode("warn")
                elif previous:
                    cuda.set_sync_debug_mode(previous.pop())
            except Exception:  # noqa: BLE001 - a broken CUDA context must not break the step
                previous.clear()

        def restore() -> None:
            if previous:
                cuda.set_sync_debug_mode(previous.pop())

        FLAGS.listeners.append(on_scope)
        patcher.callback(
            lambda: FLAGS.listeners.remove(on_scope) if on_scope in FLAGS.listeners else None, deferred=True
        )
        patcher.callback(restore)

        # The warning is issued at the Python line that made the CUDA call: take it from
        # the display hook, record it, and keep it out of the user's warnings summary.
        warnings.filterwarnings("always", message=_SYNC_WARNING.pattern, category=UserWarning)
        entry = warnings.filters[0]

        def remove_filter() -> None:
            if entry in warnings.filters:
                warnings.filters.remove(entry)  # type: ignore[attr-defined]
                mutated = getattr(warnings, "_filters_mutated", None)
                if mutated is not None:
                    mutated()

        patcher.callback(remove_filter)

        def show_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
            def _showwarnmsg(msg: Any) -> Any:
                if isinstance(msg.message, UserWarning) and _SYNC_WARNING.search(str(msg.message)):
                    try:
                        if FLAGS.in_scope:
                            if probe.current is not None:
                                if not probe.confirmed:
                                    probe.confirmed = True
                                    for record in probe.current:
                                        record.confirmed += 1
                            else:
                                probe.cuda_event(CUDA_REPORTED, caller_frame())
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                    return None
                return original(msg)

            return _showwarnmsg

        if hasattr(warnings, "_showwarnmsg"):
            patcher.wrap(warnings, "_showwarnmsg", show_wrapper)


def _on_host(module: Any) -> bool:
    """Every parameter and buffer of ``module`` is on the CPU."""
    for tensor in module.parameters():
        if tensor.device.type != "cpu":
            return False
    for tensor in module.buffers():
        if tensor.device.type != "cpu":
            return False
    return True


def _mask_or_none(mask_in: Callable[[Any], Any], index: Any) -> Any:
    try:
        return mask_in(index)
    except Exception:  # noqa: BLE001 - an index torchperf does not understand is not a mask
        return None


def _check_failed(handler: Callable[..., Any], exc: BaseException) -> None:
    check = getattr(handler, "__self__", None)
    name = getattr(check, "name", "?")
    for run in core.active_runs():
        if run.checks.get(name) is check:
            run.check_failed(name, exc)
