"""GitHub Actions annotations: each finding as a workflow command at the line of your code that caused it.

pytest-free. GitHub reads lines of the form::

    ::error file=tests/test_fit.py,line=53,title=torchperf no_host_sync::`.item()` in training_step: ...

from a step's output and shows them on the pull request's diff. Property
values escape ``%``, CR, LF, ``:`` and ``,``; the message escapes ``%``, CR
and LF (GitHub's workflow-command format, as its toolkit writes it). One
annotation per invariant and line, however many tests reach it: ``error``
when a test failed on it, ``warning`` when it is known (in the baseline) or
only reported.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .baseline import Observation

__all__ = ["Annotation", "escape_data", "escape_property", "workflow_command", "annotations", "enabled"]

ERROR = "error"
WARNING = "warning"


def escape_data(text: str) -> str:
    """A workflow command's message: ``%``, CR and LF escaped."""
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def escape_property(text: str) -> str:
    """A workflow command's property value: as a message, plus ``:`` and ``,``."""
    return escape_data(text).replace(":", "%3A").replace(",", "%2C")


def workflow_command(command: str, message: str, properties: Optional[dict[str, object]] = None) -> str:
    """``::command key=value,key=value::message``, escaped; properties that are None are left out."""
    props = ",".join(
        f"{key}={escape_property(str(value))}" for key, value in (properties or {}).items() if value is not None
    )
    return f"::{command}{' ' + props if props else ''}::{escape_data(message)}"


def enabled(when: str, environ: Optional[dict[str, str]] = None) -> bool:
    """``when`` is ``auto`` (on when ``GITHUB_ACTIONS=true``), ``on`` or ``off``."""
    env = os.environ if environ is None else environ
    if when == "auto":
        return env.get("GITHUB_ACTIONS", "").lower() == "true"
    return when == "on"


@dataclass
class Annotation:
    """One workflow command: a finding at one line of one file."""

    level: str
    file: str
    line: int
    invariant: str
    message: str
    tests: list[str] = field(default_factory=list)
    known: bool = False

    @property
    def title(self) -> str:
        return f"torchperf {self.invariant}"

    def text(self) -> str:
        message = self.message
        if len(self.tests) == 1:
            message += f" [test: {self.tests[0]}]"
        elif self.tests:
            message += f" [tests: {self.tests[0]} and {len(self.tests) - 1} more]"
        return workflow_command(self.level, message, {"file": self.file, "line": self.line, "title": self.title})


def _relative(path: str, roots: Iterable[Optional[str]]) -> str:
    real = os.path.realpath(path)
    for root in roots:
        if not root:
            continue
        base = os.path.realpath(root) + os.sep
        if real.startswith(base):
            return real[len(base):].replace(os.sep, "/")
    return real.replace(os.sep, "/")


def annotations(  # type: ignore[no-redef,unused-ignore]  # the name is also the __future__ feature
    findings: Iterable[tuple[str, Observation, str, str, Optional[tuple[str, int]]]],
    *,
    rootdir: str,
    workspace: Optional[str] = None,
) -> list[Annotation]:
    """One annotation per invariant and user line.

    ``findings`` are ``(test id, observation, level, note, fallback)``: ``note``
    says why a warning did not fail (``"known in the baseline"``); ``fallback``
    is the test's own ``(absolute file, line)``, used when no frame of the
    finding's stack is your code. Paths are made relative to ``workspace``
    (GitHub's checkout, ``GITHUB_WORKSPACE``) or else to ``rootdir``.
    """
    merged: dict[tuple[str, int, str], Annotation] = {}
    for nodeid, obs, level, note, fallback in findings:
        if obs.user_frame is not None:
            filename, line, _ = obs.user_frame
        elif fallback is not None:
            filename, line = fallback
        else:
            continue
        path = _relative(filename, (workspace, rootdir))
        key = (path, line, obs.invariant)
        message = _message(obs, path, line, note)
        current = merged.get(key)
        if current is None:
            merged[key] = Annotation(level, path, line, obs.invariant, message, [nodeid], known=level == WARNING)
            continue
        if nodeid not in current.tests:
            current.tests.append(nodeid)
        if level == ERROR and current.level != ERROR:
            current.level, current.message, current.known = ERROR, message, False
    return sorted(merged.values(), key=lambda a: (a.file, a.line, a.invariant))


def _message(obs: Observation, path: str, line: int, note: str) -> str:
    text = obs.title or obs.describe()
    if obs.file and (obs.file != path or obs.line != line):
        text += f" (at {obs.file}:{obs.line} in {obs.function})"
    if note:
        text += f" ({note})"
    return " ".join(text.split())
