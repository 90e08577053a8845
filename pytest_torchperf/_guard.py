"""The engine's guard: a probe's wrapper never raises its own error into the user's call.

Every wrapper a probe installs through its :class:`~pytest_torchperf.patching.Patcher`
is put inside :func:`contain` by the patcher itself (the engine gives each probe's
patcher the probe's failure handler), so no probe has to remember a ``try``. What
the wrapper does beyond calling the original is the probe's: when it raises, the
guard hands the error to the engine (which takes the probe out and makes its
invariants "not checked" with the error) and finishes the user's call as if
nothing watched it: the original's result when it had already returned, else the
original called now. An exception the original itself raised is the user's and
goes up untouched.

Which of the two an exception is, is read from its traceback, only when one is
raised: the innermost frame that holds the original (the wrapper, or a helper it
passed the original to) was calling it, or was doing something else. A frame
that holds the original's result names it ``out`` (the convention every wrapper
follows); that is what the guard returns when the probe failed after it.
"""

from __future__ import annotations

import linecache
import sys
from types import CodeType, FrameType, TracebackType
from typing import Any, Callable, Optional

__all__ = ["caller_frame", "contain"]

_NOTHING = object()


def contain(wrapper: Callable[..., Any], original: Any, failed: Callable[[BaseException], None]) -> Callable[..., Any]:
    """``wrapper`` with its own errors handed to ``failed`` and the user's call finished (see the module)."""

    def recover(exc: Exception, call: Callable[[], Any]) -> Any:
        try:
            out = _outcome(exc, original)
        except Exception:  # noqa: BLE001 - cannot tell: the error goes up as it came, the original not called twice
            out = _RAISE
        if out is _RAISE:
            raise exc
        failed(exc)
        return call() if out is _NOTHING else out

    code = getattr(wrapper, "__code__", None)
    arity = _plain_arity(code)
    # One template per shape: a unary method (``Tensor.item``) is called without packing its argument.
    if arity == 1:

        def guarded1(self: Any) -> Any:
            __tracebackhide__ = True
            try:
                return wrapper(self)
            except Exception as exc:  # noqa: BLE001 - see recover()
                return recover(exc, lambda: original(self))

        guarded: Callable[..., Any] = guarded1
    elif arity == 2:

        def guarded2(self: Any, other: Any) -> Any:
            __tracebackhide__ = True
            try:
                return wrapper(self, other)
            except Exception as exc:  # noqa: BLE001 - see recover()
                return recover(exc, lambda: original(self, other))

        guarded = guarded2
    else:

        def guarded_any(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            try:
                return wrapper(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - see recover()
                return recover(exc, lambda: original(*args, **kwargs))

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


#: The code of the guard's own frames (one sits between a contained wrapper and its caller).
_GUARD_CODES: frozenset[CodeType] = frozenset()


def caller_frame(depth: int = 1) -> FrameType:
    """``sys._getframe(depth)`` as seen from the caller, past the guard's frame: a wrapper's caller is the user.

    Wrappers read the line that called them (``getframe(1)``); the guard that contains them is one frame more
    between the two, which this skips, so a wrapper reads the same frame guarded or not.
    """
    frame = sys._getframe(depth + 1)
    if frame.f_code in _GUARD_CODES:
        back = frame.f_back
        if back is not None:
            return back
    return frame


_RAISE = object()


def _plain_arity(code: Optional[CodeType]) -> int:
    """The number of positional parameters of a function with nothing else (no defaults read here): 0 if other."""
    if code is None:
        return 0
    if code.co_flags & 0x0C or code.co_kwonlyargcount:  # *args, **kwargs, keyword-only
        return 0
    return code.co_argcount if code.co_argcount in (1, 2) else 0


def _outcome(exc: BaseException, original: Any) -> Any:
    """``_RAISE`` when the original raised ``exc``; else the original's result (``_NOTHING``: not called yet)."""
    tb: Optional[TracebackType] = exc.__traceback__
    holder: Optional[TracebackType] = None
    names: tuple[str, ...] = ()
    while tb is not None:
        held = _names_of(tb.tb_frame.f_locals, original)
        if held:
            holder, names = tb, held
        tb = tb.tb_next
    if holder is None:  # pragma: no cover - the wrapper always holds its original
        return _NOTHING
    if _calls(holder.tb_frame.f_code, holder.tb_lasti, holder.tb_lineno, names):
        return _RAISE
    return holder.tb_frame.f_locals.get("out", _NOTHING)


def _names_of(local: dict[str, Any], original: Any) -> tuple[str, ...]:
    try:
        return tuple(name for name, value in local.items() if value is original)
    except Exception:  # noqa: BLE001 - a strange local is not the original
        return ()


_SPANS: dict[tuple[CodeType, int], str] = {}


def _calls(code: CodeType, lasti: int, lineno: int, names: tuple[str, ...]) -> bool:
    """Whether the instruction at ``lasti`` of ``code`` is a call of one of ``names`` (``original(...)``)."""
    span = _SPANS.get((code, lasti))
    if span is None:
        span = _span(code, lasti, lineno)
        if len(_SPANS) > 1000:
            _SPANS.clear()
        _SPANS[(code, lasti)] = span
    span = span.lstrip()
    for name in names:
        if span.startswith(name + "(") or f"({name}," in span.replace(" ", ""):
            return True
    return False


def _span(code: CodeType, lasti: int, lineno: int) -> str:
    """The source text of the expression the instruction at ``lasti`` executes (the line before Python 3.11)."""
    lines = linecache.getlines(code.co_filename)
    positions = getattr(code, "co_positions", None)
    if positions is not None and sys.version_info >= (3, 11):
        for index, (start, end, col, end_col) in enumerate(positions()):
            if index * 2 != lasti:
                continue
            if start is None or end is None or col is None or end_col is None or start > len(lines):
                break
            if start == end:
                return lines[start - 1][col:end_col]
            text = lines[start - 1][col:] + "".join(lines[start:end - 1]) + lines[end - 1][:end_col]
            return text
    return lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""


def _guard_codes() -> frozenset[CodeType]:
    codes = set()
    for wrapper in (lambda a: a, lambda a, b: a, lambda *a, **k: a):
        codes.add(contain(wrapper, wrapper, lambda exc: None).__code__)
    return frozenset(codes)


_GUARD_CODES = _guard_codes()
