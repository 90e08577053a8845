"""Invariant ``no_host_sync``: no GPU->CPU synchronisation inside the step, caught on CPU-only CI too.

An ``.item()`` in a training step makes the CPU wait until the GPU has run
every kernel queued so far, every step; so do ``float(t)``, ``if t > x:``, an
f-string or ``print`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``
and every operation whose output size depends on the data (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing...). On a CPU there is
nothing to wait for, so ``torch.cuda.set_sync_debug_mode`` cannot see them.

The probe patches, while a run is active, only the operations of interest:
the Tensor methods in :data:`METHODS` and the ``torch`` functions in
:data:`FUNCTIONS` (a Python wrapper on a few methods costs about 1% of a small
step; intercepting every torch call with a ``TorchFunctionMode`` costs
30-90%). Outside a step a wrapper does one attribute load and calls through.
Inside a step (``Run.in_scope``) an operation is an event when the tensor it
reads is one that lives on the accelerator:

- a tensor on a non-CPU device really synchronises;
- on a CPU-only machine, a CPU tensor *would* synchronise on an accelerator,
  unless it is a host tensor by construction (made by a factory without
  ``device=``, the result of ``.cpu()``, an optimizer's ``step`` counter: see
  :mod:`._tensors`); those are counted apart and never fail;
- on a machine where CUDA is in use, a CPU tensor is a host tensor: the
  verdict follows the device the tensor is really on.

Each event is attributed to the innermost frame outside torch (the user's
line, or Lightning's when Lightning made it) and counted per step. An
operation made inside another one (``print`` reading the values with
``.item()``) counts once. On CUDA, ``torch.cuda.set_sync_debug_mode("warn")``
is switched on inside steps and restored outside them; its warnings confirm
the events above and add the synchronising operations no wrapper sees
(blocking copies, ``index_put_`` with a mask...), at their lines.
"""

from __future__ import annotations

import functools
import os
import re
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import USER, Frame, Stack
from ..watch import FLAGS, active_runs
from . import _tensors
from ._tensors import (
    AllowList,
    Located,
    clean_result,
    describe_frame,
    frequency,
    locate,
    over_budget,
    owner_label,
    stack_cache,
    unit_of,
    units_total,
)

if TYPE_CHECKING:
    from ..patching import Patcher
    from ..watch import Run

NAME = "no_host_sync"

# -- what is caught, and what to do instead -------------------------------------------------

_HINTS = {
    "value": (
        "keep the value on the device: pass the tensor itself to `self.log(...)` (Lightning reduces it "
        "without waiting), accumulate with tensor ops, and read it with `.item()` only every N steps or "
        "at epoch end (then list that site in allowed_syncs)"
    ),
    "host": (
        "keep the values on the device and accumulate them with torch ops or a torchmetrics metric; "
        "copy them to the host once at epoch end, not every step"
    ),
    "branch": (
        "a Python `if`/`while`/`assert`/`and`/`or` on a tensor makes the CPU wait for the GPU: compute "
        "both outcomes with `torch.where(cond, a, b)` (or multiply by the mask), or move the check out "
        "of the step"
    ),
    "print": (
        "printing or formatting a tensor copies it to the host: log the tensor with `self.log(...)`, "
        "or print only every N steps"
    ),
    "shape": (
        "the output size depends on the values, so the CPU must wait for the GPU to learn it: keep shapes "
        "static with `torch.where(mask, x, 0)`, `x * mask` or `x.masked_fill(~mask, 0)` and a masked "
        "sum/mean"
    ),
    "unique": (
        "`unique` has a data-dependent size: for class ids below a known N, count them with "
        "`torch.zeros(N, device=x.device).scatter_add_(0, x, torch.ones_like(x, dtype=torch.float))`"
    ),
    "bincount": (
        "`bincount` reads `x.max()` on the host to size its output: with a known N use "
        "`torch.zeros(N, device=x.device).scatter_add_(0, x, ...)` instead"
    ),
    "one_hot": "pass `num_classes=` to `F.one_hot` so it need not read `x.max()` on the host",
    "repeat": "pass `output_size=` to `repeat_interleave` so the output size need not be read from the device",
    "synchronize": (
        "an explicit `torch.cuda.synchronize()` stalls the pipeline every step: remove it, or keep it "
        "in timing code outside the watched scope"
    ),
    "cuda": (
        "torch.cuda.set_sync_debug_mode reported a synchronising CUDA operation at this line (a blocking "
        "copy, a data-dependent shape, a read of a device value)"
    ),
}


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

