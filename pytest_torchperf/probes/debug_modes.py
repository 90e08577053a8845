"""Probe ``debug_modes``: where torch's slow debugging switches were turned on.

Wraps ``torch.set_anomaly_enabled`` (which ``torch.autograd.detect_anomaly`` and
``set_detect_anomaly`` call), ``torch.use_deterministic_algorithms`` and the
``__enter__`` of ``torch.autograd.profiler.profile`` / ``emit_nvtx``, and
keeps the stack of the last call that turned each one on. The states
themselves are read by the check at each step start (one C call each,
:func:`readers`; the environment variable once, :func:`launch_blocking`). Nothing changes what the functions do.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from ..patching import wraps
from ..stacks import Stack, capture
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["DebugModesProbe", "MODES"]

#: The modes, in report order.
MODES = ("anomaly", "profiler", "launch_blocking", "deterministic")


class DebugModesProbe(Probe):
    name = "debug_modes"
    keeps_wrappers = True

    def __init__(self) -> None:
        super().__init__()
        #: Mode -> the stack of the last call that turned it on during the run.
        self.turned_on: dict[str, Stack] = {}

    def reset(self) -> None:
        super().reset()
        self.turned_on = {}

    def install(self, patcher: Patcher) -> None:
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        probe = self

        def recorder(mode: str, on: Callable[..., bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
            def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
                @wraps(original)
                def wrapper(*args: Any, **kwargs: Any) -> Any:
                    __tracebackhide__ = True
                    try:
                        if on(*args, **kwargs):
                            probe.turned_on[mode] = capture(2)
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                    return original(*args, **kwargs)

                return wrapper

            return wrap

        def first(*args: Any, **kwargs: Any) -> bool:
            return bool(args[0] if args else kwargs.get("enabled", kwargs.get("mode")))

        def entered(this: Any, *args: Any, **kwargs: Any) -> bool:
            return bool(getattr(this, "enabled", True))

        patcher.wrap(torch, "set_anomaly_enabled", recorder("anomaly", first))
        patcher.wrap(torch, "use_deterministic_algorithms", recorder("deterministic", first))
        profiler = torch.autograd.profiler
        for cls_name in ("profile", "emit_nvtx"):
            cls = getattr(profiler, cls_name, None)
            if isinstance(cls, type) and "__enter__" in vars(cls):
                patcher.wrap(cls, "__enter__", recorder("profiler", entered))


def readers() -> tuple[Callable[[], bool], Callable[[], bool], Callable[[], bool]]:
    """The functions that say whether anomaly detection, the autograd profiler, deterministic algorithms are on."""
    import torch

    profiler = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)
    # torch's own C function where it has one (the public one is a Python call around it: read every step).
    deterministic = getattr(torch._C, "_get_deterministic_algorithms", None)
    return (
        torch.is_anomaly_enabled,
        profiler if callable(profiler) else (lambda: False),
        deterministic if callable(deterministic) else torch.are_deterministic_algorithms_enabled,
    )


def launch_blocking() -> bool:
    """Whether ``CUDA_LAUNCH_BLOCKING`` is set (CUDA reads it when it starts)."""
    return os.environ.get("CUDA_LAUNCH_BLOCKING", "0").strip() not in ("", "0")
