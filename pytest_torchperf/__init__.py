"""pytest-torchperf: turn PyTorch and Lightning performance bugs into failing tests.

This module is the front door for users; plug-in authors (a third-party
invariant, check or probe) import from :mod:`pytest_torchperf.extend`.
Importing this package never imports torch; each name below loads its module
the first time it is read (PEP 562), and torch is imported when a run starts.

    from pytest_torchperf import watch

    with watch() as run:
        for batch in loader:
            with run.step():
                ...
    print(run.report.render())

The names, by what they are for:

- watching: :func:`watch` (the context manager; keyword arguments as the
  marker's), :class:`Run` (what it yields), :class:`step` (mark a step where
  no run object is at hand);
- options: :class:`Options`, :func:`parse_options` (validate the marker's
  arguments ahead of a run);
- verdicts: :class:`Report` (``run.report``), :class:`CheckResult`,
  :class:`Finding`, :class:`Site`, :class:`Status`, and the errors and
  warnings: :class:`InvariantViolation` (a broken invariant),
  :class:`UsageError` (a bad argument), :class:`NotCheckedWarning` (an
  invariant that could not be checked, for ``-W`` filters);
- timing (``max_overhead``'s measurement, usable alone): :func:`parity`,
  :class:`ParityResult`, :func:`vanilla_fit`, :class:`NotMirrored`.

``Run``, ``CheckResult``, ``Finding``, ``Site``, ``Status`` and ``UsageError``
are also in :mod:`pytest_torchperf.extend`: they are the seam between the two
(a check reads a run and builds the results a user reads; both raise or catch
a usage error).
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import clocks  # noqa: F401 - first: the clock functions are bound before any test can patch them
from ._version import __version__

if TYPE_CHECKING:  # what the names below are; at run time each module loads on first use
    from .core import Run
    from .errors import UsageError
    from .glue.unchecked import NotCheckedWarning
    from .marks import step
    from .options import Options, parse_options
    from .report import CheckResult, Finding, InvariantViolation, Report, Site
    from .status import Status
    from .timing import NotMirrored, ParityResult, parity, vanilla_fit  # type: ignore[no-redef,unused-ignore]
    from .watching import watch

__all__ = [
    "CheckResult",
    "Finding",
    "InvariantViolation",
    "NotCheckedWarning",
    "NotMirrored",
    "Options",
    "ParityResult",
    "Report",
    "Run",
    "Site",
    "Status",
    "UsageError",
    "__version__",
    "parity",
    "parse_options",
    "step",
    "vanilla_fit",
    "watch",
]

#: Public name -> the module that defines it (imported the first time the name is read).
_LAZY = {
    "watch": "watching",
    "Run": "core",
    "step": "marks",
    **dict.fromkeys(("Options", "parse_options"), "options"),
    **dict.fromkeys(("CheckResult", "Finding", "InvariantViolation", "Report", "Site"), "report"),
    "Status": "status",
    "UsageError": "errors",
    "NotCheckedWarning": "glue.unchecked",
    **dict.fromkeys(("NotMirrored", "ParityResult", "parity", "vanilla_fit"), "timing"),
}

#: The plug-in names this module offered until 0.1 (now in :mod:`pytest_torchperf.extend` only): reading
#: one here says where it went. (``PASSED``, ``FAILED``, ``NOT_CHECKED``: :class:`Status` members.)
_MOVED_TO_EXTEND = frozenset(
    ("Argument", "Check", "Choice", "ENTRY_POINT_GROUP", "EVENTS", "Flag", "Integer", "Invariant", "Number")
    + ("Probe", "SiteList", "register", "unregister")
)


_PACKAGE = sys.modules[__name__]
#: Package name -> (the package, the size of its namespace, its submodules and whether each is a package) when
#: last read.
_SUBMODULES: dict[str, tuple[ModuleType, int, list[tuple[str, ModuleType, bool]]]] = {}


def _rejoin_modules() -> None:
    """Put back in ``sys.modules`` this package's modules that were taken out of it while in use.

    An in-process pytest session (pytester's ``runpytest``) restores ``sys.modules`` when it ends: every module
    first imported during it is taken out, while this package, the plug-in and the engine keep using them. An
    import would then load a second copy, with its own globals (the engine and its probes, a probe's tables,
    the hot paths' flags), beside the first, and a verdict would depend on which tests ran before. Called before
    the front doors import anything (this package's names, :mod:`pytest_torchperf.extend`), when a pytest session
    is configured and when a run starts: one copy per process, as when nothing is restored.
    """
    modules = sys.modules
    modules.setdefault(__name__, _PACKAGE)
    packages = [_PACKAGE]
    while packages:
        for name, module, is_package in _submodules(packages.pop()):
            # setdefault: a second copy imported meanwhile stays (the first is then out of reach)
            if modules.setdefault(name, module) is module and is_package:
                packages.append(module)


def _submodules(package: ModuleType) -> list[tuple[str, ModuleType, bool]]:
    """The submodules the import system has set on ``package`` (read again when its namespace grows)."""
    namespace = vars(package)
    known = _SUBMODULES.get(package.__name__)
    if known is None or known[0] is not package or known[1] != len(namespace):
        prefix = package.__name__ + "."
        found = [
            (value.__name__, value, hasattr(value, "__path__"))
            for key, value in list(namespace.items())
            if isinstance(value, ModuleType) and value.__name__ == prefix + key
        ]
        known = _SUBMODULES[package.__name__] = (package, len(namespace), found)
    return known[2]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        hint = " (plug-in API: from pytest_torchperf.extend import it)" if name in _MOVED_TO_EXTEND else ""
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
    _rejoin_modules()
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