_SYNC_WARNING = re.compile(r"called a synchronizing CUDA operation")

#: Device verdicts for the tensor an operation reads, from "not an event" to "really synchronises".
_HOST = "host"
_WOULD = "cpu"  # a CPU tensor on a CPU-only machine: would synchronise on an accelerator


# -- per-run state and verdict ------------------------------------------------------------


class _SyncSite:
    """One operation at one line, as one run saw it."""

    def __init__(self, op: Op, located: Located, stack: Stack, allowed_by: Optional[str]) -> None:
        assert located.frame is not None
        self.op = op
        self.frame: Frame = describe_frame(located.frame)
        self.kind = located.kind
        self.via = located.via
        self.stack = stack
        self.allowed_by = allowed_by
        self.count = 0
        self.per_unit: dict[int, int] = {}
        self.outside = 0
        self.devices: set[str] = set()
        self.confirmed = 0

    def add(self, unit: Optional[int], device: str) -> None:
        self.count += 1
        if unit is None:
            self.outside += 1
        else:
            self.per_unit[unit] = self.per_unit.get(unit, 0) + 1
        self.devices.add(device)

    @property
    def is_user(self) -> bool:
        return self.kind == USER

    @property
    def would_only(self) -> bool:
        return self.devices == {_WOULD}

    def to_dict(self, total: int) -> dict[str, Any]:
        return {
            "operation": self.op.name,
            "label": self.op.label,
            "site": self.frame.location(),
            "function": self.frame.function,
            "source": self.frame.source,
            "code": "user" if self.is_user else self.kind,
            "via": self.via,
            "count": self.count,
            "steps_with_sync": len(self.per_unit),
            "per_step_max": max(self.per_unit.values()) if self.per_unit else 0,
            "outside_steps": self.outside,
            "frequency": frequency(self.per_unit, self.outside, total),
            "devices": sorted(self.devices),
            "cuda_confirmed": self.confirmed,
            "allowed_by": self.allowed_by,
        }


