"""Each invariant's figures as a declared type: refused at registration when a name clashes with the engine's.

An invariant declares its figures (the numbers and lists a
:class:`~pytest_torchperf.report.CheckResult` carries beside its verdict: in
the JSON report, the JUnit properties, the baseline) as a ``TypedDict`` with
``total=False`` (a figure is there when the check measured it)::

    class Figures(TypedDict, total=False):
        steps: int
        syncs: int
        sites: list[dict[str, Any]]

    INVARIANT = Invariant("no_host_sync", ..., figures=Figures)

and its check builds them as one (``figures: Figures = {"steps": n}``), so a
type checker holds the check to its declaration. The engine's own keys live
in other fields (a multi-process verdict's per-process results in
``CheckResult.processes``); the names a verdict's JSON and JUnit properties
give its own fields (:data:`RESERVED`) are refused as figure names when the
invariant is registered. The JSON schema of the figures and the reference
page (``docs/reference/invariants.md``) are generated from these types.

Nothing here imports torch.
"""

from __future__ import annotations

import sys
import typing
from typing import Any, Union

__all__ = ["RESERVED", "declared", "names", "schema", "type_text", "validate"]

#: A verdict's own fields in the JSON report and the JUnit properties (``torchperf.<invariant>.status``):
#: no figure may take these names.
RESERVED = frozenset(("passed", "status", "summary", "count", "figures", "findings", "processes"))


def _is_typed_dict(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, dict) and hasattr(cls, "__annotations__") and hasattr(
        cls, "__total__"
    )


def declared(figures: Any) -> dict[str, Any]:
    """Figure name -> its type, as ``figures`` (a ``TypedDict`` class) declares them, bases included."""
    module = sys.modules.get(getattr(figures, "__module__", ""), None)
    namespace = dict(vars(module)) if module is not None else {}
    return typing.get_type_hints(figures, globalns=namespace)


def names(figures: Any) -> tuple[str, ...]:
    """The figure names ``figures`` declares (empty for None)."""
    return tuple(declared(figures)) if figures is not None else ()


def validate(figures: Any, source: str, invariant: str) -> None:
    """Refuse a figures declaration that is no ``TypedDict``, or names a figure like a verdict's own field."""
    from .arguments import UsageError

    if figures is None:
        return
    if not _is_typed_dict(figures):
        raise UsageError(
            f"pytest-torchperf: {source}: the figures of invariant {invariant!r} must be a TypedDict class, "
            f"not {figures!r}"
        )
    try:
        fields = declared(figures)
    except Exception as exc:  # noqa: BLE001 - an annotation that does not resolve is named
        raise UsageError(
            f"pytest-torchperf: {source}: the figures of invariant {invariant!r} do not resolve: {exc}"
        ) from None
    clash = sorted(set(fields) & RESERVED)
    if clash:
        raise UsageError(
            f"pytest-torchperf: {source}: invariant {invariant!r} declares the figure {clash[0]!r}, a name "
            f"its verdict already uses (reserved: {', '.join(sorted(RESERVED))})"
        )


_SCALARS: dict[Any, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


def _type_schema(tp: Any) -> dict[str, Any]:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any or tp is object:
        return {}
    if tp is type(None):
        return {"type": "null"}
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if origin is Union:
        options = [_type_schema(a) for a in args]
        if all(set(o) == {"type"} for o in options):
            kinds: list[Any] = []
            for o in options:
                kinds.extend(o["type"] if isinstance(o["type"], list) else [o["type"]])
            return {"type": kinds}
        return {"anyOf": options}
    if origin in (list, tuple, set, frozenset):
        item = _type_schema(args[0]) if args else {}
        return {"type": "array", **({"items": item} if item else {})}
    if origin is dict or tp is dict:
        value = _type_schema(args[1]) if len(args) == 2 else {}
        return {"type": "object", **({"additionalProperties": value} if value else {})}
    if tp is list:
        return {"type": "array"}
    if _is_typed_dict(tp):
        return schema(tp)
    return {}


def schema(figures: Any) -> dict[str, Any]:
    """A JSON Schema (2020-12) object of the figures ``figures`` declares (an empty object for None)."""
    if figures is None:
        return {"type": "object"}
    return {
        "type": "object",
        "properties": {name: _type_schema(tp) for name, tp in declared(figures).items()},
        "additionalProperties": False,
    }


def type_text(tp: Any) -> str:
    """A declared type as the reference page writes it (``int``, ``list[str]``, ``float | None``)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is type(None):
        return "None"
    if origin is Union:
        return " | ".join(type_text(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_text(a) for a in args)}]" if args else name
    return str(getattr(tp, "__name__", tp)).replace("typing.", "")

