"""The invariants. One module per invariant: its probe (what it patches) and its verdict.

A check is a small object created per run with ``result() -> CheckResult``;
a probe is a module-level ``install(patcher)`` that patches torch or Lightning
once while any run is active and forwards what it sees to the active runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol

from ..report import NOT_CHECKED, CheckResult

if TYPE_CHECKING:
    from ..patching import Patcher
    from ..watch import Run

__all__ = ["Check", "make_checks", "install_probes"]


class Check(Protocol):
    name: str

    def result(self) -> CheckResult: ...


class NotChecked:
    """An invariant this version of torchperf cannot check yet: reported, never passed."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    def result(self) -> CheckResult:
        return CheckResult(self.name, NOT_CHECKED, self.reason)


_NOT_YET = "not implemented yet in this version of pytest-torchperf"


def make_checks(run: "Run") -> dict[str, Check]:
    """The check objects for ``run``, one per invariant its options enable."""
    from .iterators import IteratorResetCheck

    factories: dict[str, Callable[[], Check]] = {
        "no_iterator_reset": lambda: IteratorResetCheck(run),
        "no_host_sync": lambda: NotChecked("no_host_sync", _NOT_YET),
        "on_device": lambda: NotChecked("on_device", _NOT_YET),
        "max_overhead": lambda: NotChecked("max_overhead", _NOT_YET),
    }
    return {name: factories[name]() for name in run.options.enabled_checks}


def install_probes(patcher: "Patcher") -> None:
    """Patch torch (and Lightning, now or when it gets imported) for the active runs."""
    from .. import lightning
    from . import iterators

    iterators.install(patcher)
    lightning.install(patcher)
