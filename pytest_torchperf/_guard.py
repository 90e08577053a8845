"""The engine's guard: a probe's wrapper never raises its own error into the user's call.

Every wrapper a probe installs through its :class:`~pytest_torchperf.patching.Patcher`
is contained here by the patcher itself (the engine gives each probe's patcher the
probe's failure handler), so no probe has to remember a ``try``.

The wrapper is built around a *tracked* original (:func:`contain` hands it to the
probe's maker in place of the original): a small function that calls the real
original and writes, on this thread's record of the guarded call in progress,
what it returned, or the exception it raised. The guard keeps one record per call:
it saves the record of the call it runs inside (a guarded call the original makes,
a recursion), starts its own, and puts the saved one back when it ends, so each
thread holds a stack of records, one per guarded call open on it.

When the wrapper raises, the record says whose exception it is:

- the very exception the original raised: the user's; it goes up untouched;
- any other: the probe's. The guard hands it to the engine (which takes the probe
  out and makes its invariants "not checked" with the error) and finishes the
  user's call as if nothing watched it: the original's recorded result if it
  returned, its recorded exception if it raised, else the original called now.
"""

from __future__ import annotations

import functools
import sys
import threading
from types import CodeType, FrameType
from typing import Any, Callable, Optional

__all__ = ["caller_frame", "contain", "handing_over"]


class _NotRun:
    """The record of a guarded call whose original has not returned yet."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<the original has not run>"


NOT_RUN: Any = _NotRun()


class _Raised:
    """The record of a guarded call whose original raised ``exc``."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc: Optional[BaseException] = exc  # None once the guard has raised it (see _finish)


class _Calls(threading.local):
    """This thread's record of the innermost guarded call: ``NOT_RUN``, a :class:`_Raised`, or the result."""

    record: Any = NOT_RUN


_CALLS = _Calls()


