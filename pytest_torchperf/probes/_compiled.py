"""What dynamo compiled before a watch: the graph breaks kept in a code object's compiled versions.

Dynamo keeps what it compiled on the code object of the user's function (its
*cache entries*), for the life of the process: a second test that compiles a
fresh instance of the same module class, or a loop that compiled its model
before its first step, runs that code without compiling again, and a probe
that waits for dynamo to compile sees nothing.

What is still there to read, without running or changing anything:

- each cache entry's transformed bytecode, which calls the function dynamo
  made for the code after each graph break (``__resume_at_<offset>``, a global
  of the function's module named ``torch_dynamo_resume_in_<function>_at_<line>``:
  the line of the break) and, recursively, those functions' own cache entries;
- dynamo's compilation records (``torch._dynamo.utils._compilation_metrics``,
  its last 64 compiles), which keep each compiled frame's graph-break reasons;
- the breaks torchperf saw itself while a watch was on (:data:`KNOWN`), with
  their full stacks: the same break seen in an earlier test keeps its reason.

Reading them uses dynamo's debug accessor ``_debug_get_cache_entry_list``
only; nothing is compiled, guarded or evaluated.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Iterator
from types import CodeType
from typing import Any, Callable, Optional

from ..stacks import Frame

__all__ = ["KNOWN", "breaks_in", "codes_of", "remember"]

_RESUME = "__resume_at_"
_RESUME_NAME = "torch_dynamo_resume_in_"

#: Root code object dynamo compiled -> the breaks torchperf saw while compiling it (any watch, any test).
KNOWN: weakref.WeakKeyDictionary[CodeType, list[Any]] = weakref.WeakKeyDictionary()


def remember(code: Optional[CodeType], event: Any) -> None:
    """Keep a break seen while dynamo compiled ``code`` (the frame it started from)."""
    if code is None:
        return
    known = KNOWN.setdefault(code, [])
    if len(known) < 32:
        known.append(event)


def _entries(code: CodeType) -> list[Any]:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    read: Optional[Callable[[CodeType], Any]] = getattr(eval_frame, "_debug_get_cache_entry_list", None)
    if read is None:
        return []
    return list(read(code) or ())


def _function(fn: Any) -> Any:
    """The plain function of ``fn`` (a bound method, a ``functools.wraps`` wrapper), or None."""
    for _ in range(4):
        function = getattr(fn, "__func__", fn)
        if isinstance(getattr(function, "__code__", None), CodeType):
            return function
        fn = getattr(fn, "__wrapped__", None)
        if fn is None:
            break
    return None


def codes_of(fn: Any) -> list[tuple[CodeType, dict[str, Any]]]:
    """The code objects dynamo compiles when ``fn`` (what ``torch.compile`` wrapped) is called, each with
    its function's module namespace (where dynamo keeps the resume functions).

    A module (``torch.compile(model)`` wraps ``model.__call__``): the ``forward``
    of it and of each of its submodules (a break inside a submodule makes dynamo
    compile that forward on its own). A function: its code.
    """
    owner = getattr(fn, "__self__", None)
    modules = getattr(owner, "modules", None)
    functions = (
        [_function(getattr(m, "forward", None)) for m in modules()]
        if callable(modules) and callable(getattr(owner, "forward", None))
        else [_function(fn)]
    )
    out: list[tuple[CodeType, dict[str, Any]]] = []
    seen: set[int] = set()
    for function in functions:
        if function is not None and id(function.__code__) not in seen:
            seen.add(id(function.__code__))
            out.append((function.__code__, function.__globals__))
    return out


def _resumes(entry: Any, globals_: dict[str, Any]) -> Iterator[Any]:
    for name in getattr(entry.code, "co_names", ()):
        if name.startswith(_RESUME):
            function = globals_.get(name)
            if function is not None and isinstance(getattr(function, "__code__", None), CodeType):
                yield function


def breaks_in(code: CodeType, globals_: dict[str, Any], make: Callable[[str, Frame, CodeType], Any]) -> list[Any]:
    """The graph breaks in what dynamo compiled of ``code`` (none: not compiled, or compiled whole).

    ``globals_`` is the module namespace of the function (where dynamo keeps the
    resume functions); ``make(reason, frame, compiled)`` builds one break from
    dynamo's reason (``""`` when not known) and the break's line. A frame whose
    breaks torchperf saw while dynamo compiled it gives those events instead.
    """
    out: list[Any] = []
    todo, seen = [code], {id(code)}
    while todo and len(seen) < 64:
        current = todo.pop()
        entries = _entries(current)
        resumes = [f for entry in entries for f in _resumes(entry, globals_)]
        if resumes:
            known = KNOWN.get(current)
            if known:
                out.extend(known)
            else:
                reasons = _reasons(current)
                for function in resumes:
                    line = function.__code__.co_firstlineno
                    name = function.__code__.co_name
                    where = name[len(_RESUME_NAME):].rpartition("_at_")[0] if name.startswith(_RESUME_NAME) else name
                    frame = Frame(current.co_filename, line, where or current.co_name)
                    out.append(make(reasons[0] if reasons else "", frame, current))
        for function in resumes:
            resumed = function.__code__
            if id(resumed) not in seen:
                seen.add(id(resumed))
                todo.append(resumed)
    return out


def compiled(code: CodeType) -> bool:
    """Whether dynamo holds compiled code for ``code``."""
    return bool(_entries(code))


def _reasons(code: CodeType) -> list[str]:
    """Dynamo's graph-break reasons for ``code`` from its compilation records (empty: not kept)."""
    utils = sys.modules.get("torch._dynamo.utils")
    records = getattr(utils, "_compilation_metrics", None) or ()
    out: list[str] = []
    for record in list(records):
        if (
            getattr(record, "co_name", None) == code.co_name
            and getattr(record, "co_filename", None) == code.co_filename
            and getattr(record, "co_firstlineno", None) == code.co_firstlineno
        ):
            for reason in sorted(getattr(record, "restart_reasons", None) or ()):
                if reason not in out:
                    out.append(str(reason))
    return out
