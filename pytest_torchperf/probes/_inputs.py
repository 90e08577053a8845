"""The data a legacy constructor was given, read at the move: ``torch.Tensor(next_obs).to(device)``.

A legacy constructor (``torch.Tensor``, ``torch.FloatTensor``...) given data copies it into host memory (a
numpy array is copied and converted), so moving the result copies it a second time: CleanRL's
``torch.Tensor(next_obs).to(device)`` on every environment step. The registry never sees the constructor
(it is a class, not a function to wrap); :class:`LegacyArgument` reads the statement at a move in a step
(once per line, cached) and gives the name of the constructor's one positional argument when it is a plain
variable (``next_obs``), and :func:`legacy_data` looks that name up in the frame: the array or list itself, so
``on_device`` can tell input data (new values every step) from a constant, and an avoidable host copy (an
array) from python data that must be converted anyway.
"""

from __future__ import annotations

import ast
from types import CodeType, FrameType
from typing import Any, Optional

from ._host import LEGACY
from ._propagate import _PerLine, _statement_at

__all__ = ["LegacyArgument", "legacy_data"]

_MISSING = object()


class LegacyArgument(_PerLine):
    """The variable given to the first legacy constructor called in the statement at a line, or None (sizes,
    an expression, no legacy call)."""

    def _read(self, code: CodeType, lineno: int) -> Optional[str]:
        tree = _statement_at(code.co_filename, lineno)
        if tree is None:
            return None
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or len(node.args) != 1 or node.keywords:
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if name in LEGACY and isinstance(node.args[0], ast.Name):
                return node.args[0].id
        return None


def legacy_data(reader: LegacyArgument, site: FrameType) -> Any:
    """The array or list the legacy constructor at ``site`` was given (None when it is not a plain variable
    holding one: a size, an expression)."""
    name = reader.at(site)
    if name is None:
        return None
    value = site.f_globals.get(name, _MISSING)
    code = site.f_code
    if value is _MISSING or name in code.co_varnames or name in code.co_cellvars or name in code.co_freevars:
        value = site.f_locals.get(name, value)
    if isinstance(value, (list, tuple)):
        return value
    cls = type(value)
    if cls.__module__.startswith("numpy") and hasattr(cls, "__array_interface__"):
        return value
    return None
