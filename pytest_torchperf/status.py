"""A verdict's status: one enum, string-compatible (``Status.FAILED == "failed"``, JSON writes the string)."""

from __future__ import annotations

import enum

__all__ = ["Status"]


class Status(str, enum.Enum):
    """What a check concluded. Members are ``str``: they compare, hash and serialise as their value."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_CHECKED = "not checked"
    #: A measured verdict that could not be confirmed either way (``max_overhead`` whose interval straddles it).
    INCONCLUSIVE = "inconclusive"

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    @classmethod
    def of(cls, value: str) -> Status:
        """The member of ``value`` (a member or its string); ValueError naming the statuses otherwise."""
        try:
            return cls(value)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise ValueError(f"{value!r} is not a torchperf status; allowed: {allowed}") from None
