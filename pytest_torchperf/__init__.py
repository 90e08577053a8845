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

from . import clocks  # noqa: F401 - first: the clock functions are bound before any test can patch them
from ._version import __version__
from .arguments import Argument, Choice, Flag, Integer, Number, SiteList, UsageError
from .core import EVENTS, Check, Run
from .marks import step
from .options import Options, parse_options
from .probes import Probe
from .registry import ENTRY_POINT_GROUP, Invariant, register, unregister
from .report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, InvariantViolation, Report, Site
from .timing import NotMirrored, ParityResult, parity, vanilla_fit
from .watch import watch
from . import ranks  # noqa: E402,F401 - registers multi-process support with watch (every rank observed)

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
