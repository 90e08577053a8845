"""Probe ``data_parallel``: ``torch.nn.DataParallel`` instances built and forward passes made.

Wraps ``DataParallel.__init__`` (remembers where an instance was built) and
``DataParallel.forward`` (sends ``on_data_parallel_forward(module, stack)`` to
the checks of the active runs, the stack captured lazily, once).

A subclass may be driven through another method (mmcv's ``MMDataParallel.train_step``
calls ``self.module.train_step(...)``, never ``forward``): ``DataParallel`` gets a
``__getattr__`` (``nn.Module``'s own, called after it) that sends
``on_data_parallel_used(module, function, stack)`` when one of the wrapper's own methods
outside torch reads its wrapped ``.module`` (code that only unwraps it, ``model.module``
from a helper, is not a use). ``nn.Module`` already routes every attribute miss of a module
through ``__getattr__``, so no other attribute read of any module changes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from .._guard import caller_frame
from ..core import FLAGS
from ..frames import kind_of, stack_of
from ..patching import wraps
from ..stacks import TORCH, TORCHPERF, Stack
from . import Probe, record_creation

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["DataParallelProbe"]


class DataParallelProbe(Probe):
    name = "data_parallel"
    keeps_wrappers = True

    def __init__(self) -> None:
        super().__init__()
        self.created: weakref.WeakKeyDictionary[Any, Stack] = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        super().reset()
        self.created.clear()

    def install(self, patcher: Patcher) -> None:
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        probe = self
        dp = torch.nn.DataParallel

        def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if flags.active:
                    try:
                        probe.forwarded(self, caller_frame())
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return original(self, *args, **kwargs)

            return forward

        def wrap_getattr(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __getattr__(self: Any, name: str) -> Any:
                if name == "module" and flags.active:
                    try:
                        probe.read_module(self, caller_frame())
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return original(self, name)

            return __getattr__

        record = record_creation(self, self.created, lambda: flags.active)

        def wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
            recorded = record(original)

            @wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                __tracebackhide__ = True
                recorded(self, *args, **kwargs)
                if flags.active:
                    try:
                        core.notify("on_data_parallel_created", self)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)

            return __init__

        patcher.wrap(dp, "__init__", wrap_init)
        patcher.wrap(dp, "forward", wrap_forward)
        patcher.wrap(dp, "__getattr__", wrap_getattr)

    def forwarded(self, module: Any, frame: Any) -> None:
        """A forward pass of ``module``, called from ``frame``: its stack is captured when a check asks."""
        stack: list[Stack] = []

        def lazy() -> Stack:
            if not stack:
                stack.append(stack_of(frame))
            return stack[0]

        core.notify("on_data_parallel_forward", module, lazy)

    def read_module(self, module: Any, frame: Any) -> None:
        """``module.module`` read at ``frame``: a use of the wrapper when one of its own methods (a subclass's
        ``train_step``) reads it, unless torch's (or torchperf's) own code; elsewhere it only unwraps it."""
        if frame is None or kind_of(frame.f_code) in (TORCH, TORCHPERF):
            return
        if frame.f_locals.get("self") is not module:
            return
        code = frame.f_code
        function = getattr(code, "co_qualname", code.co_name)
        stack: list[Stack] = []

        def lazy() -> Stack:
            if not stack:
                stack.append(stack_of(frame))
            return stack[0]

        core.notify("on_data_parallel_used", module, function, lazy)