class HostSyncCheck:
    """Per-run state and verdict of ``no_host_sync``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.allow = AllowList(run.options.allowed_syncs)
        self.strict = run.options.fail_on_framework_syncs
        self._sites: dict[Any, _SyncSite] = {}
        self._host_reads_at_start = _State.host_reads
        self.error: Optional[str] = None

    # -- events from the probe ------------------------------------------------------
    def record(self, op: Op, located: Located, frame: Optional[FrameType], device: str) -> Optional[_SyncSite]:
        if located.frame is None:
            return None
        allowed_by = self.allow.match(located, frame) if self.allow else None
        key = (op.name, located.frame.f_code, located.frame.f_lineno, allowed_by)
        site = self._sites.get(key)
        if site is None:
            stack = stack_cache.get(key[:3], frame)
            site = self._sites[key] = _SyncSite(op, located, stack, allowed_by)
        site.add(unit_of(self.run), device)
        return site

    # -- verdict -----------------------------------------------------------------------
    def _finding(self, site: _SyncSite, total: int, note: str = "") -> Finding:
        freq = frequency(site.per_unit, site.outside, total)
        via = f" inside `{site.via}`" if site.via else ""
        title = f"{note}{site.op.label}{via} in {site.frame.function}: {freq}"
        facts = []
        if site.confirmed:
            facts.append(f"synchronised on {', '.join(sorted(site.devices - {_WOULD}))} "
                         f"(confirmed {site.confirmed}x by torch.cuda.set_sync_debug_mode)")
        elif site.would_only:
            facts.append("on this CPU-only run: would synchronise on an accelerator (the tensor is not one built on the host)")
        else:
            facts.append(f"synchronises on {', '.join(sorted(site.devices - {_WOULD}))}")
        if site.allowed_by:
            facts.append(f"accepted by allowed_syncs entry {site.allowed_by!r}")
        elif not site.is_user:
            owner = owner_label(site.frame)
            if self.strict:
                facts.append(f"made by {owner}, not by your code (failing because fail_on_framework_syncs=True)")
            else:
                facts.append(f"made by {owner}, not by your code: a note, not a failure (fail_on_framework_syncs=True fails on it)")
        label = site.op.label.split(" (")[0]
        failing = (site.is_user or self.strict) and not site.allowed_by
        hint = _HINTS[site.op.hint] if failing else ""
        # A note keeps its stack short: your frames that led there, and the frame that did it.
        stack = site.stack if failing else _short(site.stack)
        return Finding(title, facts, [Site(label, stack, site.count)], hint)

    def result(self) -> CheckResult:
        run = self.run
        total = units_total(run)
        sites = sorted(self._sites.values(), key=lambda s: -s.count)
        failing = [s for s in sites if not s.allowed_by and (s.is_user or self.strict)]
        noted = [s for s in sites if not s.allowed_by and not (s.is_user or self.strict)]
        allowed = [s for s in sites if s.allowed_by]
        user_count = sum(s.count for s in sites if s.is_user and not s.allowed_by)
        framework_count = sum(s.count for s in sites if not s.is_user and not s.allowed_by)
        allowed_count = sum(s.count for s in allowed)
        cuda_seen = any(s.devices - {_WOULD} for s in sites)
        figures: dict[str, Any] = {
            "scope": run.options.scope,
            "steps": total,
            "syncs": user_count,
            "sites": len([s for s in sites if s.is_user and not s.allowed_by]),
            "framework_syncs": framework_count,
            "allowed_syncs": allowed_count,
            "host_tensor_reads": _State.host_reads - self._host_reads_at_start,
            "mode": "device" if cuda_seen else "inferred on cpu",
            "events": [s.to_dict(total) for s in sites],
        }
        budget = run.options.max_syncs_per_step
        worst, over = over_budget((s.per_unit for s in failing), sum(s.outside for s in failing), budget)
        figures["worst_step_syncs"] = worst
        figures["max_syncs_per_step"] = budget
        findings = [self._finding(s, total) for s in failing]
        findings += [self._finding(s, total, "note: ") for s in noted]
        findings += [self._finding(s, total, "allowed: ") for s in allowed]
        steps = "step" if total == 1 else "steps"
        if self.error:
            return CheckResult(NAME, NOT_CHECKED, f"internal error: {self.error}", 0, findings, figures)
        if failing and not over:
            count = sum(s.count for s in failing)
            summary = (
                f"{count} sync{'s' if count != 1 else ''} in your code, at most {worst} in a step: "
                f"within max_syncs_per_step={budget}"
            )
            return CheckResult(NAME, PASSED, summary, 0, findings, figures)
        if failing:
            count = sum(s.count for s in failing)
            noun = "sync" if count == 1 else "syncs"
            if len(failing) == 1:
                s = failing[0]
                where = f"at {s.frame.location()}" + ("" if s.is_user else f" ({owner_label(s.frame)})")
                summary = f"{count} {noun} {where}: {frequency(s.per_unit, s.outside, total)}"
            else:
                where = "in your code" if all(s.is_user for s in failing) else "in your code and libraries"
                summary = f"{count} {noun} at {len(failing)} sites {where} over {total} {steps}"
            if budget is not None:
                summary += f"; {worst} in one step, max_syncs_per_step={budget}"
            return CheckResult(NAME, FAILED, summary, count, findings, figures)
        extras = []
        if framework_count:
            owners = sorted({owner_label(s.frame) for s in noted})
            extras.append(f"{framework_count} in {', '.join(owners)} (noted)")
        if allowed_count:
            extras.append(f"{allowed_count} allowed")
        passed = f"no sync in your code over {total} {steps}"
        return clean_result(NAME, run, total, bool(sites), passed, extras, findings, figures)


def _short(stack: Stack) -> Stack:
    """Your frames and the innermost one: enough to see which of your calls led to a library's sync."""
    return tuple(f for i, f in enumerate(stack) if f.is_user or i == len(stack) - 1)


# -- probe ----------------------------------------------------------------------------------


class _State:
    """Probe state shared by the wrappers (one watched thread at a time)."""

    depth = 0
    #: Sites of the event being executed (the CUDA warning that follows confirms them).
    current: Optional[list[_SyncSite]] = None
    confirmed = False
    #: ``(weakref to the result, site key)`` of the last ``.cpu()`` event: reads chained on it at the
    #: same line (``x.cpu().numpy()``) are the same copy, counted once.
    chain: Optional[tuple[Any, Any]] = None
    thread: Optional[int] = None
    pid: Optional[int] = None
    #: Reads of host tensors inside steps: not syncs, counted for the report.
    host_reads = 0


