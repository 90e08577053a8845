"""Automatic steps: a watched loop with neither ``run.step()`` nor a framework's step still has steps.

A run whose scope is ``training_step`` (the default) is *armed* when it
starts. While armed, it waits for training: the first backward pass (or, in
a loop whose backward runs inside ``optimizer.step(closure)``, the first
optimizer step) opens step 1. From then on:

- each optimizer step after the first begins the next step (an optimizer
  that already stepped in the current step; so with several optimizers, a
  GAN's ``opt_d`` and ``opt_g``, one round of all of them is one step, and
  with gradient accumulation one optimizer step is one step);
- without any optimizer step, each backward pass begins the next step;
  backward passes seen before the first optimizer step are folded into one
  step when it comes (gradient accumulation);
- the last step lasts until the watch ends.

So a loop of N optimizer steps makes N steps. What runs before the first
backward pass (setup, the first forward pass) is outside the steps. A step
marked by anyone else (``run.step()``, Lightning's ``training_step``, another
framework's step) disarms the run for good: marked steps win.

The probes here are two: a global optimizer step post-hook and a wrapper of
torch's backward entry point (``torch.autograd._engine_run_backward``). The
wrapper is in only while some armed run looks at backward passes: it is taken
out once none does (a run that marks its steps disarms itself at its first
backward pass; a run whose steps are found at optimizer steps stops looking at
backward passes), unless something was patched over it since, when it stays,
returning after two attribute loads, until the watch ends. The post-hook is
registered only while a run is armed: the last run to be disarmed removes it,
unless that happens while torch is calling the post-hooks (from one of them:
removing it then would change the dict torch iterates), when it stays until
the watch ends. So a loop with marked steps (Lightning's, ``run.step()``) pays
for neither after its first step.
"""

from __future__ import annotations

import importlib
import sys
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from . import core, frames
from .core import FLAGS
from .patching import wraps

if TYPE_CHECKING:
    from .core import Run
    from .patching import Patcher

__all__ = ["AutoSteps", "arm", "close", "found", "install"]

#: How steps were found, for reports.
AT_OPTIMIZER = "found at optimizer.step()"
AT_BACKWARD = "found at backward()"
_MARKED = "marked steps"


class _Armed:
    """How many runs are armed now (read on the hot paths: one attribute load; see ``core._Flags``)."""

    __slots__ = ("count", "backward", "hook", "handle", "optimizer_file", "wrap_backward", "wrapped", "patcher")

    def __init__(self) -> None:
        self.count = 0
        #: How many of them still look at backward passes (not yet in optimizer mode).
        self.backward = 0
        #: Registers the optimizer post-hook and returns its handle (None before torch is hooked).
        self.hook: Optional[Callable[[], Any]] = None
        #: The post-hook's handle while it is registered.
        self.handle: Any = None
        #: ``torch/optim/optimizer.py``: its frames tell whether torch is calling the post-hooks now.
        self.optimizer_file = ""
        #: Puts the backward wrapper in and returns its patch (None before torch is hooked).
        self.wrap_backward: Optional[Callable[[], Any]] = None
        #: The backward wrapper's patch while it is in.
        self.wrapped: Any = None
        #: The patcher it is in.
        self.patcher: Any = None


ARMED = _Armed()


class AutoSteps:
    """One run's automatic steps (see the module's docstring)."""

    __slots__ = ("open", "own", "mode", "backward_steps", "stepped", "disarmed_by", "marked_by")

    def __init__(self) -> None:
        #: Whether this object holds one level of the run's step depth now.
        self.open = False
        #: ``run.steps`` as this object left it: more means someone else counted a step.
        self.own = 0
        #: None (waiting for training), "backward" or "optimizer".
        self.mode: Optional[str] = None
        #: Steps begun by backward passes before the first optimizer step.
        self.backward_steps = 0
        #: ids of the optimizers that stepped in the current step.
        self.stepped: set[int] = set()
        #: Why automatic steps stopped ("marked steps"), if they did.
        self.disarmed_by = ""
        #: Who marked the steps, for reports (``"marked by Lightning's training_step"``).
        self.marked_by = ""


