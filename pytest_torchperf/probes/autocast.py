"""Probe ``autocast``: ``torch.autocast`` regions entered.

``torch.autocast.__enter__`` is wrapped (``torch.cuda.amp.autocast``,
Lightning's precision plugins and ``torch.amp`` regions in compiled graphs all
go through it): an enabled region sends ``on_autocast(device, dtype)`` to the
checks of the active runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from . import Probe, is_compiling_function

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["AutocastProbe"]


class AutocastProbe(Probe):
    name = "autocast"

    def install(self, patcher: Patcher) -> None:
        import torch.amp.autocast_mode as autocast_mode

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        is_compiling = is_compiling_function()
        probe = self

        def wrap_enter(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __enter__(self: Any) -> Any:
                if not is_compiling() and flags.active:
                    try:
                        probe.entered(self)
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return original(self)

            return __enter__

        patcher.wrap(autocast_mode.autocast, "__enter__", wrap_enter)

    def entered(self, region: Any) -> None:
        if getattr(region, "_enabled", False):
            core.notify("on_autocast", str(getattr(region, "device", "")), getattr(region, "fast_dtype", None))
