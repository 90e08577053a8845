"""No green "not checked": what a watched test does when a default invariant could not check anything.

A default invariant (``no_host_sync``, ``on_device``...) that saw nothing to
judge (no training step, a probe that could not attach) reports "not
checked" with its reason. The session option ``--torchperf-not-checked``
(ini ``torchperf_not_checked``) decides what that does to the test:

- ``warn`` (the default): the test passes with a :class:`NotCheckedWarning`
  naming the test, the invariant and the reason;
- ``fail``: the test fails with that message (under ``--torchperf-report-only``
  it warns instead);
- ``pass``: nothing but the summary's count.

Only a test that trained and passed is judged so: one that saw no training
step has nothing to watch (the summary counts such tests in one line), and one
that failed or was skipped (by pytest, or by unittest, which records its own
outcome) says nothing more. The torchperf terminal summary counts the tests
with default invariants not checked in its headline; ``-v`` shows the reasons.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Optional

import pytest

from ..errors import suggest

if TYPE_CHECKING:
    from ..report import Report

NOT_CHECKED = "not checked"

__all__ = ["MODES", "NotCheckedWarning", "add_options", "is_default", "act", "resolve", "unchecked"]

MODES = ("warn", "fail", "pass")
_KEY = pytest.StashKey[str]()


class NotCheckedWarning(UserWarning):
    """A default invariant of a watched test could not check anything."""


def _mode_arg(value: str) -> str:
    if value not in MODES:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(MODES)}, got {value!r}{suggest(value, MODES)}")
    return value


def add_options(parser: pytest.Parser) -> None:
    """``--torchperf-not-checked`` and its ini twin."""
    group = parser.getgroup("torchperf")
    group.addoption(
        "--torchperf-not-checked",
        metavar="ACTION",
        type=_mode_arg,
        default=None,
        help="what a default invariant that could not check anything (no training step seen...) does to the "
        "test: warn (default: a warning naming the test and the reason), fail, or pass (ini: torchperf_not_checked)",
    )
    parser.addini("torchperf_not_checked", f"what a 'not checked' default invariant does: {', '.join(MODES)}",
                  type="string", default="")


def resolve(config: pytest.Config) -> str:
    """Command line > ini > ``warn``; an ini value is validated like the command line's. Stashed on ``config``."""
    mode = config.getoption("torchperf_not_checked", None)
    if mode is None:
        value = str(config.getini("torchperf_not_checked") or "").strip()
        if value:
            try:
                mode = _mode_arg(value)
            except argparse.ArgumentTypeError as exc:
                raise pytest.UsageError(f"pytest-torchperf: ini option torchperf_not_checked {exc}") from None
    config.stash[_KEY] = mode or "warn"
    return config.stash[_KEY]


def is_default(name: str) -> bool:
    """``name`` is an invariant that is on unless turned off, and not one that only checks what a run may lack
    (:attr:`~pytest_torchperf.registry.Invariant.conditional`: nothing compiled is nothing to warn about)."""
    from .. import registry
    try:
        invariant = registry.get(name)
    except Exception:  # noqa: BLE001 - a name from another session's JSON
        return False
    return bool(invariant.enabled(invariant.default)) and not invariant.conditional


def unchecked(report: Report) -> list[tuple[str, str]]:
    """``(name, reason)`` of the default invariants the run could not check."""
    return [(c.name, c.summary) for c in report.checks.values() if c.status == NOT_CHECKED and is_default(c.name)]


def act(item: pytest.Item, reports: Sequence[Report], report_only: bool = False) -> Optional[str]:
    """Warn, or return the text to fail with, for the default invariants a passing test's runs could not check.

    Only runs that saw a training step count: a test that trained nowhere (a configuration or tokenizer test
    under a suite-wide marker) has nothing to watch, and the summary counts it in one line. Called once the
    test's outcome is known, so a test that unittest recorded as skipped or failed is never here.
    """
    missing = [pair for report in reports if report.steps or _whole_test(report) for pair in unchecked(report)]
    mode = item.config.stash.get(_KEY, "warn")
    if not missing or mode == "pass":
        return None
    reasons = "; ".join(f"{name} not checked ({reason})" for name, reason in _grouped(missing))
    text = f"torchperf: {item.nodeid}: {reasons}"
    if mode == "fail" and not report_only:
        return f"{text} (--torchperf-not-checked=fail)"
    try:
        warnings.warn(NotCheckedWarning(text), stacklevel=2)
    except NotCheckedWarning as exc:  # -W error: the warning fails the test, as it would have in its body
        return f"NotCheckedWarning: {exc}"
    return None


def _whole_test(report: Report) -> bool:
    """The run watched the whole test (``scope="test"``): its body is the step, whether or not it trained."""
    return report.scope == "test"


def _grouped(missing: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """Invariants with the same reason named together: ``("no_host_sync, on_device", reason)``."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in missing:
        if name not in by_reason.setdefault(reason, []):
            by_reason[reason].append(name)
    return [(", ".join(names), reason) for reason, names in by_reason.items()]


def summary_parts(checks: dict[str, Any]) -> list[str]:
    """Names of the default invariants not checked in one test's JSON checks (for the session's count)."""
    return [name for name, c in checks.items() if c.get("status") == NOT_CHECKED and is_default(name)]
