"""Adapter for PyTorch Ignite (see :mod:`pytest_torchperf.frameworks`).

Observed: ``Engine.run`` inside a watched run (``on_framework_call`` / ``on_framework_call_end``), and its
steps: the engine's process function (``create_supervised_trainer``'s update,
or the user's ``train_step(engine, batch)``) is the step, from the end of the
``ITERATION_STARTED`` handlers to the start of the ``ITERATION_COMPLETED`` ones
(``Engine._fire_event`` is wrapped on the class for the call; the engine's
instance is never touched). An ``Engine.run`` inside another (an evaluator run
from a trainer's handler) marks no steps.

Frames in ``ignite`` are the framework's: the default ``output_transform`` of
``create_supervised_trainer`` (``loss.item()`` every iteration) is a note at
Ignite's line, with the argument that removes it as the hint.

Not observed: ``max_overhead`` (not checked), handlers on ``ITERATION_COMPLETED``
(outside the step, like Lightning's callbacks).
"""

from __future__ import annotations

from typing import Any, Callable

from .. import core
from ..patching import Patcher, wraps
from . import _calls

__all__ = ["NAME", "PACKAGES", "PLUMBING", "SETTINGS", "hint", "install", "launchers", "replay", "stage"]

NAME = "ignite"
PACKAGES = ("ignite",)
#: Modules that only pass a call on to torch (see :func:`~pytest_torchperf.frameworks.plumbing`): none known.
PLUMBING: tuple[str, ...] = ()
#: Settings that fix what an invariant found in an object ignite built: none (it builds no loader or DDP).
SETTINGS: dict[str, str] = {}
#: Capabilities this framework does not provide (see :class:`pytest_torchperf.frameworks.Adapter`).
stage = None
replay = None
launchers = None

_ENGINE_MODULE = "ignite.engine.engine"
_OUTPUT = (
    "pass `output_transform=lambda x, y, y_pred, loss: loss.detach()` to create_supervised_trainer (its default "
    "reads the loss with `.item()` every iteration) and read it on the host only every N iterations"
)


def hint(frame: Any, op: str) -> str:
    path = str(getattr(frame, "filename", "")).replace("\\", "/")
    if path.endswith("ignite/engine/__init__.py") and "loss.item()" in (getattr(frame, "source", "") or ""):
        return _OUTPUT
    return ""


def _wrap_fire(original: Callable[..., Any], observed: _calls.Observed, events: Any) -> Callable[..., Any]:
    started, completed = events.ITERATION_STARTED, events.ITERATION_COMPLETED
    owner = observed.call.trainer

    @wraps(original)
    def _fire_event(self: Any, event_name: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if self is owner and event_name == completed:
            observed.end_step()
        result = original(self, event_name, *args, **kwargs)
        if self is owner and event_name == started:
            observed.begin_step()
        return result

    return _fire_event


def _wrap_run(original: Callable[..., Any], module: Any) -> Callable[..., Any]:
    @wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        if not core.active_runs() or _calls.in_call(self):
            return original(self, *args, **kwargs)
        call = _calls.FrameworkCall(NAME, "Engine.run", self, package="ignite", args=args, kwargs=dict(kwargs))
        with _calls.Observed(call) as observed:
            if observed.marks_steps:
                try:
                    cls = module.Engine
                    fire = cls.__dict__["_fire_event"]
                    observed.call.patcher.setattr(cls, "_fire_event", _wrap_fire(fire, observed, module.Events))
                except Exception as exc:  # noqa: BLE001
                    core.probe_failed("ignite", exc)
            return original(self, *args, **kwargs)

    return run


def install(patcher: Patcher) -> None:
    """Patch ``ignite.engine.Engine.run`` when ``ignite.engine.engine`` is (or gets) imported."""

    def attach(module: Any) -> None:
        try:
            engine_cls = module.Engine
            patcher.setattr(engine_cls, "run", _wrap_run(vars(engine_cls)["run"], module))
        except Exception as exc:  # noqa: BLE001 - never into the user's import
            core.probe_failed("ignite", exc)

    patcher.on_import(_ENGINE_MODULE, attach)
