"""A wrapper of a module's function that compares equal to, and hashes like, the function it wraps.

While a watch runs, a few functions of torch's namespaces are torchperf's
wrappers (the factories ``torch.randn``, ``torch.tensor``...; the synchronising
``torch.nonzero``, ``torch.unique``...; the list is in docs/isolation.md). User
code that keeps torch's functions in tables, or compares them
(``self.monitor_op == torch.lt``, ``{torch.add: "+"}[fn]``, ``fn in (torch.cat,
torch.stack)``), must behave as unwatched. ``is`` cannot hold for an attribute
that was replaced; ``==`` and ``hash`` can: :class:`Transparent` holds the
wrapper as a :class:`functools.partial` without arguments, whose call stays in
C (no Python frame: the wrapper's caller is still its caller's frame, and a
call costs what a partial costs), and whose ``__eq__``/``__hash__`` are those
of the function first wrapped. ``__wrapped__``, ``__name__``, ``__qualname__``,
``__module__``, ``__doc__`` and ``repr`` are the function's too, and
``inspect.signature`` follows ``__wrapped__``.

A class attribute would need a Python ``__get__`` (a frame on every attribute
read) to bind as a method, so only module-level functions are held this way.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

__all__ = ["Transparent", "root_of"]


def root_of(function: Any) -> Any:
    """The function first wrapped: ``function`` itself, or the root of the :class:`Transparent` it is."""
    return function._root if isinstance(function, Transparent) else function


class Transparent(functools.partial):  # type: ignore[type-arg,unused-ignore]
    """A wrapper of ``original`` that compares equal to it and hashes alike (see the module's docstring)."""

    #: The function first wrapped (the same for every holder stacked over it).
    _root: Any

    def __new__(cls, wrapper: Any, original: Any) -> Transparent:
        self = super().__new__(cls, wrapper)
        self._root = root_of(original)
        self.__dict__["__wrapped__"] = original
        for name in ("__name__", "__qualname__", "__module__"):
            if hasattr(original, name):
                self.__dict__[name] = getattr(original, name)
        self.__dict__["__doc__"] = getattr(original, "__doc__", None)
        return self

    def __eq__(self, other: Any) -> Any:
        if other is self or other is self._root or (isinstance(other, Transparent) and other._root is self._root):
            return True
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._root)

    def __repr__(self) -> str:
        return repr(self._root)

    def __reduce__(self) -> Any:
        # pickled as the function itself (``copy.copy`` of a function is the function): loads as torch's own
        return copy.copy, (self._root,)

    def __copy__(self) -> Transparent:
        return self

    def __deepcopy__(self, memo: Any) -> Transparent:
        return self
