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
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from .._guard import caller_frame
from ..core import FLAGS
from ..patching import wraps
from ..stacks import Frame, Stack, capture
from . import ModuleProbe, _compiled

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["GraphBreak", "GraphBreaksProbe", "parse_message"]

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
    #: Found in code dynamo compiled before (before the first step, in an earlier test), run again in a step.
    earlier: bool = False


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

    def __init__(self) -> None:
        super().__init__()
        #: The compiled functions a step of this watch called, read once each: id -> the function (kept, so
        #: that no other function can take its id while the watch lasts). Cleared at each reset: a table of
        #: the wrapper's own outlived the watch (later watches reuse the wrapper), and a second test calling
        #: the same compiled module had nothing read ("nothing was compiled").
        self.read: dict[int, Any] = {}

    def reset(self) -> None:
        super().reset()
        self.read.clear()

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
                            _compiled.remember(_root_code(args[0] if args else None), event)
                            core.notify("on_graph_break", event)
                    except Exception as err:  # noqa: BLE001 - never into dynamo or the user's code
                        probe.failed(err)
                return original(*args, **kwargs)

            return log_graph_break

        patcher.wrap(translator, "log_graph_break", wrap)
        self._attach_calls(patcher)

    def _attach_calls(self, patcher: Patcher) -> None:
        """Read what a compiled function called in a step runs: the breaks dynamo compiled into it earlier.

        ``torch.compile``'s wrapper (``compile_wrapper`` in ``torch._dynamo.eval_frame``)
        asks ``_callback_from_stance`` for its callback at every call, outside
        any tracing: the wrapper here, in a step, reads the wrapped function
        (``fn``) from its caller, once per function and watch, and sends
        ``on_compiled_code_run(codes, breaks)``: the code objects of it dynamo
        holds compiled code for, and the breaks in that code (see
        :mod:`pytest_torchperf.probes._compiled`). Dynamo's callback is
        returned unchanged.
        """
        eval_frame = sys.modules.get("torch._dynamo.eval_frame")
        if not callable(getattr(eval_frame, "_callback_from_stance", None)):
            return
        flags = FLAGS
        probe = self
        read = self.read

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def _callback_from_stance(callback: Any) -> Any:
                if flags.in_scope and not probe.disabled:
                    try:
                        caller = caller_frame()  # dynamo's compile_wrapper, past the engine's guard
                        if caller.f_code.co_name == "compile_wrapper":
                            fn = caller.f_locals.get("fn")
                            if fn is not None and read.get(id(fn)) is not fn:
                                read[id(fn)] = fn
                                probe._compiled_call(fn)
                    except Exception as err:  # noqa: BLE001 - never into dynamo or the user's code
                        probe.failed(err)
                return original(callback)

            return _callback_from_stance

        patcher.wrap(eval_frame, "_callback_from_stance", wrap)

    def _compiled_call(self, fn: Any) -> None:
        if not core.handlers("on_compiled_code_run"):
            return
        codes = [(code, namespace) for code, namespace in _compiled.codes_of(fn) if _compiled.compiled(code)]
        if not codes:
            return
        breaks: list[GraphBreak] = []
        for code, namespace in codes:
            breaks.extend(_compiled.breaks_in(code, namespace, _earlier_break))
        core.notify("on_compiled_code_run", [code for code, _namespace in codes], breaks)


def _root_code(translator: Any) -> Any:
    """The code object of the frame dynamo is compiling (a break in an inlined function: the outer frame)."""
    root = getattr(getattr(translator, "output", None), "root_tx", None) or translator
    return getattr(root, "f_code", None)


def _earlier_break(reason: str, frame: Frame, code: Any) -> GraphBreak:
    """A break read from dynamo's compiled code (``reason`` empty: dynamo's record of it is gone)."""
    if reason:
        kind, explanation, hints = parse_message(reason)
    else:
        kind = explanation = (
            "a graph break compiled before this watch began (dynamo's reason is no longer kept: "
            "TORCH_LOGS=graph_breaks prints it)"
        )
        hints = []
    return GraphBreak(kind, explanation, hints, (frame,), earlier=True)
