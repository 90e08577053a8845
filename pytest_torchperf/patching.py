"""Reversible patches: every attribute set here is put back exactly as it was.

An attribute that was inherited (not in the owner's own ``__dict__``) is
deleted on undo rather than re-set, so a patched class ends up with the very
same ``__dict__`` it started with.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["Patcher"]

_MISSING = object()


class Patcher:
    """Collects undo actions; :meth:`undo` runs them newest first, once."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering how to put the old state back."""
        own = vars(owner).get(name, _MISSING) if hasattr(owner, "__dict__") else _MISSING
        setattr(owner, name, value)

        def restore() -> None:
            if own is _MISSING:
                try:
                    delattr(owner, name)
                except AttributeError:
                    pass
            else:
                setattr(owner, name, own)

        self._undo.append(restore)

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(original)``."""
        original = getattr(owner, name)
        self.setattr(owner, name, make(original))

    def callback(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on undo (for state that is not an attribute)."""
        self._undo.append(fn)

    def undo(self) -> None:
        errors: list[BaseException] = []
        while self._undo:
            action = self._undo.pop()
            try:
                action()
            except Exception as exc:  # keep undoing the rest, then report
                errors.append(exc)
        if errors:
            raise errors[0]

    def __len__(self) -> int:
        return len(self._undo)
