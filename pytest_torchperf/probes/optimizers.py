"""Optimizer steps, for the checks that judge the training itself rather than one line of it.

``pin_memory`` and ``mixed_precision`` need to know what the run trained and
where (an optimizer stepping parameters on a CUDA device is a CUDA run,
whatever the machine has); ``grads_set_to_none`` looks at the gradients each
step consumed. One global optimizer step *post*-hook
(``torch.optim.optimizer.register_optimizer_step_post_hook``, called by every
``Optimizer.step``, Lightning's included) sends ``on_optimizer_step(optimizer)``
to the checks of every active run; it is removed with the probe. A post-hook, because Lightning runs the
forward and backward inside ``optimizer.step(closure)``: only after the step has the step's work happened.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any

from .. import core
from ..core import FLAGS
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["OptimizersProbe", "parameters"]


def parameters(optimizer: Any) -> list[Any]:
    """The optimizer's parameters, in ``param_groups`` order."""
    return [p for group in getattr(optimizer, "param_groups", ()) for p in group.get("params", ())]


class OptimizersProbe(Probe):
    """The optimizer step post-hook (see the module's docstring)."""

    name = "optimizers"

    def __init__(self) -> None:
        super().__init__()
        #: Optimizer -> (key, device types, dtypes) of its parameters; see :meth:`placement`.
        self.placements: weakref.WeakKeyDictionary[Any, tuple[tuple, frozenset, frozenset]] = (
            weakref.WeakKeyDictionary()
        )

    def reset(self) -> None:
        super().reset()
        self.placements.clear()

    def install(self, patcher: Patcher) -> None:
        """Register the step post-hook; removed by ``patcher``."""
        self.reset()
        patcher.callback(self.reset, deferred=True)
        try:
            module = importlib.import_module("torch.optim.optimizer")
        except ImportError:  # pragma: no cover
            module = None
        register = getattr(module, "register_optimizer_step_post_hook", None)
        if register is None:  # pragma: no cover - torch < 2.0
            self.unavailable["optimizer_steps"] = "this torch has no global optimizer step hook"
            return
        flags = FLAGS
        probe = self

        def on_step(optimizer: Any, args: Any, kwargs: Any) -> None:
            if flags.active and not probe.disabled:
                try:
                    probe.stepped(optimizer)
                except Exception as exc:  # noqa: BLE001 - never into the user's optimizer step
                    probe.failed(exc)

        handle = register(on_step)
        patcher.callback(handle.remove, deferred=True)

    def placement(self, optimizer: Any) -> tuple[frozenset, frozenset]:
        """``({"cuda"}, {"float32"})``: device types and dtypes of the optimizer's parameters.

        Cached per optimizer while its group count, its first group's size and
        its first parameter's device and dtype stay the same (a module moved after
        the optimizer was built keeps its Parameter objects, so the device is part
        of the key).
        """
        groups = getattr(optimizer, "param_groups", None) or ()
        first_group = groups[0].get("params") if groups else None
        if first_group:
            first = first_group[0]
            key: tuple = (len(groups), len(first_group), first.device, first.dtype)
        else:
            key = (len(groups),)
        cached = self.placements.get(optimizer)
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        params = parameters(optimizer)
        devices = frozenset(p.device.type for p in params)
        dtypes = frozenset(str(p.dtype).replace("torch.", "") for p in params)
        try:
            self.placements[optimizer] = (key, devices, dtypes)
        except TypeError:  # pragma: no cover - an optimizer that cannot be weakly referenced
            pass
        return devices, dtypes

    def stepped(self, optimizer: Any) -> None:
        core.notify("on_optimizer_step", optimizer)