def _checks() -> list[HostSyncCheck]:
    out = []
    for run in active_runs():
        if run.in_scope:
            check = run.checks.get(NAME)
            if check is not None:
                out.append(check)  # type: ignore[arg-type]
    return out


def install(patcher: "Patcher") -> None:
    """Patch the synchronising operations for the active runs; undone by ``patcher``."""
    import torch
    import torch.nn.functional as F

    tensor_type = torch.Tensor
    flags = FLAGS
    is_compiling = _tensors._compiling[0]
    getframe = sys._getframe
    state = _State
    state.depth, state.current, state.chain = 0, None, None
    state.thread, state.pid = threading.get_ident(), os.getpid()
    masks = (torch.bool, torch.uint8)
    cuda_available = torch.cuda.is_available()

    def device_of(t: Any) -> Optional[str]:
        """The verdict for one tensor an operation reads."""
        if not isinstance(t, tensor_type):
            return None
        device = t.device
        kind = device.type
        if kind == "cpu":
            if _tensors.is_host_tensor(t):
                return _HOST
            if cuda_available and torch.cuda.is_initialized():
                return _HOST
            return _WOULD
        if kind == "meta":
            return None
        return str(device)

    def worst(*tensors: Any) -> Optional[str]:
        verdict = None
        for t in tensors:
            v = device_of(t)
            if v is None:
                continue
            if v not in (_HOST, _WOULD):
                return v
            if v == _WOULD or verdict is None:
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
            if value.numel() == 1 and device_of(value) == _HOST:
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
        if op == "__contains__":
            return worst(this)
        return worst(this)

    def observe(op: Op, original: Callable[..., Any], this: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any], frame: Optional[FrameType]) -> Any:
        if state.depth or threading.get_ident() != state.thread or os.getpid() != state.pid:
            return original(this, *args, **kwargs)
        device = verdict(op.name, this, args, kwargs)
        if device is None:
            return original(this, *args, **kwargs)
        if device == _HOST:
            state.host_reads += 1
            return original(this, *args, **kwargs)
        checks = _checks()
        if not checks:
            return original(this, *args, **kwargs)
        located = locate(frame)
        if state.chain is not None and state.chain[0]() is this and state.chain[1] == located.key:
            return original(this, *args, **kwargs)  # x.cpu().numpy(): one copy, counted at .cpu()
        sites = []
        for check in checks:
            try:
                site = check.record(op, located, frame, device)
            except Exception as exc:  # never break the user's step; the report says what happened
                check.error = check.error or f"{type(exc).__name__}: {exc}"
                continue
            if site is not None:
                sites.append(site)
        state.depth += 1
        previous, state.current, state.confirmed = state.current, sites, False
        try:
            out = original(this, *args, **kwargs)
        finally:
            state.depth -= 1
            state.current = previous
        if op.name == "cpu":
            if out is not this and isinstance(out, tensor_type):
                _tensors.mark_host(out)
            try:
                state.chain = (weakref.ref(out), located.key)
            except TypeError:  # pragma: no cover
                state.chain = None
        return out

    def method(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if not is_compiling() and flags.in_scope:
                return observe(op, original, self, args, kwargs, getframe(1))
            return original(self, *args, **kwargs)

        return functools.wraps(original)(wrapper)

    host_get = _tensors._host.get

    def unary(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any) -> Any:
            __tracebackhide__ = True
            if is_compiling() or not flags.in_scope:
                return original(self)
            # Fast path for the most common read inside a step: a host tensor (an optimizer's step
            # counter read with .item() once per parameter per step).
            ref = host_get(id(self))
            if ref is not None and ref() is self:
                state.host_reads += 1
                return original(self)
            return observe(op, original, self, (), {}, getframe(1))

        return functools.wraps(original)(wrapper)

    def getitem(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def __getitem__(self: Any, index: Any) -> Any:
            __tracebackhide__ = True
            if not is_compiling() and flags.in_scope and mask_in(index) is not None:
                return observe(op, original, self, (index,), {}, getframe(1))
            return original(self, index)

        return functools.wraps(original)(__getitem__)

    def setitem(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def __setitem__(self: Any, index: Any, value: Any) -> None:
            __tracebackhide__ = True
            if not is_compiling() and flags.in_scope and mask_in(index) is not None:
                observe(op, original, self, (index, value), {}, getframe(1))
                return
            original(self, index, value)

        return functools.wraps(original)(__setitem__)

    def function(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if not is_compiling() and flags.in_scope and args:
                return observe(op, original, args[0], args[1:], kwargs, getframe(1))
            return original(*args, **kwargs)

        return functools.wraps(original)(wrapper)

    def where(op: Op, original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            # Only the one-argument form synchronises; torch.where(c, a, b) is the cure and stays cheap.
            if len(args) == 1 and not kwargs and not is_compiling() and flags.in_scope:
                return observe(op, original, args[0], (), {}, getframe(1))
            return original(*args, **kwargs)

        return functools.wraps(original)(wrapper)

    unary_ops = {"item", "__float__", "__int__", "__complex__", "__index__", "__bool__", "tolist"}
    for name, op in METHODS.items():
        if name not in vars(tensor_type) and not hasattr(tensor_type, name):
            continue
        if name == "__getitem__":
            make = getitem
        elif name == "__setitem__":
            make = setitem
        elif name in unary_ops:
            make = unary
        else:
            make = method
        patcher.wrap(tensor_type, name, lambda original, op=op, make=make: make(op, original))
    for name, op in FUNCTIONS.items():
        if getattr(torch, name, None) is not None:
            make_function = where if name == "where" else function
            patcher.wrap(torch, name, lambda original, op=op, make=make_function: make(op, original))
    patcher.wrap(F, "one_hot", lambda original: function(ONE_HOT, original))

    if cuda_available:
        _install_cuda(patcher, torch)


def _install_cuda(patcher: "Patcher", torch: Any) -> None:
    """On CUDA: count ``torch.cuda.synchronize()`` and listen to ``set_sync_debug_mode("warn")`` inside steps."""
    state = _State
    cuda = torch.cuda

    def synchronize_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if FLAGS.in_scope and not _tensors.compiling() and state.depth == 0:
                _on_cuda_event(SYNCHRONIZE, sys._getframe(1), "cuda")
                state.depth += 1
                try:
                    return original(*args, **kwargs)
                finally:
                    state.depth -= 1
            return original(*args, **kwargs)

        return functools.wraps(original)(synchronize)

    patcher.wrap(cuda, "synchronize", synchronize_wrapper)

    previous: list[Any] = []

    def on_scope(in_scope: bool) -> None:
        try:
            if in_scope:
                if cuda.is_initialized() and not previous:
                    previous.append(cuda.get_sync_debug_mode())
                    cuda.set_sync_debug_mode("warn")
            elif previous:
                cuda.set_sync_debug_mode(previous.pop())
        except Exception:  # pragma: no cover - a broken CUDA context must not break the step
            previous.clear()

    def restore() -> None:
        if previous:
            cuda.set_sync_debug_mode(previous.pop())

    FLAGS.listeners.append(on_scope)
    patcher.callback(lambda: FLAGS.listeners.remove(on_scope) if on_scope in FLAGS.listeners else None)
    patcher.callback(restore)

    # The warning is issued at the Python line that made the CUDA call: take it from
    # the display hook, record it, and keep it out of the user's warnings summary.
    warnings.filterwarnings("always", message=_SYNC_WARNING.pattern, category=UserWarning)
    entry = warnings.filters[0]

    def remove_filter() -> None:
        if entry in warnings.filters:
            warnings.filters.remove(entry)
            mutated = getattr(warnings, "_filters_mutated", None)
            if mutated is not None:
                mutated()

    patcher.callback(remove_filter)

    def show_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
        def _showwarnmsg(msg: Any) -> Any:
            if isinstance(msg.message, UserWarning) and _SYNC_WARNING.search(str(msg.message)):
                if FLAGS.in_scope:
                    if state.current is not None:
                        if not state.confirmed:
                            state.confirmed = True
                            for site in state.current:
                                site.confirmed += 1
                    else:
                        _on_cuda_event(CUDA_REPORTED, sys._getframe(1), "cuda")
                return None
            return original(msg)

        return _showwarnmsg

    if hasattr(warnings, "_showwarnmsg"):
        patcher.wrap(warnings, "_showwarnmsg", show_wrapper)


def _on_cuda_event(op: Op, frame: Optional[FrameType], device: str) -> None:
    if threading.get_ident() != _State.thread:
        return
    located = locate(frame)
    for check in _checks():
        site = check.record(op, located, frame, device)
        if site is not None:
            site.confirmed += 1
