"""A rank's report on the wire: lossless JSON for a :class:`~pytest_torchperf.report.Report`, and its file.

A rank process writes one file per watched run it reports for; the process
that launched it reads them back when its own run ends. A file is written to a
temporary name and renamed, so a reader never sees half of one. Stacks keep
their ``(file, line, function)`` frames, so the launching process renders a
rank's findings exactly as it renders its own (source lines are read there,
from the same files).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from ..report import CheckResult, Finding, Report, Site
from ..stacks import Frame

__all__ = ["VERSION", "report_to_data", "report_from_data", "write_json", "read_json"]

#: Bumped when the layout changes; a reader ignores files of another version.
VERSION = 1


def _site(site: Site) -> dict[str, Any]:
    return {"label": site.label, "count": site.count, "stack": [[f.filename, f.lineno, f.function] for f in site.stack]}


def _finding(finding: Finding) -> dict[str, Any]:
    return {
        "title": finding.title,
        "facts": list(finding.facts),
        "sites": [_site(s) for s in finding.sites],
        "hint": finding.hint,
    }


def _check(check: CheckResult) -> dict[str, Any]:
    return {
        "name": check.name,
        "status": check.status,
        "summary": check.summary,
        "count": check.count,
        "findings": [_finding(f) for f in check.findings],
        "figures": dict(check.figures),
        "processes": check.processes,
    }


def report_to_data(report: Report) -> dict[str, Any]:
    """Everything :func:`report_from_data` needs to rebuild ``report``."""
    return {
        "steps": report.steps,
        "checks": [_check(c) for c in report.checks.values()],
        "internal_errors": dict(report.internal_errors),
    }


def report_from_data(data: dict[str, Any]) -> Report:
    report = Report(steps=int(data.get("steps", 0)))
    for c in data.get("checks", []):
        findings = [
            Finding(
                f["title"],
                list(f.get("facts", [])),
                [
                    Site(
                        s["label"],
                        tuple(Frame(str(a), int(b), str(c)) for a, b, c in s.get("stack", [])),
                        s.get("count", 1),
                    )
                    for s in f.get("sites", [])
                ],
                f.get("hint", ""),
            )
            for f in c.get("findings", [])
        ]
        report.checks[c["name"]] = CheckResult(
            c["name"], c["status"], c["summary"], c.get("count", 0), findings, dict(c.get("figures", {})),
            dict(c.get("processes", {})),
        )
    report.internal_errors = dict(data.get("internal_errors", {}))
    return report


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` atomically (figures that are not JSON become their ``str``)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, default=str)
    os.replace(tmp, path)


def read_json(path: str) -> Optional[dict[str, Any]]:
    """The data in ``path``, or None when it is missing, unreadable or of another version."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("version") != VERSION:
        return None
    return data
