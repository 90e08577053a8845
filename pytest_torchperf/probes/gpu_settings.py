"""Probe ``gpu_settings``: the shapes convolutions see in each step, and who set the GPU math switches.

Wraps ``torch.nn.functional``'s convolutions (``conv1d/2d/3d`` and their
transposes, which ``nn.Conv*`` modules call) to collect, per training step,
the set of input shapes and dtypes they ran on: ``cudnn.benchmark`` only pays
off for convolutions, and only when their shapes repeat. Also wraps
``torch.set_float32_matmul_precision`` to keep the stack of the last call
(who turned TF32 matmuls off or on). The switches themselves are read by the
check (:func:`settings`). Nothing changes what the functions do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

from ..core import FLAGS
from ..patching import wraps
from ..stacks import Stack, capture
from . import Probe, is_compiling_function

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["GpuSettingsProbe", "settings"]

_CONVOLUTIONS = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d")


class GpuSettingsProbe(Probe):
    name = "gpu_settings"

    def __init__(self) -> None:
        super().__init__()
        #: Shapes (and dtypes) the convolutions ran on in the step now running.
        self.current: set[tuple] = set()
        #: The stack of the last ``torch.set_float32_matmul_precision`` call during the run.
        self.precision_set: Optional[Stack] = None
        self.precision_value: Optional[str] = None

    def reset(self) -> None:
        super().reset()
        self.current = set()
        self.precision_set = None
        self.precision_value = None

    def install(self, patcher: Patcher) -> None:
        import torch
        import torch.nn.functional as F

        self.reset()
        patcher.callback(self.reset, deferred=True)
        probe = self
        flags = FLAGS
        is_compiling = is_compiling_function()

        def conv(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def wrapper(input: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.in_scope:  # never traced into a graph
                    try:
                        probe.current.add((tuple(input.shape), str(input.dtype)))
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                return original(input, *args, **kwargs)

            return wrapper

        for name in _CONVOLUTIONS:
            if callable(getattr(F, name, None)):
                patcher.wrap(F, name, conv)

        def precision(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def set_float32_matmul_precision(*args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                try:
                    probe.precision_set = capture(2)
                    probe.precision_value = str(args[0] if args else kwargs.get("precision"))
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                return original(*args, **kwargs)

            return set_float32_matmul_precision

        if callable(getattr(torch, "set_float32_matmul_precision", None)):
            patcher.wrap(torch, "set_float32_matmul_precision", precision)

    def take_step(self) -> frozenset:
        """The shapes of the step that just ended (and start the next one empty)."""
        shapes, self.current = frozenset(self.current), set()
        return shapes


def settings() -> dict[str, Any]:
    """TF32 for float32 matmuls and cuDNN convolutions, and ``cudnn.benchmark``, as torch has them now."""
    import torch

    precision = torch.get_float32_matmul_precision()
    cudnn = torch.backends.cudnn
    return {
        "matmul_tf32": precision != "highest",
        "matmul_precision": precision,
        "conv_tf32": bool(getattr(cudnn, "allow_tf32", True)),
        "cudnn_benchmark": bool(getattr(cudnn, "benchmark", False)),
    }
