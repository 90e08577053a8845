"""Probe ``data_parallel``: ``torch.nn.DataParallel`` instances built and forward passes made.

Wraps ``DataParallel.__init__`` (remembers where an instance was built) and
``DataParallel.forward`` (sends ``on_data_parallel_forward(module, stack)`` to
the checks of the active runs, the stack captured lazily, once).
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..frames import stack_of
from ..stacks import Stack
from . import Probe, record_creation

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["DataParallelProbe", "PROBE"]


class DataParallelProbe(Probe):
    name = "data_parallel"

    def __init__(self) -> None:
        super().__init__()
        self.created: "weakref.WeakKeyDictionary[Any, Stack]" = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        super().reset()
        self.created.clear()

    def install(self, patcher: "Patcher") -> None:
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        probe = self
        dp = torch.nn.DataParallel

        def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(original)
            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if flags.active:
                    try:
                        probe.forwarded(self, sys._getframe(1))
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return original(self, *args, **kwargs)

            return forward

        patcher.wrap(dp, "__init__", record_creation(self, self.created, lambda: flags.active))
        patcher.wrap(dp, "forward", wrap_forward)

    def forwarded(self, module: Any, frame: Any) -> None:
        """A forward pass of ``module``, called from ``frame``: its stack is captured when a check asks."""
        stack: list[Stack] = []

        def lazy() -> Stack:
            if not stack:
                stack.append(stack_of(frame))
            return stack[0]

        core.notify("on_data_parallel_forward", module, lazy)


PROBE = DataParallelProbe()
