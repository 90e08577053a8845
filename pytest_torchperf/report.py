"""Verdicts and their rendering: what a watched run found, as text and as data.

A :class:`Report` holds one :class:`CheckResult` per invariant. It renders to
a list of :class:`Block` (a separator title plus lines), so the pytest plugin
can draw real separators on the terminal while scripts get plain text.
"""

from __future__ import annotations

import unittest
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .stacks import Frame, Stack, format_stack, site_of
from .status import Status

__all__ = [
    "PASSED",
    "FAILED",
    "NOT_CHECKED",
    "INCONCLUSIVE",
    "Status",
    "Site",
    "Finding",
    "CheckResult",
    "Report",
    "InvariantViolation",
    "Inconclusive",
    "InconclusiveWarning",
    "settle",
]

#: The statuses as plain strings, the values of :class:`Status` (``Status.FAILED == FAILED == "failed"``):
#: data that travels (xdist, rank reports, JSON) holds only plain strings.
PASSED: str = Status.PASSED.value
FAILED: str = Status.FAILED.value
NOT_CHECKED: str = Status.NOT_CHECKED.value
#: A measured verdict that could not be confirmed either way (``max_overhead`` whose interval straddles the threshold).
INCONCLUSIVE: str = Status.INCONCLUSIVE.value

#: Without ``-v``, a report shows at most this many findings per invariant and sites per finding.
MAX_FINDINGS = 5
MAX_SITES = 3


@dataclass
class Site:
    """Where something happened: a labelled stack and how often it happened there."""

    label: str
    stack: Stack
    count: int = 1

    @property
    def frame(self) -> Optional[Frame]:
        return site_of(self.stack)

    def render(self, verbose: bool) -> list[str]:
        frame = self.frame
        times = f" ({self.count}x)" if self.count > 1 else ""
        if frame is None:
            return [f"  {self.label}{times}: <no stack>"]
        whose = "your code" if frame.is_user else frame.kind + " code"
        lines = [f"  {self.label}{times} at {frame.location()} in {frame.function} [{whose}]"]
        if frame.source:
            lines.append(f"      {frame.source}")
        lines.append("    stack (most recent call last; > marks your code):")
        lines.extend(format_stack(self.stack, indent="    "))
        return lines

    def to_dict(self) -> dict[str, Any]:
        frame = self.frame
        return {
            "label": self.label,
            "count": self.count,
            "site": frame.location() if frame else None,
            "function": frame.function if frame else None,
            "source": frame.source if frame else None,
            "user_code": bool(frame and frame.is_user),
            "stack": [f"{f.location()} in {f.function}" for f in self.stack],
        }


@dataclass
class Finding:
    """One thing that broke an invariant (a loader, a call site...)."""

    title: str
    facts: list[str] = field(default_factory=list)
    sites: list[Site] = field(default_factory=list)
    hint: str = ""
    #: A note about a framework's own code (``(owner, site, count)``: ``("pytorch_lightning", "result.py:199", 1)``):
    #: beside a failure, such notes are summarised in one line unless verbose (see :meth:`CheckResult.render`).
    framework_note: Optional[tuple[str, str, int]] = None

    def render(self, verbose: bool) -> list[str]:
        lines = [self.title]
        lines.extend(f"  {fact}" for fact in self.facts)
        shown = self.sites if verbose else self.sites[:MAX_SITES]
        for s in shown:
            lines.extend(s.render(verbose))
        if len(shown) < len(self.sites):
            lines.append(f"  ... {len(self.sites) - len(shown)} more sites (-v shows all)")
        if self.hint:
            lines.append(f"  hint: {self.hint}")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "facts": list(self.facts),
            "sites": [s.to_dict() for s in self.sites],
            "hint": self.hint,
        }


