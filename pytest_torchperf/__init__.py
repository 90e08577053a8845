"""pytest-torchperf: turn PyTorch and Lightning performance bugs into failing tests.

Importing this package never imports torch; torch is imported when a run starts.

    from pytest_torchperf import watch

    with watch() as run:
        for batch in loader:
            with run.step():
                ...
    print(run.report.render())

Third-party invariants: declare an :class:`Invariant` with a :class:`Check`
class (and, if they need to patch something of their own, a :class:`Probe`),
and register it through the ``pytest_torchperf.invariants`` entry point group
or :func:`register`.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from . import clocks  # noqa: F401 - first: the clock functions are bound before any test can patch them
from ._version import __version__

if TYPE_CHECKING:  # what the names below are; at run time each module loads on first use
    from .arguments import Argument, Choice, Flag, Integer, Number, SiteList, UsageError
    from .core import EVENTS, Check, Run
    from .marks import step
    from .options import Options, parse_options
    from .probes import Probe
    from .registry import ENTRY_POINT_GROUP, Invariant, register, unregister
    from .report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, InvariantViolation, Report, Site
    from .status import Status
    from .timing import NotMirrored, ParityResult, parity, vanilla_fit  # type: ignore[no-redef,unused-ignore]
    from .watch import watch

#: Public name -> the module that defines it (imported the first time the name is read).
_LAZY = {
    **dict.fromkeys(("Argument", "Choice", "Flag", "Integer", "Number", "SiteList", "UsageError"), "arguments"),
    **dict.fromkeys(("EVENTS", "Check", "Run"), "core"),
    "step": "marks",
    **dict.fromkeys(("Options", "parse_options"), "options"),
    "Probe": "probes",
    **dict.fromkeys(("ENTRY_POINT_GROUP", "Invariant", "register", "unregister"), "registry"),
    **dict.fromkeys(
        ("FAILED", "NOT_CHECKED", "PASSED", "CheckResult", "Finding", "InvariantViolation", "Report", "Site"), "report"
    ),
    "Status": "status",
    **dict.fromkeys(("NotMirrored", "ParityResult", "parity", "vanilla_fit"), "timing"),
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY) | {"watch"})


class _Package(types.ModuleType):
    """The package's module type: ``pytest_torchperf.watch`` is the function, loaded on first use.

    (The submodule of the same name, once imported, would otherwise replace it on the package.)
    """

    @property
    def watch(self) -> Any:
        from .watch import watch

        return watch

    @watch.setter
    def watch(self, value: Any) -> None:  # the import system records the submodule here: keep the function
        pass


sys.modules[__name__].__class__ = _Package

__all__ = [
    "Argument",
    "Check",
    "CheckResult",
    "Choice",
    "ENTRY_POINT_GROUP",
    "EVENTS",
    "FAILED",
    "Finding",
    "Flag",
    "Integer",
    "Invariant",
    "InvariantViolation",
    "NOT_CHECKED",
    "NotMirrored",
    "Number",
    "Options",
    "PASSED",
    "ParityResult",
    "Probe",
    "Report",
    "Run",
    "Site",
    "SiteList",
    "Status",
    "UsageError",
    "parity",
    "parse_options",
    "register",
    "step",
    "unregister",
    "vanilla_fit",
    "watch",
    "__version__",
]
