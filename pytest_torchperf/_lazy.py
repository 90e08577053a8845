"""A module loaded on first attribute access: what the pytest glue needs only once a test is watched.

An unmarked session must not pay for the registry, the probes, the statistics or the report types
(issue 25: start-up within 20 ms of ``-p no:torchperf``), so the glue refers to those modules
through :func:`lazy_module` and type-checks against the real ones.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any, Optional

__all__ = ["lazy_module"]


class _LazyModule:
    __slots__ = ("_name", "_module")

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: Optional[ModuleType] = None

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):  # what pytest's fixture scan asks every plugin attribute: not a reason to load
            raise AttributeError(attr)
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attr)

    def __repr__(self) -> str:
        state = "loaded" if self._module is not None else "not loaded yet"
        return f"<lazy module {self._name} ({state})>"


def lazy_module(name: str) -> Any:
    """``name`` (absolute), imported the first time one of its attributes is read."""
    return _LazyModule(name)