def tracked(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original``, recording on this thread's record of the guarded call what it returned or raised."""
    calls = _CALLS

    def track(*args: Any, **kwargs: Any) -> Any:
        try:
            out = original(*args, **kwargs)
        except BaseException as exc:
            __tracebackhide__ = True
            calls.record = _Raised(exc)
            raise
        calls.record = out
        return out

    for name in ("__name__", "__qualname__", "__doc__"):  # a probe may read them off its original
        value = getattr(original, name, None)
        if isinstance(value, str):
            setattr(track, name, value)
    track.__wrapped__ = track.__torchperf_original__ = original  # type: ignore[attr-defined]
    return track


def original_of(fn: Any) -> Any:
    """The real original behind a tracked one (``fn`` itself when it is not tracked)."""
    return getattr(fn, "__torchperf_original__", fn) if type(fn) is _FUNCTION else fn


def handing_over(original: Any, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call(original, *args, **kwargs)`` with the real original, recorded as a call of the original.

    For a wrapper that hands its original to torch rather than calling it (``handle_torch_function``
    for a tensor subclass): torch and the subclass see torch's own function, and what happens in
    there (the subclass's own error) is the user's call.
    """
    real = original_of(original)
    if real is original:
        return call(original, *args, **kwargs)
    return tracked(functools.partial(call, real))(*args, **kwargs)


def contain(make: Callable[[Any], Any], original: Any, failed: Callable[[BaseException], None]) -> Any:
    """``make(original)`` built around the tracked original, with its own errors handed to ``failed`` and
    the user's call finished (see the module)."""
    wrapper = make(tracked(original))
    if not callable(wrapper):
        return wrapper
    if original_of(wrapper) is original:  # the maker handed the original back: nothing to contain
        return original
    calls = _CALLS
    arity = _plain_arity(getattr(wrapper, "__code__", None))
    # One template per shape: a unary method (``Tensor.item``) is called without packing its argument.
    if arity == 1:

        def guarded1(self: Any) -> Any:
            outer = calls.record
            calls.record = NOT_RUN
            try:
                return wrapper(self)
            except Exception as exc:  # noqa: BLE001 - see the module
                __tracebackhide__ = True
                record = calls.record
                if type(record) is _Raised and record.exc is exc:  # the original's: the user's error
                    record = None  # see _finish: no cycle through this frame
                    raise
                failed(exc)
            finally:
                calls.record = outer
            return _finish(record, original, (self,), {})

        guarded: Callable[..., Any] = guarded1
    elif arity == 2:

        def guarded2(self: Any, other: Any) -> Any:
            outer = calls.record
            calls.record = NOT_RUN
            try:
                return wrapper(self, other)
            except Exception as exc:  # noqa: BLE001 - see the module
                __tracebackhide__ = True
                record = calls.record
                if type(record) is _Raised and record.exc is exc:  # the original's: the user's error
                    record = None  # see _finish: no cycle through this frame
                    raise
                failed(exc)
            finally:
                calls.record = outer
            return _finish(record, original, (self, other), {})

        guarded = guarded2
    else:

        def guarded_any(*args: Any, **kwargs: Any) -> Any:
            outer = calls.record
            calls.record = NOT_RUN
            try:
                return wrapper(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - see the module
                __tracebackhide__ = True
                record = calls.record
                if type(record) is _Raised and record.exc is exc:  # the original's: the user's error
                    record = None  # see _finish: no cycle through this frame
                    raise
                failed(exc)
            finally:
                calls.record = outer
            return _finish(record, original, args, kwargs)

        guarded = guarded_any
    for name in ("__module__", "__name__", "__qualname__", "__doc__", "__wrapped__"):
        try:
            setattr(guarded, name, getattr(wrapper, name))
        except AttributeError:
            pass
    try:
        guarded.__dict__.update(getattr(wrapper, "__dict__", {}))
    except (AttributeError, TypeError):  # pragma: no cover
        pass
    guarded.__torchperf_guarded__ = wrapper  # type: ignore[attr-defined]
    return guarded


def _finish(record: Any, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The user's call after the probe failed, as unwatched: the original's result, or its error, or a call."""
    __tracebackhide__ = True
    if record is NOT_RUN:
        return original(*args, **kwargs)
    if type(record) is _Raised:
        # Outside any ``except``: the error keeps the context it had, not the probe's error. No frame of ours
        # may keep it in a local as it goes: its traceback holds these frames, and a frame holding it back
        # makes a cycle that keeps the call's arguments (a DataLoader iterator at its StopIteration) alive
        # until the garbage collector runs, instead of freeing them when the user's code lets go.
        exc, record.exc = record.exc, None
        try:
            raise exc  # type: ignore[misc]  # never None: a record is raised once
        finally:
            exc = None
    return record


def _plain_arity(code: Optional[CodeType]) -> int:
    """The number of positional parameters of a function with nothing else (no defaults read here): 0 if other."""
    if code is None:
        return 0
    if code.co_flags & 0x0C or code.co_kwonlyargcount:  # *args, **kwargs, keyword-only
        return 0
    return code.co_argcount if code.co_argcount in (1, 2) else 0


def caller_frame(depth: int = 1) -> FrameType:
    """``sys._getframe(depth)`` as seen from the caller, past the guard's frame: a wrapper's caller is the user.

    Wrappers read the line that called them (``getframe(1)``); the guard that contains them is one frame more
    between the two, which this skips, so a wrapper reads the same frame guarded or not. (The tracked
    original's frame is below the wrapper, never between it and its caller.)
    """
    frame = _getframe(depth + 1)
    return frame.f_back if frame.f_code in _GUARD_CODES else frame  # type: ignore[return-value]


_getframe = sys._getframe
_FUNCTION = type(tracked)


def _guard_codes() -> frozenset[CodeType]:
    """The code of the guard's own frames (one sits between a contained wrapper and its caller)."""
    def unary(a: Any) -> Any:
        return a

    def binary(a: Any, b: Any) -> Any:
        return a

    def any_shape(*a: Any, **k: Any) -> Any:
        return a

    codes = set()
    for wrapper in (unary, binary, any_shape):
        codes.add(contain(functools.partial(lambda w, original: w, wrapper), len, print).__code__)
    return frozenset(codes)


_GUARD_CODES = _guard_codes()
