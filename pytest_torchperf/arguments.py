"""The vocabulary of invariant arguments: their kinds, validation and error messages.

An invariant declares each argument it takes once (:class:`Argument`: name,
kind, default, doc); the same declaration validates ``@pytest.mark.torchperf``
and ``watch()`` arguments, words the error a wrong value gets, fills the
README's argument tables and the JSON schema of the options. Nothing here
imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from .errors import UsageError, suggest

__all__ = [
    "Argument",
    "ArgumentKind",
    "Choice",
    "Flag",
    "Fraction",
    "Share",
    "Integer",
    "Number",
    "SiteList",
    "UsageError",
    "suggest",
]


def _type_name(value: Any) -> str:
    return type(value).__name__


class ArgumentKind:
    """What values an argument accepts. Subclasses define :meth:`validate` and :meth:`describe`."""

    #: JSON-schema type of the value (for the options schema).
    json_type: Any = None

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:  # pragma: no cover - abstract
        """The value to store, or :class:`UsageError` naming ``name`` and what it accepts."""
        raise NotImplementedError

    def describe(self, meaning: str = "") -> str:  # pragma: no cover - abstract
        """What it accepts, for error messages and the README (``"True or False"``)."""
        raise NotImplementedError

    def schema(self) -> dict[str, Any]:
        return {"type": self.json_type}

    def error(self, where: str, name: str, value: Any, meaning: str = "") -> UsageError:
        return UsageError(f"{where}: {name} must be {self.describe(meaning)}, got {value!r} ({_type_name(value)})")


def _about(meaning: str) -> str:
    return f" ({meaning})" if meaning else ""


class Flag(ArgumentKind):
    """``True`` or ``False``."""

    json_type = "boolean"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if not isinstance(value, bool):
            raise self.error(where, name, value)
        return value

    def describe(self, meaning: str = "") -> str:
        return "True or False"


@dataclass(frozen=True)
class Integer(ArgumentKind):
    """An ``int`` from ``minimum`` to ``maximum``; ``None`` too when ``optional``."""

    minimum: Optional[int] = None
    maximum: Optional[int] = None
    optional: bool = True

    @property
    def json_type(self) -> Any:
        return ["integer", "null"] if self.optional else "integer"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None and self.optional:
            return None
        ok = isinstance(value, int) and not isinstance(value, bool)
        if ok and self.minimum is not None and value < self.minimum:
            ok = False
        if ok and self.maximum is not None and value > self.maximum:
            ok = False
        if not ok:
            raise self.error(where, name, value, meaning)
        return value

    def describe(self, meaning: str = "") -> str:
        if self.minimum is not None and self.maximum is not None:
            text = f"an integer from {self.minimum} to {self.maximum}"
        elif self.minimum is not None:
            text = f"an integer >= {self.minimum}"
        else:
            text = "an integer"
        return text + _about(meaning) + (" or None" if self.optional else "")

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.json_type}
        if self.minimum is not None:
            out["minimum"] = self.minimum
        if self.maximum is not None:
            out["maximum"] = self.maximum
        return out


@dataclass(frozen=True)
class Number(ArgumentKind):
    """A finite number greater than ``above`` (an ``int`` is taken as a ``float``); ``None`` when ``optional``."""

    above: float = 0.0
    optional: bool = True
    unit: str = ""

    @property
    def json_type(self) -> Any:
        return ["number", "null"] if self.optional else "number"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.error(where, name, value, meaning)
        if not math.isfinite(value) or value <= self.above:
            raise UsageError(f"{where}: {name} must be {self._finite()}{self._unit()}, got {value!r}")
        return float(value)

    def _finite(self) -> str:
        return f"a finite number > {self.above:g}"

    def _unit(self) -> str:
        return _about(self.unit)

    def describe(self, meaning: str = "") -> str:
        return f"a number > {self.above:g}{self._unit()}{_about(meaning)}" + (" or None" if self.optional else "")

    def schema(self) -> dict[str, Any]:
        return {"type": self.json_type, "exclusiveMinimum": self.above}


@dataclass(frozen=True)
class Fraction(ArgumentKind):
    """A number from 0 to 1 (a share of the steps); ``None`` too when ``optional``."""

    optional: bool = False

    @property
    def json_type(self) -> Any:
        return ["number", "null"] if self.optional else "number"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None and self.optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            error = self.error(where, name, value, meaning)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 < value <= 100:
                error = UsageError(f"{error}: {percent_hint(name, value)}")
            raise error
        return float(value)

    def describe(self, meaning: str = "") -> str:
        return "a number from 0 to 1" + _about(meaning) + (" or None" if self.optional else "")

    def schema(self) -> dict[str, Any]:
        return {"type": self.json_type, "minimum": 0, "maximum": 1}


def percent_hint(name: str, value: float) -> str:
    """``did you mean 0.5 (50%)?`` for a percentage given where a fraction is meant."""
    fraction = f"{value / 100:.2f}" if float(value).is_integer() else f"{value / 100:g}"
    return f"a fraction, not a percentage: did you mean {name}={fraction} ({value:g}%)?"


_PERCENT = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*%\s*$")


@dataclass(frozen=True)
class Share(Number):
    """A fraction greater than ``above`` (``0.10`` means 10%, ``2.5`` means 250%), or the same written as a
    percentage (``"10%"``, ``"250%"``), at most ``most`` in either form.

    The rule for a bare number: up to ``bare_most`` it is a fraction, except a whole number above 1
    (``max_overhead=50``, ``=5``), which reads as a percentage typed without its sign and is refused with
    "did you mean" (``0.5`` or ``"50%"``): a 5 meant as 5% would otherwise pass what it should fail. A bare
    number above ``bare_most`` is refused the same way. A percentage string is taken as written.
    """

    #: The largest bare number taken as a fraction (1.0: 100%).
    bare_most: float = 1.0
    #: The largest allowance in any form, as a fraction (100.0: 10000%).
    most: float = 100.0

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if isinstance(value, str):
            match = _PERCENT.match(value)
            if match is None:
                raise self.error(where, name, value, meaning)
            value = float(match.group(1)) / 100
            if value <= self.above or value > self.most:
                raise UsageError(
                    f"{where}: {name} must be {self._finite()} and at most {self.most:.0%}{self._unit()}, "
                    f"got {value * 100:g}%"
                )
            return value
        out = super().validate(value, where, name, meaning)
        if out is None or out <= 1 or (out <= self.bare_most and not out.is_integer()):
            return out
        meant = f"did you mean {name}={out / 100:g} or {name}=\"{out:g}%\"?"
        if out <= self.most:  # say how to write that allowance if it was meant
            meant += f" (for {out:.0%}, write {name}=\"{out * 100:g}%\")"
        raise UsageError(
            f"{where}: {name}={value!r} reads as a percentage typed without its % sign: {meant}; "
            f"{name} is {self.describe()}"
        )

    def describe(self, meaning: str = "") -> str:
        return (
            f"a number > {self.above:g} and at most {self.bare_most:g}{self._unit()}, or a percentage such as '10%' "
            f"(at most {self.most:.0%})"
            f"{_about(meaning)}" + (" or None" if self.optional else "")
        )

    def schema(self) -> dict[str, Any]:
        types = ["number", "string", "null"] if self.optional else ["number", "string"]
        return {"type": types, "exclusiveMinimum": self.above, "maximum": self.bare_most, "pattern": r"^[0-9.]+%$"}


@dataclass(frozen=True)
class Choice(ArgumentKind):
    """One of ``choices`` (strings); ``None`` too when ``optional``."""

    choices: tuple[str, ...] = ()
    optional: bool = False

    @property
    def json_type(self) -> Any:
        return ["string", "null"] if self.optional else "string"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None and self.optional:
            return None
        if not isinstance(value, str) or value not in self.choices:
            hint = suggest(value, self.choices) if isinstance(value, str) else ""
            raise UsageError(f"{where}: {name} must be {self.describe()}, got {value!r}{hint}")
        return value

    def describe(self, meaning: str = "") -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices) + (" or None" if self.optional else "")

    def schema(self) -> dict[str, Any]:
        return {"enum": list(self.choices) + ([None] if self.optional else [])}


_SITE_FORMS = (
    "a site 'path/to/file.py:LINE', a file 'file.py' or a function name "
    "('log_images', 'MyModule.on_train_batch_end')"
)
_SITE_RE = re.compile(r"^(?P<path>[^:]+\.py):(?P<line>-?\d+)$")
_FUNC_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


class SiteList(ArgumentKind):
    """A str or a list/tuple of str, each a site, a file or a function name; stored as a tuple."""

    json_type = "array"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if isinstance(value, str):
            value = (value,)
        if not isinstance(value, (list, tuple)):
            raise UsageError(
                f"{where}: {name} must be a list of strings, each {_SITE_FORMS}; got {value!r} ({_type_name(value)})"
            )
        entries = []
        for entry in value:
            if not isinstance(entry, str):
                raise UsageError(
                    f"{where}: {name} entries must be strings, each {_SITE_FORMS}; "
                    f"got {entry!r} ({_type_name(entry)})"
                )
            text = entry.strip()
            site = _SITE_RE.match(text)
            if site:
                if int(site.group("line")) < 1:
                    raise UsageError(
                        f"{where}: {name} entry {entry!r} has line {site.group('line')}; lines start at 1"
                    )
            elif not (text.endswith(".py") and ":" not in text) and not _FUNC_RE.match(text):
                raise UsageError(f"{where}: {name} entry {entry!r} is not {_SITE_FORMS}")
            entries.append(text)
        return tuple(entries)

    def describe(self, meaning: str = "") -> str:
        return "a list of sites ('file.py:LINE'), files ('file.py') or function names"

    def schema(self) -> dict[str, Any]:
        return {"type": "array", "items": {"type": "string"}}


@dataclass(frozen=True)
class Argument:
    """One argument of ``@pytest.mark.torchperf`` / ``watch()``: its name, kind, default and meaning."""

    name: str
    kind: ArgumentKind
    default: Any
    doc: str
    #: Short meaning quoted in error messages (``"training steps whose recompiles count as warm-up"``).
    meaning: str = ""

    def validate(self, value: Any, where: str) -> Any:
        return self.kind.validate(value, where, self.name, self.meaning)
