"""Probe ``graph_breaks``: every graph break dynamo takes while it compiles, with its reason and user stack.

Wraps one method of dynamo's bytecode translator,
``torch._dynamo.symbolic_convert.InstructionTranslatorBase.log_graph_break``
(now if dynamo is imported, else as soon as it is): dynamo calls it once for
each graph break it decides to take, with the exception that caused it (its
type of break, the explanation and hints, and the user's frames being traced).
That is the same record ``TORCH_LOGS=graph_breaks`` prints; nothing changes
dynamo's behaviour or logging. It sends ``on_graph_break(event)`` with a
:class:`GraphBreak`. The method only runs while dynamo compiles, never in a
compiled step. :attr:`GraphBreaksProbe.attached` says whether this torch's
dynamo has the method (None: dynamo was never imported).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from ..stacks import Frame, Stack, capture
from . import ModuleProbe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["GraphBreak", "GraphBreaksProbe", "PROBE", "parse_message"]

_SYMBOLIC_CONVERT = "torch._dynamo.symbolic_convert"
_DYNAMO_DIR = f"{os.sep}torch{os.sep}_dynamo{os.sep}"
#: dynamo names the continuation after a break ``torch_dynamo_resume_in_<function>_at_<line>``.
_RESUME = re.compile(r"^torch_dynamo_resume_in_(?P<name>.+)_at_\d+$")


@dataclass
class GraphBreak:
    """One graph break dynamo took."""

    #: Dynamo's type of break (``Unsupported Tensor.item() call with capture_scalar_outputs=False``).
    kind: str
    #: Its explanation (the ``Explanation:`` line), or the first line of the reason.
    explanation: str
    #: Dynamo's own hints for it.
    hints: list[str] = field(default_factory=list)
    #: Outermost first: the frames above the compiled call, then the traced user frames down to the break.
    stack: Stack = ()


def parse_message(message: str) -> tuple[str, str, list[str]]:
    """``(type of break, explanation, hints)`` from dynamo's message of an unsupported construct."""
    lines = [line.strip() for line in message.strip().splitlines()]
    kind = next((line for line in lines if line), "")
    explanation = ""
    hints: list[str] = []
    for line in lines[1:]:
        if line.startswith("Explanation:"):
            explanation = line[len("Explanation:") :].strip()
        elif line.startswith("Hint:"):
            hints.append(line[len("Hint:") :].strip())
    return kind, explanation or kind, hints


def _user_stack(exc: Any, above: Stack) -> Stack:
    """The stack of a break: ``above`` (the Python stack) cut where dynamo starts, then the traced frames."""
    cut = next((i for i, f in enumerate(above) if _DYNAMO_DIR in f.filename), len(above))
    outer = list(above[:cut])
    traced: list[Frame] = []
    for summary in getattr(exc, "real_stack", None) or ():
        name = str(getattr(summary, "name", "?"))
        match = _RESUME.match(name)
        traced.append(Frame(str(summary.filename), int(summary.lineno or 0), match.group("name") if match else name))
    # A resumed frame runs (transformed) on the Python stack as well: keep it once, at its traced line.
    while outer and traced and outer[-1].filename == traced[0].filename and outer[-1].function == traced[0].function:
        outer.pop()
    return tuple(outer + traced)


class GraphBreaksProbe(ModuleProbe):
    name = "graph_breaks"
    keeps_wrappers = True
    module = _SYMBOLIC_CONVERT
    #: Compiles are counted by the recompiles probe's compile-start callback.
    needs = ("recompiles",)

    def _attach(self, patcher: Patcher, symbolic_convert: Any) -> None:
        translator = getattr(symbolic_convert, "InstructionTranslatorBase", None)
        self.attached = callable(getattr(translator, "log_graph_break", None))
        if not self.attached:
            self.unavailable["graph_breaks"] = "this torch version's dynamo has no graph-break hook torchperf knows"
            return
        flags = FLAGS
        probe = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def log_graph_break(*args: Any, **kwargs: Any) -> Any:
                if flags.active and not probe.disabled:
                    try:
                        exc = kwargs.get("exc", args[3] if len(args) > 3 else None)
                        if exc is not None and not getattr(exc, "logged", False) and core.handlers("on_graph_break"):
                            reason = kwargs.get("reason", args[2] if len(args) > 2 else "")
                            kind, explanation, hints = parse_message(str(getattr(exc, "msg", "") or reason))
                            kind = str(getattr(exc, "gb_type", "") or kind)
                            event = GraphBreak(kind, explanation, hints, _user_stack(exc, capture(2)))
                            core.notify("on_graph_break", event)
                    except Exception as err:  # noqa: BLE001 - never into dynamo or the user's code
                        probe.failed(err)
                return original(*args, **kwargs)

            return log_graph_break

        patcher.wrap(translator, "log_graph_break", wrap)


PROBE = GraphBreaksProbe()
