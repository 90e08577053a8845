"""Probe ``collectives``: the ``torch.distributed`` collectives a process calls, DDP's buffer broadcasts, FSDP2.

Patched while a run needs it, all undone with the probe:

- the collective functions of ``torch.distributed`` (and of ``distributed_c10d``, where torch's own code
  finds them): ``all_reduce``, ``broadcast``, ``all_gather`` (and ``all_gather_into_tensor``,
  ``all_gather_single``, ``all_gather_object``), ``reduce_scatter`` (and ``reduce_scatter_tensor``,
  ``reduce_scatter_single``), ``all_reduce_coalesced``, ``broadcast_object_list``: each call sends
  ``on_collective(kind, nbytes, frame)``; a collective called inside another (``all_gather_object``
  runs ``all_gather``) is the outer one's, counted once, and its tensors' bytes are the outer one's:
  an object collective (``broadcast_object_list``, ``all_gather_object``) has no tensor argument, its
  size is what its own collectives carried (the pickled objects' sizes and bytes), sent once it returns;
- ``DistributedDataParallel._sync_buffers``: ``on_ddp_buffers(ddp)`` before DDP broadcasts its module
  buffers from rank 0 (a forward with ``broadcast_buffers=True``; the broadcast itself is C++);
- FSDP2's own all-gathers and reduce-scatters are ``torch.distributed`` calls: counted as the others (its
  parameter groups' forwards and backwards are the probe :mod:`pytest_torchperf.probes.fsdp`).

DDP's gradient all-reduce runs in its C++ reducer: it is seen by the ``ddp`` probe (``on_ddp_armed``, one
round per backward). What it costs: one Python call and a few attribute reads per collective and per DDP
forward; nothing per tensor op.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from .._guard import caller_frame
from ..core import FLAGS
from ..patching import wraps
from . import Probe, is_compiling_function

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["CollectivesProbe", "KINDS", "tensor_bytes"]

#: torch.distributed function -> (the kind it counts as, which argument holds its data).
KINDS: dict[str, tuple[str, int]] = {
    "all_reduce": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0),
    "broadcast": ("broadcast", 0),
    "broadcast_object_list": ("broadcast", -1),
    "all_gather": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather_single": ("all_gather", 0),
    "_all_gather_base": ("all_gather", 0),
    "all_gather_object": ("all_gather", -1),
    "reduce_scatter": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "_reduce_scatter_base": ("reduce_scatter", 1),
}

def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor or of a list of tensors (0 for anything else)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(v.numel() * v.element_size() for v in value if isinstance(v, torch.Tensor))
    return 0


class CollectivesProbe(Probe):
    name = "collectives"

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def install(self, patcher: Patcher) -> None:
        import torch

        self.reset()
        distributed = getattr(torch, "distributed", None)
        if distributed is None or not distributed.is_available():
            self.unavailable["collectives"] = "this torch is built without torch.distributed"
            return
        import torch.distributed.distributed_c10d as c10d
        from torch.nn.parallel import DistributedDataParallel

        probe = self
        local = self._local
        flags = FLAGS
        is_compiling = is_compiling_function()
        notify = core.notify

        def wrap_collective(kind: str, position: int) -> Callable[[Any], Any]:
            def make(original: Callable[..., Any]) -> Callable[..., Any]:
                @wraps(original)
                def collective(*args: Any, **kwargs: Any) -> Any:
                    __tracebackhide__ = True
                    # is_compiling() first: dynamo folds it, and its graph then guards on nothing of ours.
                    if is_compiling() or not flags.active or probe.disabled:
                        return original(*args, **kwargs)
                    if getattr(local, "depth", False):  # inside another collective: its bytes are the outer one's
                        if 0 <= position < len(args):
                            local.sent = getattr(local, "sent", 0) + tensor_bytes(args[position])
                        return original(*args, **kwargs)
                    if position < 0:  # an object collective: what it sends is known once its own collectives ran
                        return objects(original, args, kwargs)
                    try:
                        data = args[position] if 0 <= position < len(args) else None
                        notify("on_collective", kind, tensor_bytes(data), caller_frame())
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                    local.depth = 1
                    try:
                        return original(*args, **kwargs)
                    finally:
                        local.depth = 0

                def objects(original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
                    __tracebackhide__ = True
                    frame = caller_frame(2)
                    local.depth = 1
                    local.sent = 0
                    try:
                        result = original(*args, **kwargs)
                    finally:
                        local.depth = 0
                    try:  # the pickled objects' sizes and bytes, as the tensors it sent or received carry them
                        notify("on_collective", kind, local.sent, frame)
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                    return result

                return collective

            return make

        for module in (distributed, c10d):
            for fn_name, (kind, position) in KINDS.items():
                if callable(getattr(module, fn_name, None)):
                    patcher.wrap(module, fn_name, wrap_collective(kind, position))

        def wrap_sync_buffers(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def _sync_buffers(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    notify("on_ddp_buffers", self)
                local.depth = 1  # its own all_reduce (join mode) is the broadcast's
                try:
                    return original(self, *args, **kwargs)
                finally:
                    local.depth = 0

            return _sync_buffers

        if callable(vars(DistributedDataParallel).get("_sync_buffers")):
            patcher.wrap(DistributedDataParallel, "_sync_buffers", wrap_sync_buffers)
        else:  # pragma: no cover - a torch without it
            self.unavailable["ddp_buffers"] = "this torch's DDP buffer broadcast cannot be observed"