@dataclass
class CheckResult:
    """The verdict of one invariant for one watched run."""

    name: str
    status: str
    summary: str
    count: int = 0
    findings: list[Finding] = field(default_factory=list)
    #: The invariant's own figures: the keys its declared ``figures`` type names (see
    #: :mod:`pytest_torchperf.figures`), never the engine's.
    figures: Mapping[str, Any] = field(default_factory=dict)
    #: A verdict merged over the processes of a multi-process run: each process's (``rank0``, ``rank1``,
    #: ``main``) status, summary and figures (:mod:`pytest_torchperf.ranks.merge`); empty for one process.
    processes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.status, Status):  # a plug-in's Status member: kept as its plain string
            self.status = self.status.value

    @property
    def failed(self) -> bool:
        return self.status == FAILED

    @property
    def inconclusive(self) -> bool:
        return self.status == INCONCLUSIVE

    def render(self, verbose: bool) -> list[str]:
        lines: list[str] = []
        findings = self.findings
        notes: list[tuple[str, str, int]] = []
        if not verbose and any(f.framework_note is None for f in findings):
            # Beside a failure of your code, the framework's own notes are one line (-v shows them).
            notes = [f.framework_note for f in findings if f.framework_note is not None]
            findings = [f for f in findings if f.framework_note is None]
        shown = findings if verbose else findings[:MAX_FINDINGS]
        for i, finding in enumerate(shown):
            if i:
                lines.append("")
            lines.extend(finding.render(verbose))
        if len(shown) < len(findings):
            lines.append(f"... {len(findings) - len(shown)} more findings (-v shows all)")
        if notes:
            owners = sorted({owner for owner, _, _ in notes})
            sites = ", ".join(dict.fromkeys(site for _, site, _ in notes))
            count = sum(n for _, _, n in notes)
            lines.append("")
            lines.append(
                f"note: {count} more from {' and '.join(owners)}'s own code ({sites}), not from yours: "
                "notes, not failures (-v shows them)"
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.status == PASSED,
            "status": self.status,
            "summary": self.summary,
            "count": self.count,
            "figures": dict(self.figures),
            "findings": [f.to_dict() for f in self.findings],
            **({"processes": {k: dict(v) for k, v in self.processes.items()}} if self.processes else {}),
        }


@dataclass
class Block:
    """A titled part of a rendered report; ``title`` None means no separator."""

    title: Optional[str]
    lines: list[str]


@dataclass
class Report:
    """Everything a watched run concluded, one :class:`CheckResult` per invariant."""

    checks: dict[str, CheckResult] = field(default_factory=dict)
    steps: int = 0
    #: Probe (or ``check <name>``) -> the error in torchperf's own code that made checks "not checked".
    internal_errors: dict[str, str] = field(default_factory=dict)
    #: What an inconclusive verdict does to the run: "fail" it, "skip" it or "warn" (see :func:`settle`).
    on_inconclusive: str = "fail"
    #: How the steps were found when nothing marked them (``"found at optimizer.step()"``), else "".
    steps_found: str = ""
    #: The run's scope: ``"test"`` watched the whole test as its one step, trained or not.
    scope: str = "training_step"

    @property
    def failures(self) -> list[CheckResult]:
        """Broken invariants, and inconclusive ones when they fail the run."""
        fail_unsure = self.on_inconclusive == "fail"
        return [c for c in self.checks.values() if c.failed or (fail_unsure and c.inconclusive)]

    @property
    def inconclusive(self) -> list[CheckResult]:
        return [c for c in self.checks.values() if c.inconclusive]

    @property
    def passed(self) -> bool:
        return not self.failures

    def __getitem__(self, name: str) -> CheckResult:
        return self.checks[name]

    def summary_line(self) -> str:
        failures = self.failures
        if not failures:
            checked = [c.name for c in self.checks.values() if c.status == PASSED]
            line = f"torchperf: all invariants held ({', '.join(checked) or 'none checked'})"
            if self.inconclusive:
                line += "; " + self.inconclusive_line()
            return line + self._steps_text()
        parts = []
        broken = [c for c in failures if c.failed]
        unsure = [c for c in failures if c.inconclusive]
        if broken:
            noun = "invariant" if len(broken) == 1 else "invariants"
            parts.append(f"{len(broken)} {noun} broken: " + "; ".join(f"{c.name} ({c.summary})" for c in broken))
        if unsure:
            parts.append(self.inconclusive_line())
        return "torchperf: " + "; ".join(parts) + self._steps_text()

    def _steps_text(self) -> str:
        """``"; steps: 24, found at optimizer.step()"`` when the steps were found automatically."""
        return f"; steps: {self.steps}, {self.steps_found}" if self.steps_found else ""

    def inconclusive_line(self) -> str:
        """``inconclusive: max_overhead (+48.1% over vanilla loop (95% CI ...) straddles 50%)``."""
        return "inconclusive: " + "; ".join(f"{c.name} ({c.summary})" for c in self.inconclusive)

    def blocks(self, verbose: bool = False) -> list[Block]:
        blocks = [Block(None, [self.summary_line()])]
        for check in self.failures:
            blocks.append(Block(f"torchperf: {check.name}", check.render(verbose)))
        others = [c for c in self.checks.values() if not c.failed]
        if others and self.failures:
            blocks.append(
                Block(None, [f"{c.name}: {c.status} ({c.summary})" for c in others])
            )
        if self.internal_errors:
            blocks.append(Block(None, [
                f"torchperf internal error in {_what(where)}: {message} (your code ran as if unwatched; "
                "please report it)"
                for where, message in self.internal_errors.items()
            ]))
        return blocks

    def render(self, verbose: bool = False, width: int = 80) -> str:
        out: list[str] = []
        for block in self.blocks(verbose):
            if block.title is not None:
                out.append(_sep(block.title, width))
            out.extend(block.lines)
        return "\n".join(out)

    def to_dict(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "steps": self.steps,
            "steps_found": self.steps_found,
            "checks": {name: c.to_dict() for name, c in self.checks.items()},
            "internal_errors": dict(self.internal_errors),
        }


