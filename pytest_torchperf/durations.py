"""Durations and shares in marker arguments and reports: ``target_step_time="5ms"``, ``max_data_wait=0.2``.

:class:`Duration` accepts a string with a unit (``"5ms"``, ``"250us"``,
``"0.02 s"``) and keeps it as written (the JSON report's options show what the
user wrote); :func:`seconds` reads it. A bare number is refused, with the two
readings it could have had: a step time written ``5`` is as likely
milliseconds as seconds. :class:`Share` is a fraction from 0 to 1 that answers
``20`` with "did you mean 0.2?". Nothing here imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Optional

from .arguments import ArgumentKind, Fraction, UsageError

__all__ = ["Duration", "Share", "format_seconds", "seconds"]

#: Unit -> seconds.
_UNITS = {"ns": 1e-9, "us": 1e-6, "\u00b5s": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0, "min": 60.0}
_DURATION = re.compile(r"^\s*(?P<number>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?)\s*(?P<unit>[a-z\u00b5]+)\s*$")
_FORMS = "a duration string with a unit, such as '5ms', '250us' or '0.02s' (units: us, ms, s)"


def seconds(text: Optional[str]) -> Optional[float]:
    """``"5ms"`` -> 0.005; None stays None. The text must have passed :class:`Duration`."""
    if text is None:
        return None
    match = _DURATION.match(text.lower())
    if match is None or match.group("unit") not in _UNITS:
        raise ValueError(f"not a duration: {text!r}")
    return float(match.group("number")) * _UNITS[match.group("unit")]


def format_seconds(value: float) -> str:
    """``2.93 s``, ``12.4 ms``, ``250 us``: three significant figures, the unit that fits."""
    if value >= 1.0:
        return f"{value:.3g} s"
    if value >= 1e-3:
        return f"{value * 1e3:.3g} ms"
    return f"{value * 1e6:.3g} us"


@dataclass(frozen=True)
class Duration(ArgumentKind):
    """A positive duration written with its unit (``"5ms"``); ``None`` too when ``optional``."""

    optional: bool = True

    @property
    def json_type(self) -> Any:
        return ["string", "null"] if self.optional else "string"

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None and self.optional:
            return None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            guess = f"{value:g}"
            raise UsageError(
                f"{where}: {name} must be {_FORMS}, got {value!r} ({type(value).__name__}): "
                f"a bare number has no unit (did you mean '{guess}ms' or '{guess}s'?)"
            )
        if not isinstance(value, str):
            raise UsageError(f"{where}: {name} must be {_FORMS}, got {value!r} ({type(value).__name__})")
        match = _DURATION.match(value.lower())
        if match is None:
            raise UsageError(f"{where}: {name} must be {_FORMS}, got {value!r}")
        unit = match.group("unit")
        if unit not in _UNITS:
            close = {"msec": "ms", "millis": "ms", "usec": "us", "secs": "s", "seconds": "s", "second": "s"}
            hint = f" (did you mean '{match.group('number')}{close[unit]}'?)" if unit in close else ""
            raise UsageError(f"{where}: {name} must be {_FORMS}, got {value!r}: unknown unit {unit!r}{hint}")
        amount = seconds(value)
        if amount is None or not math.isfinite(amount) or amount <= 0:
            raise UsageError(f"{where}: {name} must be a duration above zero, got {value!r}")
        return value.strip()

    def describe(self, meaning: str = "") -> str:
        about = f" ({meaning})" if meaning else ""
        return "a duration such as '5ms', '250us' or '0.02s'" + about + (" or None" if self.optional else "")

    def schema(self) -> dict[str, Any]:
        pattern = r"^\s*(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*(ns|us|µs|ms|s|sec|min)\s*$"
        return {"type": self.json_type, "pattern": pattern}


@dataclass(frozen=True)
class Share(Fraction):
    """A fraction from 0 to 1 (``0.2`` means 20%); a percentage given by mistake gets "did you mean 0.2?"."""

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if (
            isinstance(value, (int, float))
            and not isinstance(value, bool)
            and math.isfinite(value)
            and 1 < value <= 100
        ):
            raise UsageError(
                f"{where}: {name} must be {self.describe(meaning)}, got {value!r} (did you mean {value / 100:g}?)"
            )
        return super().validate(value, where, name, meaning)
