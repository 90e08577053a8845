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

from .options import Options, UsageError, parse_options
from .report import CheckResult, Finding, InvariantViolation, Report, Site
from .watch import Run, watch

__version__ = "0.1.0"

__all__ = [
    "CheckResult",
    "Finding",
    "InvariantViolation",
    "Options",
    "Report",
    "Run",
    "Site",
    "UsageError",
    "parse_options",
    "watch",
    "__version__",
]
