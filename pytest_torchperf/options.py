"""The arguments of ``@pytest.mark.torchperf(...)`` and ``torchperf.watch(...)``.

One frozen dataclass holds them; :func:`parse_options` is the only way in and
rejects anything it does not know, naming the argument and what it accepts.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Mapping, Optional

__all__ = ["SCOPES", "Options", "UsageError", "parse_options", "describe_options"]

#: Where the step checks apply.
SCOPES = ("training_step", "batch", "test")


class UsageError(ValueError):
    """A torchperf marker, fixture or option was given an argument it does not accept."""


def _field(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


@dataclasses.dataclass(frozen=True)
class Options:
    """What one watched run checks. Build it with :func:`parse_options`."""

    no_host_sync: bool = _field(True, "no GPU->CPU synchronisation inside the scope")
    on_device: bool = _field(True, "tensors are created on the device, not built on the host and copied")
    no_iterator_reset: bool = _field(
        True, "each DataLoader with workers starts its worker pool at most once"
    )
    max_overhead: Optional[float] = _field(
        None, "epoch time within this fraction of a vanilla PyTorch loop (e.g. 0.10)"
    )
    scope: str = _field(
        "training_step",
        "where step checks apply: 'training_step', 'batch' (batch start to batch end) or 'test'",
    )

    @property
    def enabled_checks(self) -> tuple[str, ...]:
        """Names of the invariants this run was asked to check, in declaration order."""
        names = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "scope":
                continue
            if value is True or (f.name == "max_overhead" and value is not None):
                names.append(f.name)
        return tuple(names)


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}
_BOOL_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("bool", bool))


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
    return type(value).__name__


def parse_options(
    kwargs: Mapping[str, Any],
    *,
    args: tuple[Any, ...] = (),
    where: str = "torchperf",
) -> Options:
    """Validate ``kwargs`` and return the :class:`Options` they describe.

    ``where`` names the caller in error messages (``@pytest.mark.torchperf``,
    ``torchperf.watch()``). Raises :class:`UsageError` naming the first bad
    argument, what it accepts and, for a misspelt name, the closest valid one.
    """
    allowed = ", ".join(_FIELDS)
    if args:
        raise UsageError(
            f"{where} takes keyword arguments only, got positional {args[0]!r}; "
            f"allowed arguments: {allowed}"
        )
    for name in kwargs:
        if name not in _FIELDS:
            raise UsageError(
                f"{where} got an unknown argument {name!r}{_suggest(name, list(_FIELDS))}; "
                f"allowed arguments: {allowed}"
            )
    for name in _BOOL_FIELDS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise UsageError(
                f"{where}: {name} must be True or False, got {kwargs[name]!r} ({_type_name(kwargs[name])})"
            )
    if "max_overhead" in kwargs:
        value = kwargs["max_overhead"]
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(
                    f"{where}: max_overhead must be a number > 0 (a fraction: 0.10 means 10%) or None, "
                    f"got {value!r} ({_type_name(value)})"
                )
            if not math.isfinite(value) or value <= 0:
                raise UsageError(
                    f"{where}: max_overhead must be a finite number > 0 (a fraction: 0.10 means 10%), "
                    f"got {value!r}"
                )
    if "scope" in kwargs:
        value = kwargs["scope"]
        if not isinstance(value, str) or value not in SCOPES:
            hint = _suggest(value, SCOPES) if isinstance(value, str) else ""
            raise UsageError(
                f"{where}: scope must be one of {', '.join(repr(s) for s in SCOPES)}, "
                f"got {value!r}{hint}"
            )
    values = dict(kwargs)
    if values.get("max_overhead") is not None:
        values["max_overhead"] = float(values["max_overhead"])
    return Options(**values)


def describe_options() -> str:
    """The marker's signature for ``pytest --markers``, built from the dataclass itself."""
    parts = []
    for name, f in _FIELDS.items():
        parts.append(f"{name}={f.default!r}")
    return ", ".join(parts)


def option_docs() -> list[tuple[str, Any, str]]:
    """``(name, default, doc)`` for every argument, for help texts and the README."""
    return [(name, f.default, f.metadata["doc"]) for name, f in _FIELDS.items()]
