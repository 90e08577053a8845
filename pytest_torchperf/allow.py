"""The allow-lists of ``allowed_syncs`` and ``allowed_copies``: sites, files and function names."""

from __future__ import annotations

import os
from types import FrameType
from typing import Optional

from .frames import Located

__all__ = ["AllowList", "function_names"]


class AllowList:
    """Entries of ``allowed_syncs`` / ``allowed_copies``: sites, files and function names.

    - ``"path/file.py:LINE"``: that line; the path matches the end of the file's
      path on a directory boundary (``"train.py:12"``, ``"pkg/train.py:12"`` or absolute).
    - ``"path/file.py"``: any line of that file.
    - ``"name"`` / ``"Class.name"``: any event with that function anywhere in its
      call stack (so an entry can cover a helper and everything it calls).
    """

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.entries = entries
        self._sites: list[tuple[str, Optional[int], str]] = []
        self._functions: list[tuple[tuple[str, ...], str]] = []
        for entry in entries:
            if entry.endswith(".py") or ".py:" in entry:
                path, _, line = entry.rpartition(":") if ".py:" in entry else (entry, "", "")
                self._sites.append((os.path.normpath(path), int(line) if line else None, entry))
            else:
                self._functions.append((tuple(entry.split(".")), entry))
        self._file_cache: dict[tuple[str, int], Optional[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def needs_stack(self) -> bool:
        """Whether a match depends on the whole call stack (function entries), not just the site."""
        return bool(self._functions)

    def match_site(self, filename: str, lineno: int) -> Optional[str]:
        key = (filename, lineno)
        if key in self._file_cache:
            return self._file_cache[key]
        found = None
        if self._sites:
            path = os.path.normpath(os.path.realpath(filename))
            for suffix, line, entry in self._sites:
                if line is not None and line != lineno:
                    continue
                if path == suffix or path.endswith(os.sep + suffix.lstrip(os.sep)) or path == os.path.realpath(suffix):
                    found = entry
                    break
        self._file_cache[key] = found
        return found

    def match_frames(self, frame: Optional[FrameType]) -> Optional[str]:
        """The first function entry naming a frame from ``frame`` outwards."""
        if not self._functions:
            return None
        f = frame
        while f is not None:
            code = f.f_code
            for parts, entry in self._functions:
                if code.co_name != parts[-1]:
                    continue
                if len(parts) == 1 or _qualname_matches(f, parts):
                    return entry
            f = f.f_back
        return None

    @property
    def function_names(self) -> set[str]:
        """The bare function names the function entries end with."""
        return {parts[-1] for parts, _ in self._functions}

    def match_names(self, names: frozenset[str]) -> Optional[str]:
        """The first function entry among ``names`` (qualified-name suffixes from :func:`function_names`)."""
        for _, entry in self._functions:
            if entry in names:
                return entry
        return None

    def match(self, located: Located, frame: Optional[FrameType]) -> Optional[str]:
        site = located.frame
        if site is not None and self._sites:
            entry = self.match_site(site.f_code.co_filename, site.f_lineno)
            if entry:
                return entry
        return self.match_frames(frame)


def function_names(frame: Optional[FrameType], wanted: set[str] | frozenset[str]) -> frozenset[str]:
    """Every function of the stack whose bare name is in ``wanted``, as qualified-name suffixes.

    ``wanted`` holds the function names allow-lists end with (:attr:`AllowList.function_names`);
    the result is matched later with :meth:`AllowList.match_names`.
    """
    names: set[str] = set()
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_name in wanted:
            qualname = getattr(code, "co_qualname", None)
            if qualname is None:  # Python < 3.11: the method's class from ``self``/``cls``
                owner = f.f_locals.get("self", f.f_locals.get("cls"))
                classes = []
                if owner is not None:
                    cls = owner if isinstance(owner, type) else type(owner)
                    classes = [c.__name__ for c in cls.__mro__]
                names.add(code.co_name)
                names.update(f"{c}.{code.co_name}" for c in classes)
            else:
                parts = qualname.replace(".<locals>", "").split(".")
                names.update(".".join(parts[i:]) for i in range(len(parts)))
        f = f.f_back
    return frozenset(names)


def _qualname_matches(frame: FrameType, parts: tuple[str, ...]) -> bool:
    qualname = getattr(frame.f_code, "co_qualname", None)  # Python 3.11+
    if qualname is not None:
        return bool(("." + qualname.replace(".<locals>", "")).endswith("." + ".".join(parts)))
    # Python < 3.11: a method's class from its ``self`` (or ``cls``) argument.
    if len(parts) != 2:
        return False
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    if owner is None:
        return False
    cls = owner if isinstance(owner, type) else type(owner)
    return any(c.__name__ == parts[0] for c in cls.__mro__)
