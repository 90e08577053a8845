"""torchperf's own frames stay out of ``torch.compile``: compiled code is the same watched or not.

While a compiled function runs, dynamo's frame callback sees every Python
frame called from it: after a graph break, the eager part calls a probe's
wrapper of ``Tensor.item`` (a C function unwatched, a Python frame watched);
Lightning 2.x compiles a compiled module's ``training_step``, which is the
observer's step wrapper while a run watches. Traced as a frame of its own, such
a wrapper is compiled (extra graphs, extra graph breaks) or, worse, guards on
torchperf's bookkeeping (the step counter) and recompiles every step.

So every code object of torchperf's modules is marked with dynamo's own frame
skip, the one ``torch.compiler.disable(fn, recursive=False)`` uses: the frame
runs as it is, and the frames it calls (the user's ``training_step``, torch's
functions) are handled exactly as they would be without it, so a
``fullgraph=True`` step still compiles into its one graph. When dynamo
*inlines* one of these functions into a graph (a patched torch function called
in compiled code) the mark does not apply: the wrappers check
``torch.compiler.is_compiling()`` first and call straight through.

Only torchperf's code objects are marked (a flag dynamo keeps on each code
object); dynamo is never imported here, and nothing of torch or of the user's
changes. Marking is done once per module, when a run starts with dynamo
imported and as soon as dynamo is imported during a run.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from types import CodeType, FunctionType
from typing import Any, Callable, Optional

__all__ = ["skip_own_frames"]

_PACKAGE = __name__.rpartition(".")[0]
#: Modules whose code objects are marked already.
_DONE: set[str] = set()
#: The package's module names not marked yet (listed once from its folder; None: not listed yet, or the
#: package is not in a folder, and ``sys.modules`` is scanned instead).
_PENDING: Optional[list[str]] = None
_LISTED = False


def _skipper() -> Optional[Callable[[CodeType], None]]:
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    skip = getattr(eval_frame, "skip_code", None)
    return skip if callable(skip) else None


def _functions(namespace: dict[str, Any], module: str, depth: int = 0) -> Iterator[CodeType]:
    for value in list(namespace.values()):
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if isinstance(value, property):
            for accessor in (value.fget, value.fset, value.fdel):
                if isinstance(accessor, FunctionType):
                    yield accessor.__code__
        elif isinstance(value, FunctionType) and value.__module__ == module:
            yield value.__code__
        elif isinstance(value, type) and value.__module__ == module and depth < 3:
            yield from _functions(dict(vars(value)), module, depth + 1)


def _nested(code: CodeType) -> Iterator[CodeType]:
    """``code`` and the code objects of the functions, lambdas and comprehensions defined in it."""
    yield code
    for const in code.co_consts:
        if isinstance(const, CodeType):
            yield from _nested(const)


def _package_modules() -> Optional[list[str]]:
    """Every module name of the package, from its folder (None where it is not a folder of files)."""
    root = os.path.dirname(os.path.abspath(__file__))
    names: list[str] = []
    try:
        for folder, dirs, files in os.walk(root):
            dirs[:] = sorted(d for d in dirs if os.path.isfile(os.path.join(folder, d, "__init__.py")))
            relative = os.path.relpath(folder, root)
            prefix = _PACKAGE if relative == os.curdir else f"{_PACKAGE}.{relative.replace(os.sep, '.')}"
            for file in sorted(files):
                if file.endswith(".py"):
                    stem = file[:-3]
                    names.append(prefix if stem == "__init__" else f"{prefix}.{stem}")
    except OSError:  # pragma: no cover - an unreadable folder
        return None
    return names or None


def _candidates() -> list[tuple[str, Any]]:
    """The package's imported modules not marked yet.

    Looked up by name (a hundred lookups) rather than by scanning ``sys.modules``
    (thousands of entries in a process that imported Lightning): this runs at
    every run's start.
    """
    global _PENDING, _LISTED
    if not _LISTED:
        _PENDING, _LISTED = _package_modules(), True
    if _PENDING is None:
        prefix = _PACKAGE + "."
        return [
            (name, module) for name, module in list(sys.modules.items())
            if name not in _DONE and module is not None and (name == _PACKAGE or name.startswith(prefix))
        ]
    found = []
    for name in _PENDING:
        module = sys.modules.get(name)
        if module is not None:
            found.append((name, module))
    return found


def skip_own_frames() -> int:
    """Mark the code objects of torchperf's imported modules for dynamo (if imported); returns how many."""
    skip = _skipper()
    if skip is None:
        return 0
    marked = 0
    for name, module in _candidates():
        _DONE.add(name)
        if _PENDING is not None:
            _PENDING.remove(name)
        seen: set[int] = set()
        for top in _functions(dict(vars(module)), name):
            for code in _nested(top):
                if id(code) in seen:
                    continue
                seen.add(id(code))
                try:
                    skip(code)
                    marked += 1
                except Exception:  # noqa: BLE001 - another dynamo: its frames are traced as before
                    return marked
    return marked
