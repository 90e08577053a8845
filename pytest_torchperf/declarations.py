"""What the registry checks in a declaration beyond its names: a check's handlers and its settings object.

- A check class's ``on_*`` methods must each name an event (:data:`pytest_torchperf.core.EVENTS`, or
  one the invariant's own probes declare in ``Probe.events``): a misspelt handler would never be called
  and its invariant would pass, so it is a :class:`UsageError` with "did you mean" at registration.
- Each invariant's settings are a frozen object (``Check.settings``): its declared ``settings``
  dataclass, or one made from its arguments.

Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable

from .arguments import UsageError, suggest
from .core import EVENTS

__all__ = ["QUALIFIER", "handler_names", "make_settings", "settings_class", "validate_declaration"]

#: Joins an invariant's name and one of its settings' in the marker: ``no_host_sync__allowed_syncs``.
QUALIFIER = "__"

#: ``on_*`` names of the Check base class and its helpers that are not handlers.
_NOT_HANDLERS: frozenset[str] = frozenset()


def handler_names(cls: type) -> list[str]:
    """The ``on_*`` methods a check class defines (its own and inherited ones)."""
    return [
        name for name, value in inspect.getmembers(cls)
        if name.startswith("on_") and callable(value) and name not in _NOT_HANDLERS
    ]


def validate_declaration(invariant: Any, source: str, extra_events: Iterable[str] = ()) -> None:
    """Refuse a check class with an ``on_*`` method that is no event, and a settings class that does not fit."""
    check = invariant.check
    if isinstance(check, type):
        known = list(EVENTS) + [e for e in extra_events if e not in EVENTS]
        for name in handler_names(check):
            if name not in known:
                raise UsageError(
                    f"pytest-torchperf: {source}: the check of invariant {invariant.name!r} defines {name}(), "
                    f"which is no event{suggest(name, known)}; events: {', '.join(known)} "
                    "(a probe of its own declares more in Probe.events)"
                )
    declared = getattr(invariant, "settings", None)
    if declared is not None:
        if not (dataclasses.is_dataclass(declared) and isinstance(declared, type)):
            raise UsageError(f"pytest-torchperf: {source}: settings of {invariant.name!r} must be a dataclass")
        if not declared.__dataclass_params__.frozen:  # type: ignore[attr-defined]
            raise UsageError(f"pytest-torchperf: {source}: settings of {invariant.name!r} must be frozen")
        fields = [f.name for f in dataclasses.fields(declared)]
        names = [a.name for a in invariant.arguments]
        if sorted(fields) != sorted(names):
            raise UsageError(
                f"pytest-torchperf: {source}: the settings class of {invariant.name!r} has fields {fields}, "
                f"its arguments are {names}"
            )


_CLASSES: dict[int, tuple[Any, type]] = {}


def settings_class(invariant: Any) -> type:
    """The frozen dataclass of ``invariant``'s settings (its declared one, else one made once)."""
    declared = getattr(invariant, "settings", None)
    if declared is not None:
        return declared  # type: ignore[no-any-return]
    cached = _CLASSES.get(id(invariant))
    if cached is not None and cached[0] is invariant:
        return cached[1]
    name = "".join(part.title() for part in invariant.name.split("_")) + "Settings"
    made = dataclasses.make_dataclass(name, [(a.name, Any) for a in invariant.arguments], frozen=True)
    made.__doc__ = f"The settings of {invariant.name}: " + ", ".join(a.name for a in invariant.arguments)
    _CLASSES[id(invariant)] = (invariant, made)
    return made


def make_settings(invariant: Any, values: dict[str, Any]) -> Any:
    """``invariant``'s settings object from its arguments' values (by plain setting name)."""
    return settings_class(invariant)(**{a.name: values[a.name] for a in invariant.arguments})
