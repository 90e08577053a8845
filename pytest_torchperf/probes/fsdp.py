"""Probe ``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) parameter groups' forwards and backwards.

Patched on torch's FSDP2 internals when their module is imported (a run that
never imports FSDP2 patches nothing), undone with the probe:
``FSDPParamGroup.pre_forward`` sends ``on_fsdp_forward(group)`` and
``post_backward`` sends ``on_fsdp_reduce(group, reduces)`` (``reduces``: it
reduce-scatters the gradients now, i.e. the module was not told
``set_requires_gradient_sync(False)``). One Python call per parameter group per
forward and per backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from . import Probe, is_compiling_function

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["FSDPProbe"]

_FSDP_GROUP = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


class FSDPProbe(Probe):
    name = "fsdp"

    def install(self, patcher: Patcher) -> None:
        self.reset()
        patcher.on_import(_FSDP_GROUP, lambda module: self._patch_fsdp(patcher, module))

    def _patch_fsdp(self, patcher: Patcher, module: Any) -> None:
        group = getattr(module, "FSDPParamGroup", None)
        methods = vars(group) if group is not None else {}
        if not callable(methods.get("post_backward")) or not callable(methods.get("pre_forward")):
            self.unavailable["fsdp"] = "this torch's FSDP2 parameter groups cannot be observed"
            return
        flags = FLAGS
        notify = core.notify
        is_compiling = is_compiling_function()

        def wrap_pre_forward(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def pre_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    notify("on_fsdp_forward", self)
                return original(self, *args, **kwargs)

            return pre_forward

        def wrap_post_backward(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def post_backward(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    notify("on_fsdp_reduce", self, bool(getattr(self, "reduce_grads", True)))
                return original(self, *args, **kwargs)

            return post_backward

        patcher.wrap(group, "pre_forward", wrap_pre_forward)
        patcher.wrap(group, "post_backward", wrap_post_backward)
