"""The arguments of ``@pytest.mark.torchperf(...)`` and ``torchperf.watch(...)``, validated.

:func:`parse_options` is the only way in: it checks every argument against its
declaration in the invariant registry (:mod:`pytest_torchperf.registry`) and
rejects anything it does not know, naming the argument, what it accepts and,
for a misspelt name, the closest valid one. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import registry
from .arguments import UsageError, suggest
from .constants import (  # noqa: F401 - read from here by the invariants
    OVERHEAD_INCONCLUSIVE,
    OVERHEAD_MAX_ROUNDS,
    OVERHEAD_MIN_ROUNDS,
    OVERHEAD_ROUNDS,
)
from .declarations import make_settings
from .registry import SCOPES

__all__ = [
    "OVERHEAD_INCONCLUSIVE",
    "OVERHEAD_MAX_ROUNDS",
    "OVERHEAD_MIN_ROUNDS",
    "OVERHEAD_ROUNDS",
    "SCOPES",
    "Options",
    "UsageError",
    "describe_options",
    "parse_options",
]


class Options:
    """What one watched run checks: the value of every registered argument. Immutable.

    ``Options()`` holds the defaults; read a value as an attribute
    (``options.max_overhead``). Build one from user input with :func:`parse_options`.
    """

    def __init__(self, **values: Any) -> None:
        arguments = registry.all_arguments()
        unknown = [name for name in values if name not in arguments]
        if unknown:
            raise TypeError(f"Options() got an unknown argument {unknown[0]!r}{suggest(unknown[0], list(arguments))}")
        for name, (arg, _) in arguments.items():
            object.__setattr__(self, name, values.get(name, arg.default))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"Options are immutable: cannot set {name!r} (build new ones with replace())")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"Options are immutable: cannot delete {name!r}")

    def __getattr__(self, name: str) -> Any:  # only called for names that are not set
        raise AttributeError(f"Options has no argument {name!r}{suggest(name, list(vars(self)))}")

    def settings(self, invariant: str) -> Any:
        """The frozen settings object of ``invariant`` (``options.settings("min_workers").min_workers_allowed``)."""
        declared = registry.get(invariant)
        values = vars(self)
        return make_settings(declared, {plain: values[key] for plain, key in registry.setting_keys(declared).items()})

    def to_dict(self) -> dict[str, Any]:
        """Every argument and its value, in the marker's order."""
        return dict(vars(self))

    def replace(self, **changes: Any) -> Options:
        """A copy with ``changes`` applied (not validated: use :func:`parse_options` for user input)."""
        return Options(**{**vars(self), **changes})

    @property
    def enabled_checks(self) -> tuple[str, ...]:
        """Names of the invariants this run was asked to check, in registry order."""
        values = vars(self)
        return tuple(
            name for name, inv in registry.invariants().items() if name in values and inv.enabled(values[name])
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Options) and vars(self) == vars(other)

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, repr(v)) for k, v in vars(self).items())))

    def __repr__(self) -> str:
        defaults = {name: arg.default for name, (arg, _) in registry.all_arguments().items()}
        changed = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if defaults.get(k, object()) != v)
        return f"Options({changed})"


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
    arguments = registry.all_arguments()
    allowed = ", ".join(arguments)
    if args:
        raise UsageError(
            f"{where} takes keyword arguments only, got positional {args[0]!r}; allowed arguments: {allowed}"
        )
    keys: dict[str, str] = {}
    for name in kwargs:
        try:
            key = registry.spelling(name)
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
        if key is None:
            raise UsageError(
                f"{where} got an unknown argument {name!r}{suggest(name, list(arguments))}; "
                f"allowed arguments: {allowed}"
            )
        if key in keys.values():
            raise UsageError(f"{where} got argument {key!r} twice (as {name!r} too)")
        keys[name] = key
    values = {keys[name]: arguments[keys[name]][0].validate(value, where) for name, value in kwargs.items()}
    return Options(**values)


def describe_options() -> str:
    """The marker's signature for ``pytest --markers``, built from the registry."""
    return ", ".join(f"{name}={arg.default!r}" for name, (arg, _) in registry.all_arguments().items())