def arm(run: Run) -> None:
    """Arm ``run`` for automatic steps (a run with scope ``training_step`` whose steps are not marked yet)."""
    if getattr(run, "scope", None) != "training_step" or getattr(run, "_auto", None) is not None:
        return
    run._auto = AutoSteps()
    ARMED.count += 1
    ARMED.backward += 1
    if ARMED.handle is None and ARMED.hook is not None:
        ARMED.handle = ARMED.hook()
    _follow_backward(ARMED)


def _follow_backward(armed: _Armed) -> None:
    """The backward wrapper in while some armed run looks at backward passes, out once none does.

    It is taken out only when it is the attribute's top layer (nothing put over it since), so a wrapper
    put in after it never ends up wrapping it twice; else it stays, returning at once, until the watch ends.
    """
    if armed.backward:
        if armed.wrapped is None and armed.wrap_backward is not None:
            armed.wrapped = armed.wrap_backward()
    elif armed.wrapped is not None and armed.patcher is not None and armed.patcher.take_back(armed.wrapped):
        armed.wrapped = None


def _unhook(armed: _Armed) -> None:
    """Remove the post-hook once no run is armed, unless torch is calling the post-hooks now."""
    if armed.count or armed.handle is None:
        return
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        # Torch's step wrapper has ``out`` once the step returned: it is calling the post-hooks, or returning.
        code = frame.f_code
        if (
            code.co_filename == armed.optimizer_file
            or (code.co_name == "wrapper" and code.co_filename.endswith("optimizer.py"))
        ) and "out" in frame.f_locals:
            return
        frame = frame.f_back
    handle, armed.handle = armed.handle, None
    handle.remove()


def _marker() -> str:
    """Who marks the steps now: a framework's call in flight, else ``run.step()``."""
    from .frameworks import _calls, lightning

    if lightning.current_call() is not None:
        return "marked by Lightning's training_step"
    call = _calls.current()
    if call is not None:
        owner = f"{call.framework}'" if call.framework.endswith("s") else f"{call.framework}'s"
        return f"marked by {owner} {call.kind}"
    return "marked with run.step()"


def found(run: Run) -> str:
    """How the run's steps were found: ``"found at optimizer.step()"``, ``"found at backward()"``, who marked
    them (``"marked by Lightning's training_step"``, ``"marked with run.step()"``) or ``""``."""
    auto: Optional[AutoSteps] = getattr(run, "_auto", None)
    if auto is not None and auto.disarmed_by == _MARKED:
        return auto.marked_by
    if auto is None or auto.mode is None:
        return ""
    return AT_OPTIMIZER if auto.mode == "optimizer" else AT_BACKWARD


def _disarm(run: Run, auto: AutoSteps, why: str) -> None:
    if auto.disarmed_by:
        return
    auto.disarmed_by = why
    if why == _MARKED:  # a backward pass or an optimizer step in a marked step: a library running now drives it
        frames.note_drivers(sys._getframe(1))
        auto.marked_by = _marker()
    ARMED.count -= 1
    if auto.mode != "optimizer":
        ARMED.backward -= 1
    _unhook(ARMED)
    _follow_backward(ARMED)
    if auto.open:
        auto.open = False
        run.step_ended()


def close(run: Run) -> None:
    """The run stops: end its open automatic step (its checks see the step's end) and disarm it."""
    auto: Optional[AutoSteps] = getattr(run, "_auto", None)
    if auto is None or auto.disarmed_by:
        return
    auto.disarmed_by = "the watch ended"
    ARMED.count -= 1
    if auto.mode != "optimizer":
        ARMED.backward -= 1
    _unhook(ARMED)
    _follow_backward(ARMED)
    if auto.open:
        auto.open = False
        run.step_ended()


def _marked_elsewhere(run: Run, auto: AutoSteps) -> bool:
    """Someone else counts steps in this run: a step is open that is not ours, or one was counted."""
    depth = run._step_depth - (1 if auto.open else 0)
    return depth > 0 or run.steps != auto.own


def _begin(run: Run, auto: AutoSteps) -> None:
    if auto.open:
        run.next_step()
    else:
        if not auto.own:  # the run's first step: a library running now drives the loop
            frames.note_drivers(sys._getframe(1))
        run.step_started()
        auto.open = True
    auto.own = run.steps


