"""Probe ``threads``: who set torch's CPU thread count.

Wraps ``torch.set_num_threads`` and keeps the stack and value of the last
call during the run (in the watched process: a call inside a DataLoader
worker happens in another process). The counts themselves are read by the
check. Nothing changes what the function does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from ..patching import wraps
from ..stacks import Stack, capture
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["ThreadsProbe"]


class ThreadsProbe(Probe):
    name = "threads"

    def __init__(self) -> None:
        super().__init__()
        self.set_at: Optional[Stack] = None
        self.value: Optional[int] = None

    def reset(self) -> None:
        super().reset()
        self.set_at = None
        self.value = None

    def install(self, patcher: Patcher) -> None:
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        probe = self

        def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def set_num_threads(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                try:
                    probe.set_at = capture(2)
                    probe.value = int(args[0]) if args else None
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)
                return original(*args, **kwargs)

            return set_num_threads

        patcher.wrap(torch, "set_num_threads", wrap)
