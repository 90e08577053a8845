"""One report from many processes: every invariant's verdict over the ranks, each finding labelled.

A launching process's run has its own report (the *main process*, or
``rank 0`` when it trains too, as under Lightning's ``ddp``) and one report per
rank process it launched. :func:`merge` makes one :class:`RankedReport` of
them, invariant by invariant:

- failed when any process failed it; the findings of every process, each
  prefixed with the processes that made it (``rank 0, 1: 4 syncs at
  model.py:12 ...``), identical findings of several ranks told once;
- not checked when a rank did not check it (no step seen, no report, the rank
  raised): a rank that saw nothing is never counted as a pass;
- passed when every rank passed it (the main process of a spawn launcher trains
  nothing: its own "not checked" is left out once ranks reported).

Per-process verdicts and figures stay in the result's ``processes`` (``rank0``, ``rank1``,
``main``); the top-level figures are those of the process that decided the
verdict (the first that failed, else the first reported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..report import FAILED, INCONCLUSIVE, NOT_CHECKED, PASSED, Block, CheckResult, Finding, Report

__all__ = ["Part", "RankedReport", "merge", "label_of"]


@dataclass
class Part:
    """What one process reported for one run: its report, or why there is none."""

    rank: Optional[int]  # None: the main process (launched the ranks, trained nothing itself)
    report: Optional[Report] = None
    pid: Optional[int] = None
    launcher: str = ""
    #: The exception that ended the rank's work: ``{"type", "message", "where", "traceback"}``.
    error: Optional[dict[str, Any]] = None
    #: Why no report came back (the process died, or never reached the end of its watch).
    missing: str = ""

    @property
    def label(self) -> str:
        return "main process" if self.rank is None else f"rank {self.rank}"

    @property
    def key(self) -> str:
        return "main" if self.rank is None else f"rank{self.rank}"

    def why_not_checked(self) -> Optional[str]:
        """Why this process's verdicts cannot count as passes, if they cannot."""
        if self.missing:
            return self.missing
        if self.error is not None:
            where = f" at {self.error['where']}" if self.error.get("where") else ""
            return f"raised {self.error.get('type', 'an exception')}: {self.error.get('message', '')}{where}"
        return None


def label_of(parts: list[Part]) -> str:
    """``"rank 0, 1"``, ``"main process"``, ``"main process and rank 0"``."""
    ranks = sorted(p.rank for p in parts if p.rank is not None)
    words = []
    if any(p.rank is None for p in parts):
        words.append("main process")
    if ranks:
        words.append("rank " + ", ".join(str(r) for r in ranks))
    return " and ".join(words)


@dataclass
class RankedReport(Report):
    """A :class:`Report` merged over the processes of a multi-process run."""

    #: One entry per process: rank, pid, launcher, steps, verdicts, error.
    ranks: list[dict[str, Any]] = field(default_factory=list)
    #: Lines telling which rank raised or sent no report.
    rank_problems: list[str] = field(default_factory=list)

    def blocks(self, verbose: bool = False) -> list[Block]:
        blocks = super().blocks(verbose)
        if self.rank_problems:
            blocks.append(Block(None, list(self.rank_problems)))
        return blocks

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["ranks"] = [dict(r) for r in self.ranks]
        return data


def _result(part: Part, name: str) -> CheckResult:
    """``part``'s verdict on ``name``, made "not checked" when the part cannot vouch for a pass."""
    check = part.report.checks.get(name) if part.report is not None else None
    why = part.why_not_checked()
    if check is None:
        reason = why or "this invariant is not registered in that process"
        return CheckResult(name, NOT_CHECKED, reason)
    if why is not None and check.status == PASSED:
        return CheckResult(name, NOT_CHECKED, why, 0, check.findings, check.figures)
    return check


def _grouped_summary(items: list[tuple[Part, CheckResult]], with_status: bool = False) -> str:
    """``"rank 0, 1: <summary>; rank 2: <summary>"`` (each status too, with ``with_status``, when they differ)."""
    with_status = with_status and len({check.status for _, check in items}) > 1
    groups: dict[str, list[Part]] = {}
    for part, check in items:
        text = f"{check.status} ({check.summary})" if with_status else check.summary
        groups.setdefault(text, []).append(part)
    return "; ".join(f"{label_of(parts)}: {text}" for text, parts in groups.items())


