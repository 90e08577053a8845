"""Locating an event: the innermost frame outside torch, who called, the stack, whose code it is.

Probes call :func:`locate` on every event they report, so it is cheap: a few
``f_back`` hops and a cached classification per file (:mod:`.stacks`). The full
stack (:func:`stack_of`) is only captured the first time a site is seen.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import CodeType, FrameType
from typing import Any, Optional

from . import stacks
from .stacks import LAUNCHER, LIBRARY, PYTEST, STDLIB, TORCH, TORCHPERF, USER, Frame, Stack

__all__ = ["Located", "StackCache", "caller", "describe_frame", "kind_of", "locate", "owner_label", "stack_of"]

_SKIP_FOR_CALLER = frozenset((TORCHPERF, STDLIB, PYTEST, LAUNCHER))
_SKIP_FOR_SITE = frozenset((TORCHPERF, TORCH, STDLIB, PYTEST, LAUNCHER))
#: Torch functions that only wrap another one (decorators, dispatch helpers): never named as "via".
_WRAPPER_NAMES = frozenset(("decorate_context", "wrapper", "wrapped", "inner", "fn", "_fn", "forward", "__call__"))
#: Code torch generates at run time (``torch.fx`` graphs run by torch.compile's eager backend): torch's own.
_GENERATED = "<eval_with_key>"


def kind_of(code: CodeType) -> str:
    """The frame kind of ``code`` (see :mod:`pytest_torchperf.stacks`); cached per file name."""
    filename = code.co_filename
    if filename.startswith(_GENERATED):
        return TORCH
    return stacks.classify(filename)


@dataclass(frozen=True)
class Located:
    """Where an event happened, found by walking ``f_back`` from the frame that triggered it."""

    #: The innermost frame outside torch, the standard library, pytest and torchperf (None: none).
    frame: Optional[FrameType]
    #: That frame's kind: user, framework or library.
    kind: str
    #: The kind of the innermost frame outside the standard library, pytest and torchperf:
    #: ``torch`` when torch's own Python code made the call on the site's behalf.
    caller_kind: str
    #: The torch function the site called into, when the event happened inside it (or the library's
    #: function, with :attr:`library`).
    via: Optional[str]
    #: The event happened in a library the user's line (the site) called: a metric's ``update``.
    library: bool = False

    @property
    def key(self) -> Optional[tuple[CodeType, int]]:
        if self.frame is None:
            return None
        return (self.frame.f_code, self.frame.f_lineno)


def locate(frame: Optional[FrameType]) -> Located:
    """Locate the event whose innermost Python frame is ``frame`` (cheap: a few ``f_back`` hops)."""
    caller_kind: Optional[str] = None
    via: Optional[str] = None
    f = frame
    while f is not None:
        code = f.f_code
        kind = kind_of(code)
        if kind in _SKIP_FOR_SITE:
            if kind == TORCH:
                if caller_kind is None:
                    caller_kind = TORCH
                name = code.co_name
                if not name.startswith("_") and name not in _WRAPPER_NAMES:
                    via = name  # keeps the outermost: the torch function the site called
            f = f.f_back
            continue
        if kind == LIBRARY:
            called = _called_by_user(f)
            if called is not None:
                user, entry = called
                return Located(user, USER, caller_kind or kind, entry, True)
        return Located(f, kind, caller_kind or kind, via if caller_kind == TORCH else None)
    return Located(None, TORCH, caller_kind or TORCH, via)


#: Library functions that were running when a run's first automatic step began: they drive the training loop
#: (a library's ``Trainer.run()``), and their own events stay theirs. Set by :mod:`.autosteps`.
DRIVERS: set[CodeType] = set()


def note_drivers(frame: Optional[FrameType]) -> None:
    """Remember the library functions on the stack at ``frame`` (a training step begins there)."""
    f = frame
    while f is not None:
        if kind_of(f.f_code) == LIBRARY:
            DRIVERS.add(f.f_code)
        f = f.f_back


def _called_by_user(frame: FrameType) -> Optional[tuple[FrameType, str]]:
    """``(the user's frame, the library function it called)`` when the library code at ``frame`` was called by
    the user's own code (a metric's ``update`` called from the user's step): the user's calling line is where
    that is fixed. None when a training framework called it (the framework's own work stays the framework's)."""
    if frame.f_code in DRIVERS:
        return None
    entry = frame
    f = frame.f_back
    while f is not None:
        kind = kind_of(f.f_code)
        if kind == USER:
            label = getattr(entry.f_code, "co_qualname", entry.f_code.co_name)
            package = str(entry.f_globals.get("__name__", "")).split(".")[0]
            return f, f"{package}'s {label}" if package else label
        if kind in (LIBRARY, TORCH) or kind in _SKIP_FOR_CALLER:
            if kind == LIBRARY:
                if f.f_code in DRIVERS:
                    return None  # the library that drives the loop
                entry = f
            f = f.f_back
            continue
        return None  # a training framework called it
    return None


def caller(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame outside the standard library, pytest and torchperf: who made the call."""
    f = frame
    while f is not None and kind_of(f.f_code) in _SKIP_FOR_CALLER:
        f = f.f_back
    return f


def stack_of(frame: Optional[FrameType]) -> Stack:
    """The stack from ``frame`` outwards as :class:`~pytest_torchperf.stacks.Frame`, outermost first."""
    frames = []
    f = frame
    while f is not None:
        frames.append(Frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    frames.reverse()
    return tuple(frames)


class StackCache:
    """One captured stack per event key: the first time a site is seen, and never again."""

    def __init__(self) -> None:
        self._stacks: dict[Any, Stack] = {}

    def get(self, key: Any, frame: Optional[FrameType]) -> Stack:
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = stack_of(frame)
        return stack

    def clear(self) -> None:
        self._stacks.clear()


def describe_frame(frame: FrameType) -> Frame:
    return Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def owner_label(frame: Frame) -> str:
    """``pytorch_lightning`` for a framework frame: the top package its file lives in."""
    path = stacks.display_path(frame.filename)
    top = path.replace("\\", "/").split("/", 1)[0]
    return top[:-3] if top.endswith(".py") else top
