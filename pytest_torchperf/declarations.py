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
import functools
import inspect
import re
from collections.abc import Iterable, Mapping
from typing import Any, Callable, Union

from .arguments import UsageError, suggest
from .core import EVENTS, Events

__all__ = [
    "QUALIFIER", "event_parameters", "handler_names", "make_settings", "settings_class", "validate_declaration",
    "verify_handlers",
]

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


#: What a probe declares of an event it sends: its description (``"(a, b): what it means"``) or a function
#: whose signature (after ``self``) is what a handler receives.
EventDeclaration = Union[str, Callable[..., Any]]


def event_parameters(declared: EventDeclaration) -> tuple[str, ...]:
    """The arguments a handler of an event receives, from its declaration (see :data:`EventDeclaration`)."""
    if callable(declared):
        return tuple(list(inspect.signature(declared).parameters)[1:])
    found = re.match(r"\s*\(([^)]*)\)", declared)
    if found is None:
        return ()
    return tuple(p.strip() for p in found.group(1).split(",") if p.strip())


@functools.cache
def _builtin_events() -> dict[str, tuple[str, ...]]:
    """The events of :class:`~pytest_torchperf.core.Events` -> the arguments their handlers receive (read once:
    the class is this package's own)."""
    return {name: event_parameters(getattr(Events, name)) for name in EVENTS}


def _events(extra: Union[Mapping[str, EventDeclaration], Iterable[str]]) -> dict[str, tuple[str, ...]]:
    """Every known event -> the arguments its handlers receive: :class:`~pytest_torchperf.core.Events`, then
    the events a probe declares (a name alone, from an older probe, receives what a call passes: not checked)."""
    known: dict[str, Any] = dict(_builtin_events())
    items = extra.items() if isinstance(extra, Mapping) else ((name, None) for name in extra)
    for name, declared in items:
        if name not in known:
            known[name] = None if declared is None else event_parameters(declared)
    return known


def verify_handlers(
    cls: type, where: str, extra_events: Union[Mapping[str, EventDeclaration], Iterable[str]] = ()
) -> None:
    """Refuse a check class whose ``on_*`` method is no event, or does not take what its event sends.

    As pluggy verifies a hook implementation against its specification: once, when the check's class is
    registered (or, for a check made by a factory, when it is first made), never per event.
    """
    known = _events(extra_events)
    for name in handler_names(cls):
        if name not in known:
            raise UsageError(
                f"pytest-torchperf: {where} defines {name}(), which is no event{suggest(name, list(known))}; "
                f"events: {', '.join(known)} (a probe of its own declares more in Probe.events)"
            )
        params = known[name]
        handler = inspect.getattr_static(cls, name)
        if params is None or not inspect.isfunction(handler):
            continue
        try:
            signature = inspect.signature(handler)
        except (TypeError, ValueError):  # pragma: no cover - not introspectable: called as it is
            continue
        try:
            signature.bind(None, *params)
        except TypeError:
            expected = f"{name}({', '.join(('self',) + params)})"
            raise UsageError(
                f"pytest-torchperf: {where} defines {name}{signature}, which cannot take what event {name} "
                f"sends: it is called as {expected}"
            ) from None


def validate_declaration(invariant: Any, source: str, extra_events: Any = ()) -> None:
    """Refuse a check class with an ``on_*`` method that is no event or has the wrong arguments, and a settings
    class that does not fit."""
    check = invariant.check
    if isinstance(check, type):
        verify_handlers(check, f"{source}: the check of invariant {invariant.name!r}", extra_events)
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