def _what(where: str) -> str:
    return where if where.startswith("check ") or where == "undo" else f"probe {where}"


def _sep(title: str, width: int) -> str:
    text = f" {title} "
    side = max((width - len(text)) // 2, 3)
    return "-" * side + text + "-" * side


class InvariantViolation(AssertionError):
    """Raised when a watched run ends cleanly with at least one broken invariant."""

    def __init__(self, report: Report) -> None:
        super().__init__(report.summary_line())
        self.report = report

    def __str__(self) -> str:
        return self.report.render()


class Inconclusive(unittest.SkipTest):
    """Raised when a run's only doubtful verdicts are inconclusive and they are to skip the test.

    A :class:`unittest.SkipTest`, so pytest and unittest report the test as
    skipped; ``report`` carries the verdicts.
    """

    def __init__(self, report: Report) -> None:
        super().__init__(f"torchperf: {report.inconclusive_line()}")
        self.report = report


class InconclusiveWarning(UserWarning):
    """Emitted when an inconclusive verdict is to pass with a warning."""


def settle(report: Report, *, fail: bool = True) -> None:
    """Act on a finished run's verdicts: raise :class:`InvariantViolation` for failures (unless ``fail`` is
    false), else skip (:class:`Inconclusive`) or warn (:class:`InconclusiveWarning`) for inconclusive ones,
    as ``report.on_inconclusive`` says."""
    if not report.passed:
        if fail:
            raise InvariantViolation(report)
        return
    if not report.inconclusive:
        return
    if report.on_inconclusive == "skip":
        raise Inconclusive(report)
    if report.on_inconclusive == "warn":
        text = f"torchperf: {report.inconclusive_line()}: passed with a warning (overhead_inconclusive='warn')"
        warnings.warn(InconclusiveWarning(text), stacklevel=3)


def merge_sites(sites: Sequence[Site]) -> list[Site]:
    """Group sites by (label, location of the site frame), summing counts; first stack wins."""
    merged: dict[tuple[str, Optional[str]], Site] = {}
    for s in sites:
        frame = s.frame
        key = (s.label, frame.location() if frame else None)
        if key in merged:
            merged[key].count += s.count
        else:
            merged[key] = Site(s.label, s.stack, s.count)
    return list(merged.values())