def _finding_key(finding: Finding) -> tuple:
    sites = tuple((s.label, s.frame.location() if s.frame else None, s.count) for s in finding.sites)
    return (finding.title, tuple(finding.facts), finding.hint, sites)


def _findings(items: list[tuple[Part, CheckResult]]) -> list[Finding]:
    grouped: dict[tuple, tuple[Finding, list[Part]]] = {}
    for part, check in items:
        for finding in check.findings:
            key = _finding_key(finding)
            if key in grouped:
                grouped[key][1].append(part)
            else:
                grouped[key] = (finding, [part])
    return [
        Finding(f"{label_of(parts)}: {finding.title}", list(finding.facts), list(finding.sites), finding.hint)
        for finding, parts in grouped.values()
    ]


def merge_check(name: str, parts: list[Part]) -> CheckResult:
    """One verdict on invariant ``name`` over ``parts`` (see the module's docstring)."""
    every = [(part, _result(part, name)) for part in parts]
    per_process = {
        part.key: {"status": check.status, "summary": check.summary, "figures": dict(check.figures)}
        for part, check in every
    }
    ranked = [(p, c) for p, c in every if p.rank is not None]
    results = every
    if ranked:  # the main process counts only for what it did check itself
        results = ranked + [(p, c) for p, c in every if p.rank is None and c.status != NOT_CHECKED]
    failed = [(p, c) for p, c in results if c.status == FAILED]
    unchecked = [(p, c) for p, c in ranked if c.status == NOT_CHECKED]
    if failed:
        status, deciding = FAILED, failed
        summary = _grouped_summary(failed)
        count = sum(c.count for _, c in failed)
        ordered = failed + [(p, c) for p, c in results if c.status != FAILED]
    elif any(c.status == INCONCLUSIVE for _, c in results):
        status = INCONCLUSIVE
        deciding = [(p, c) for p, c in results if c.status == INCONCLUSIVE]
        summary = _grouped_summary(deciding)
        count = 0
        ordered = deciding + [(p, c) for p, c in results if c.status != INCONCLUSIVE]
    elif unchecked:
        status, deciding = NOT_CHECKED, unchecked
        summary = _grouped_summary(results, with_status=True)
        count = 0
        ordered = results
    elif results and all(c.status == PASSED for _, c in results):
        status, deciding = PASSED, results
        summary = _grouped_summary(results)
        count = 0
        ordered = results
    else:
        status, deciding = NOT_CHECKED, results
        summary = _grouped_summary(results, with_status=True) if results else "no process checked it"
        count = 0
        ordered = results
    figures = dict(deciding[0][1].figures) if deciding else {}
    return CheckResult(name, status, summary, count, _findings(ordered), figures, per_process)


def merge(parts: list[Part]) -> RankedReport:
    """One report over ``parts`` (the launching process's own first)."""
    names: list[str] = []
    for part in parts:
        for name in part.report.checks if part.report is not None else ():
            if name not in names:
                names.append(name)
    own = next((p.report for p in parts if p.report is not None), None)
    merged = RankedReport(
        steps=sum(p.report.steps for p in parts if p.report is not None),
        on_inconclusive=own.on_inconclusive if own is not None else "fail",
    )
    for name in names:
        merged.checks[name] = merge_check(name, parts)
    for part in parts:
        if part.report is None:
            continue
        for where, message in part.report.internal_errors.items():
            merged.internal_errors[where if part.rank is None else f"{where} ({part.label})"] = message
    for part in parts:
        checks = part.report.checks.values() if part.report is not None else ()
        merged.ranks.append({
            "process": part.label,
            "rank": part.rank,
            "pid": part.pid,
            "launcher": part.launcher,
            "steps": part.report.steps if part.report is not None else None,
            "passed": bool(part.report is not None and part.report.passed and part.why_not_checked() is None),
            "error": part.error,
            "missing": part.missing or None,
            "checks": {c.name: {"status": c.status, "summary": c.summary} for c in checks},
        })
        if part.error is not None:
            line = f"torchperf: {part.label} (pid {part.pid}) {part.why_not_checked()}"
            merged.rank_problems.append(line)
            merged.rank_problems.extend(f"  {text}" for text in part.error.get("traceback", [])[-6:])
        elif part.missing:
            merged.rank_problems.append(f"torchperf: {part.label}: {part.missing}")
    return merged
