"""Small wording helpers shared by the reports."""

from __future__ import annotations

__all__ = ["plural", "times"]


def plural(n: int, word: str, many: str = "") -> str:
    """``"1 sync"``, ``"3 syncs"``; ``many`` for irregular plurals (``plural(2, "copy", "copies")``)."""
    if n == 1:
        return f"{n} {word}"
    return f"{n} {many or (word + 'es' if word.endswith(('ch', 'sh', 's', 'x')) else word + 's')}"


def times(n: int) -> str:
    """``"once"``, ``"twice"``, ``"3 times"``."""
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"
