"""What the adapters share: one observed training call, and its steps.

:class:`FrameworkCall` is what the checks receive with ``on_framework_call`` /
``on_framework_call_end``, for every framework alike (Lightning's
``Trainer.fit``, the Hugging Face ``Trainer.train``, Ignite's ``Engine.run``).
:class:`Observed` is the ``with`` block an adapter's wrapper of a training call
runs the original in: the call is current (:func:`current`) and the active runs
get its events; steps the adapter marks with :meth:`Observed.begin_step` /
:meth:`Observed.end_step` count in every run, and what is still open when the
call returns (or raises) is closed. Calls nest (an evaluator's ``Engine.run``
inside a trainer's): only the outermost call of a framework marks steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from .. import core
from ..patching import Patcher

__all__ = ["FrameworkCall", "Observed", "current", "in_call"]


@dataclass
class FrameworkCall:
    """One observed training call of a framework: what the checks' ``on_framework_call(call)`` receives."""

    framework: str  # the adapter's NAME: "lightning", "transformers", "ignite"
    kind: str  # "fit", "validate"... (Lightning), "Trainer.train", "Engine.run"
    trainer: Any  # the Trainer or Engine whose method was called
    #: The model the call trains, when the framework names it (Lightning's ``fit(model)``), else None.
    model: Any = None
    #: The import package the call came from ("pytorch_lightning" or "lightning.pytorch", "transformers").
    package: str = ""
    #: The call's own arguments (after the trainer), for checks that replay it.
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
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


def in_call(trainer: Any) -> bool:
    """``trainer`` is inside one of its own observed calls (a call re-entering itself passes through)."""
    return any(call.trainer is trainer for call in _CALLS)


class Observed:
    """Observe one training call for ``runs`` (default: the active runs); a plain class: a user's exception
    passes through."""

    def __init__(self, call: FrameworkCall, runs: Optional[list[Any]] = None) -> None:
        self.call = call
        self.runs = list(core.active_runs()) if runs is None else runs
        #: Whether this call marks steps: the outermost call of its framework.
        self.marks_steps = current(call.framework) is None
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
            try:
                self.call.patcher.undo()
            finally:
                if self.call in _CALLS:
                    _CALLS.remove(self.call)
                for run in self.runs:
                    run.notify("on_framework_call_end", self.call)