def backward(run: Run, auto: AutoSteps) -> None:
    """A backward pass (not one the autograd engine started itself) in an armed run."""
    if auto.mode == "optimizer":
        return
    if _marked_elsewhere(run, auto):
        _disarm(run, auto, _MARKED)
        return
    if auto.mode is None:
        auto.mode = "backward"
    auto.backward_steps += 1
    _begin(run, auto)


def optimizer_step(run: Run, auto: AutoSteps, optimizer: Any) -> None:
    """An optimizer stepped in an armed run."""
    if _marked_elsewhere(run, auto):
        _disarm(run, auto, _MARKED)
        return
    key = id(optimizer)
    if auto.mode == "optimizer":
        stepped = auto.stepped
        if key in stepped:
            _begin(run, auto)
            if len(stepped) > 1:
                auto.stepped = {key}
        else:
            stepped.add(key)
        return
    if auto.mode is None:  # no backward seen (it ran before the watch, or inside a closure torch hid)
        _begin(run, auto)
    elif auto.backward_steps > 1:
        # Gradient accumulation: the steps begun by backward passes since the first are one step.
        run.steps -= auto.backward_steps - 1
        auto.own = run.steps
    auto.mode = "optimizer"
    ARMED.backward -= 1  # backward passes no longer begin its steps
    auto.stepped = {key}
    _follow_backward(ARMED)


def _armed_runs() -> list[tuple[Run, AutoSteps]]:
    out = []
    for run in core.active_runs():
        auto = getattr(run, "_auto", None)
        if auto is not None and not auto.disarmed_by and run._active:
            out.append((run, auto))
    return out


def install(patcher: Patcher) -> None:
    """Hook optimizer steps and backward passes for armed runs (when torch is imported; undone by ``patcher``)."""
    patcher.callback(_reset)
    patcher.on_import("torch.autograd", lambda module: _install(patcher))


def _reset() -> None:
    frames.DRIVERS.clear()
    ARMED.count = 0
    ARMED.backward = 0
    handle, ARMED.handle, ARMED.hook = ARMED.handle, None, None
    ARMED.wrap_backward = ARMED.wrapped = ARMED.patcher = None  # the patcher undoes the wrapper itself
    if handle is not None:
        handle.remove()


def _install(patcher: Patcher) -> None:
    try:
        import torch

        optimizer_module = importlib.import_module("torch.optim.optimizer")
    except Exception as exc:  # noqa: BLE001 - never into the user's import
        core.probe_failed("autosteps", exc)
        return
    flags, armed = FLAGS, ARMED
    current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)

    active = core.active_runs()

    def on_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
        if armed.count and flags.active:
            try:
                if len(active) == 1:  # _armed_runs() for the one run watching (the common case), inlined
                    run = active[0]
                    auto = run._auto
                    if auto is not None and not auto.disarmed_by and run._active:
                        optimizer_step(run, auto, optimizer)
                    return
                for run, auto in _armed_runs():
                    optimizer_step(run, auto, optimizer)
            except Exception as exc:  # noqa: BLE001 - never into the user's optimizer step
                core.probe_failed("autosteps", exc)

    register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
    if register is not None:  # registered by arm(), removed by _unhook() and _reset()
        armed.hook = lambda: register(on_optimizer_step)
        armed.optimizer_file = getattr(optimizer_module, "__file__", "") or ""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(original)
        def run_backward(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if armed.backward and flags.active and not is_compiling():
                try:
                    if current_node() is None:  # not a pass the engine started (reentrant checkpointing)
                        for run, auto in _armed_runs():
                            backward(run, auto)
                except Exception as exc:  # noqa: BLE001 - never into the user's backward
                    core.probe_failed("autosteps", exc)
            return original(*args, **kwargs)

        return run_backward

    name = "_engine_run_backward" if callable(getattr(torch.autograd, "_engine_run_backward", None)) else "backward"

    def wrap_backward() -> Any:
        # The wrapper reads only the module's state when called (``armed``, this module's own): kept from watch
        # to watch, and built again for a module imported anew.
        with patcher.reusing(("autosteps", armed, is_compiling, current_node)):
            return patcher.wrap(torch.autograd, name, wrap)

    # Put in by arm() while a run looks at backward passes, taken out once none does (_follow_backward).
    armed.wrap_backward, armed.patcher = wrap_backward, patcher
    _follow_backward(armed)
