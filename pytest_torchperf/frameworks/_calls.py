"""What the adapters share: one observed training call, and its steps.

:class:`Observed` is the ``with`` block an adapter's wrapper of a training call
(``Trainer.train``, ``Engine.run``) runs the original in: the active runs get
``on_framework_call`` with the :class:`FrameworkCall`, steps the adapter marks
with :meth:`Observed.begin_step` / :meth:`Observed.end_step` count in every
run, and what is still open when the call returns (or raises) is closed. Calls
nest (an evaluator's ``Engine.run`` inside a trainer's): only the outermost
call of a framework marks steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .. import core
from ..patching import Patcher

__all__ = ["FrameworkCall", "Observed", "current", "in_call"]


@dataclass
class FrameworkCall:
    """One observed training call of a framework other than Lightning."""

    framework: str  # "transformers", "ignite"
    kind: str  # "Trainer.train", "Engine.run"
    owner: Any  # the Trainer or Engine
    #: Steps the call marked.
    steps: int = 0
    #: Patches made for the length of the call (undone when it returns).
    patcher: Patcher = field(default_factory=Patcher)


#: Calls in flight, innermost last.
_CALLS: list[FrameworkCall] = []


def current(framework: Optional[str] = None) -> Optional[FrameworkCall]:
    """The innermost observed call in flight (of ``framework``, if given)."""
    for call in reversed(_CALLS):
        if framework is None or call.framework == framework:
            return call
    return None


def in_call(owner: Any) -> bool:
    """``owner`` is inside one of its own observed calls (a call re-entering itself passes through)."""
    return any(call.owner is owner for call in _CALLS)


class Observed:
    """Observe one training call for the active runs (a plain class: a user's exception passes through)."""

    def __init__(self, framework: str, kind: str, owner: Any) -> None:
        self.call = FrameworkCall(framework, kind, owner)
        self.runs = list(core.active_runs())
        #: Whether this call marks steps: the outermost call of its framework.
        self.marks_steps = current(framework) is None
        self._open = False

    def __enter__(self) -> Observed:
        _CALLS.append(self.call)
        for run in self.runs:
            run.notify("on_framework_call", self.call)
        return self

    def begin_step(self) -> None:
        """A step begins (the one still open ends first)."""
        if not self.marks_steps:
            return
        if self._open:
            self.end_step()
        self._open = True
        self.call.steps += 1
        for run in self.runs:
            if run.active:
                run.step_started()

    def end_step(self) -> None:
        if not self._open:
            return
        self._open = False
        for run in self.runs:
            if run.active:
                run.step_ended()

    def __exit__(self, *exc_info: Any) -> None:
        try:
            self.end_step()
        finally:
            self.call.patcher.undo()
            if self.call in _CALLS:
                _CALLS.remove(self.call)
