"""Session results as data: the JSON report and the JUnit properties.

pytest-free: the plugin feeds it one entry per test (on the xdist controller,
from the reports the workers send), and it writes one JSON document per
session. The schema is versioned by ``SCHEMA_VERSION``::

    {
      "schema_version": 2,
      "created": "2026-11-29T19:40:00+00:00",
      "environment": {"python": "3.11.7", "platform": "...", "torch": "2.13.0+cpu",
                      "pytorch_lightning": "2.6.6", "lightning": null, "pytest": "9.2.0",
                      "pytest_torchperf": "0.1.0", "cuda_available": false, "device": "cpu",
                      "xdist_workers": 2},
      "summary": {"tests": 3, "failed": 1, "checks_failed": {"no_iterator_reset": 1}, "checks_inconclusive": {}},
      "tests": [
        {"nodeid": "tests/test_fit.py::test_fit", "outcome": "failed", "duration": 3.1,
         "report_only": false,
         "runs": [{"source": "marker", "steps": 12, "passed": false,
                   "checks": {"no_iterator_reset": {"passed": false, "status": "failed",
                                                    "summary": "...", "count": 2,
                                                    "figures": {...}, "findings": [...]}}}],
         "checks": {"no_iterator_reset": {...the same, merged over the test's runs: failed if any run failed}}}
      ]
    }

``figures`` holds the invariant's own figures only (their names and types: the reference page, generated
from each invariant's declared ``figures`` type). A run merged over the processes of a multi-process launch
also has ``"ranks"`` (one entry per process) and, per invariant, ``"processes"`` beside ``"figures"``:
every process's ``status``, ``summary`` and ``figures`` by process (``"rank0"``, ``"rank1"``, ``"main"``; see
:mod:`pytest_torchperf.ranks.merge`). Schema version 2 moved that merge out of ``figures["ranks"]``.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
from collections.abc import Iterable
from typing import Any, Optional

from .._version import __version__
from ..report import FAILED, INCONCLUSIVE, NOT_CHECKED, PASSED

__all__ = ["SCHEMA_VERSION", "environment", "test_entry", "document", "write", "junit_properties"]

#: 2: a merged verdict's per-process results moved from ``figures["ranks"]`` to ``"processes"``.
SCHEMA_VERSION = 2

_PACKAGES = ("torch", "pytorch_lightning", "lightning", "pytest", "pytest_torchperf", "pytest_xdist")
_DISTRIBUTIONS = {
    "torch": "torch",
    "pytorch_lightning": "pytorch-lightning",
    "lightning": "lightning",
    "pytest": "pytest",
    "pytest_torchperf": "pytest-torchperf",
    "pytest_xdist": "pytest-xdist",
}


def _version(distribution: str) -> Optional[str]:
    from importlib import metadata

    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def device_info() -> dict[str, Any]:
    """What the training ran on; only asks torch when it is already imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    info: dict[str, Any] = {"torch": getattr(torch, "__version__", None)}
    try:
        cuda = bool(torch.cuda.is_available())
    except Exception:  # a broken driver must not break a report
        cuda = False
    info["cuda_available"] = cuda
    info["device"] = torch.cuda.get_device_name(0) if cuda else "cpu"
    info["num_threads"] = torch.get_num_threads()
    return info


def environment(extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    for name in _PACKAGES:
        env[name] = _version(_DISTRIBUTIONS[name])
    env["pytest_torchperf"] = __version__  # the code running, whatever metadata an editable install left
    env.update(extra or {})
    return env


#: Which verdict stands for a test when its runs disagree: the first in this order.
_STATUS_RANK = {FAILED: 0, INCONCLUSIVE: 1, PASSED: 2, NOT_CHECKED: 3}


def merge_checks(runs: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """One verdict per invariant over a test's runs: failed if any run failed it, else inconclusive if any
    run could not decide it, else passed if any run checked it."""
    merged: dict[str, dict[str, Any]] = {}
    for run in runs:
        for name, check in run.get("checks", {}).items():
            current = merged.get(name)
            if current is None or _STATUS_RANK.get(check["status"], 9) < _STATUS_RANK.get(current["status"], 9):
                merged[name] = check
    return merged


def test_entry(
    nodeid: str, outcome: str, duration: float, runs: list[dict[str, Any]], report_only: bool
) -> dict[str, Any]:
    return {
        "nodeid": nodeid,
        "outcome": outcome,
        "duration": round(duration, 6),
        "report_only": report_only,
        "runs": runs,
        "checks": merge_checks(runs),
    }


def document(tests: list[dict[str, Any]], env: dict[str, Any]) -> dict[str, Any]:
    checks_failed: dict[str, int] = {}
    checks_inconclusive: dict[str, int] = {}
    for test in tests:
        for name, check in test["checks"].items():
            if check["status"] == FAILED:
                checks_failed[name] = checks_failed.get(name, 0) + 1
            elif check["status"] == INCONCLUSIVE:
                checks_inconclusive[name] = checks_inconclusive.get(name, 0) + 1
    return {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": env,
        "summary": {
            "tests": len(tests),
            "failed": sum(1 for t in tests if t["outcome"] == "failed"),
            "checks_failed": checks_failed,
            "checks_inconclusive": checks_inconclusive,
        },
        "tests": tests,
    }


def write(path: str, doc: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, default=str)
        fh.write("\n")
    os.replace(tmp, path)


def junit_properties(checks: dict[str, dict[str, Any]]) -> list[tuple[str, Any]]:
    """Flat ``torchperf.<invariant>.<figure>`` properties: verdict, count and scalar figures.

    A run merged over several processes has each one's verdict and figures under
    ``"processes"``: they become ``torchperf.<invariant>.rank1.status`` and ``torchperf.<invariant>.rank1.<figure>``.
    """
    props: list[tuple[str, Any]] = []
    for name, check in checks.items():
        prefix = f"torchperf.{name}"
        props.append((f"{prefix}.status", check["status"]))
        props.append((f"{prefix}.count", check["count"]))
        props.extend(_scalars(prefix, check.get("figures") or {}))
        for process, result in (check.get("processes") or {}).items():
            props.append((f"{prefix}.{process}.status", result.get("status")))
            props.extend(_scalars(f"{prefix}.{process}", result.get("figures") or {}))
    return props


def _scalars(prefix: str, figures: dict[str, Any]) -> list[tuple[str, Any]]:
    return [
        (f"{prefix}.{key}", value)
        for key, value in figures.items()
        if isinstance(value, (bool, int, float, str)) or value is None
    ]
