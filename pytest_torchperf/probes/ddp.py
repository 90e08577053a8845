"""Probe ``ddp``: ``DistributedDataParallel`` modules built, their forward passes, and each all-reduce they arm.

Three class patches, undone with the probe:

- ``DistributedDataParallel.__init__``: remembers where each instance was built
  (the user's line, or the Lightning strategy that wrapped the model);
- ``DistributedDataParallel.forward``: sends ``on_ddp_forward(module)`` before
  the forward runs (a forward with gradients enabled is a micro-batch);
- the reducer's ``prepare_for_backward`` (``torch._C._distributed_c10d.Reducer``):
  sends ``on_ddp_armed(reducer)`` before it runs. This call is what makes the
  next backward all-reduce every gradient bucket: DDP makes it at the end of
  a forward with ``require_backward_grad_sync`` set (not inside ``no_sync()``),
  Lightning makes it itself before a manual-optimization backward. So the
  calls count all-reduce rounds exactly, whoever decides. Before it runs, the
  reducer still holds the previous backward's map of which parameters got a
  gradient, on how many ranks (``reducer._get_local_used_map()``), which
  ``no_unused_parameters_search`` folds on the device.

What it costs: one Python call per DDP forward and one per armed backward (a
few microseconds each); nothing per parameter. What it misses: a DDP compiled
whole by ``torch.compile`` (the wrappers call straight through while dynamo
traces), a forward that bypasses DDP (``model.module(x)``: DDP then syncs nothing).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from ..stacks import Stack
from . import Probe, is_compiling_function, record_creation

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["DDPProbe", "reducer_parameter_names"]


def reducer_parameter_names(ddp: Any) -> list[str]:
    """The names of ``ddp``'s parameters in its reducer's order (how DDP builds that list)."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    names: list[str] = []
    seen: set[int] = set()
    for module_name, module in ddp.module.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if param.requires_grad and full not in ignored and id(param) not in seen:
                seen.add(id(param))
                names.append(full)
    return names


class DDPProbe(Probe):
    name = "ddp"

    def __init__(self) -> None:
        super().__init__()
        #: DDP instance -> the stack where it was built (while a run watched).
        self.created: weakref.WeakKeyDictionary[Any, Stack] = weakref.WeakKeyDictionary()
        #: DDP instance -> the framework that built it from the user's line (Lightning's strategy, the
        #: Hugging Face Trainer through accelerate), for the hints that must name the framework's setting.
        self.built_by: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        super().reset()
        self.created.clear()
        self.built_by.clear()

    def install(self, patcher: Patcher) -> None:
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        distributed = getattr(torch, "distributed", None)
        if distributed is None or not distributed.is_available():
            self.unavailable["ddp"] = "this torch is built without torch.distributed"
            return
        from torch.nn.parallel import DistributedDataParallel

        flags = FLAGS
        is_compiling = is_compiling_function()
        notify = core.notify

        def wrap_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    notify("on_ddp_forward", self)
                return original(self, *args, **kwargs)

            return forward

        def wrap_prepare(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def prepare_for_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    notify("on_ddp_armed", self)
                return original(self, *args, **kwargs)

            return prepare_for_backward

        record = record_creation(self, self.created, lambda: flags.active, self.built_by)
        patcher.wrap(DistributedDataParallel, "__init__", record)
        patcher.wrap(DistributedDataParallel, "forward", wrap_forward)
        reducer = getattr(getattr(torch._C, "_distributed_c10d", None), "Reducer", None)
        if reducer is not None and callable(vars(reducer).get("prepare_for_backward")):
            patcher.wrap(reducer, "prepare_for_backward", wrap_prepare)
        else:  # pragma: no cover - a torch whose reducer hides it
            self.unavailable["armed"] = "this torch's DDP reducer cannot be observed"
