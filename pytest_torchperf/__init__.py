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


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        hint = " (plug-in API: from pytest_torchperf.extend import it)" if name in _MOVED_TO_EXTEND else ""
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}{hint}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

