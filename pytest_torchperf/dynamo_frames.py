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

import sys
from types import CodeType, FunctionType
from typing import Any, Callable, Iterator, Optional

__all__ = ["skip_own_frames"]

_PACKAGE = __name__.rpartition(".")[0]
#: Modules whose code objects are marked already.
_DONE: set[str] = set()


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


def skip_own_frames() -> int:
    """Mark the code objects of torchperf's imported modules for dynamo (if imported); returns how many."""
    skip = _skipper()
    if skip is None:
        return 0
    marked = 0
    for name, module in list(sys.modules.items()):
        if name in _DONE or module is None or not (name == _PACKAGE or name.startswith(_PACKAGE + ".")):
            continue
        _DONE.add(name)
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
