"""pytest-torchperf: turn PyTorch and Lightning performance bugs into failing tests.

Importing this package never imports torch; torch is imported when a run starts.

    from pytest_torchperf import watch

    with watch() as run:
        for batch in loader:
            with run.step():
                ...
    print(run.report.render())
"""

from __future__ import annotations

from ._version import __version__
from .options import Options, UsageError, parse_options
from .report import CheckResult, Finding, InvariantViolation, Report, Site
from .timing import NotMirrored, ParityResult, parity, vanilla_fit
from .watch import Run, watch

__all__ = [
    "CheckResult",
    "Finding",
    "InvariantViolation",
    "NotMirrored",
    "Options",
    "ParityResult",
    "Report",
    "Run",
    "Site",
    "UsageError",
    "parity",
    "parse_options",
    "vanilla_fit",
    "watch",
    "__version__",
]
