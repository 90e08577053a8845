"""Probe ``cuda_cache``: calls of ``torch.cuda.empty_cache()``, on CPU-only machines too.

Wraps ``torch.cuda.memory.empty_cache`` (where it lives) and ``torch.cuda.empty_cache``
and sends ``on_empty_cache(stack)`` to the checks of the active runs. Blind
spot: a function imported by name before the run (``from torch.cuda import
empty_cache``) is not seen.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from ..stacks import capture
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["CudaCacheProbe"]


class CudaCacheProbe(Probe):
    name = "cuda_cache"

    def install(self, patcher: Patcher) -> None:
        import torch.cuda
        import torch.cuda.memory

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        probe = self
        original = torch.cuda.memory.empty_cache

        @wraps(original)
        def empty_cache(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if flags.active:
                try:
                    probe.called()
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)
            return original(*args, **kwargs)

        wrapper: Callable[..., Any] = empty_cache
        patcher.setattr(torch.cuda.memory, "empty_cache", wrapper)
        if torch.cuda.empty_cache is original:
            patcher.setattr(torch.cuda, "empty_cache", wrapper)

    def called(self) -> None:
        if core.handlers("on_empty_cache"):
            core.notify("on_empty_cache", capture(3))
