"""Probe ``grads``: gradients zeroed in place, by ``zero_grad(set_to_none=False)`` or ``p.grad.zero_()``.

- ``Optimizer.zero_grad`` and ``Module.zero_grad`` are wrapped: a call with
  ``set_to_none=False`` sends ``on_zero_grad(owner, stack)``;
- ``Tensor.zero_`` is wrapped: zeroing a tensor that is (or aliases, like
  ``p.grad.data``) the current gradient of a parameter some optimizer stepped
  sends ``on_grad_zeroed(shape, stack)``. The gradients of the parameters every
  optimizer stepped are indexed by storage address, lazily: at the first
  ``zero_`` call after each optimizer step (so a program that never calls
  ``zero_`` pays nothing), and a hit is confirmed against the parameter's
  current ``.grad``.

Events go to the checks of every active run.
"""

from __future__ import annotations

import importlib
import weakref
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..core import FLAGS
from ..patching import wraps
from ..stacks import capture
from . import Probe, is_compiling_function
from .optimizers import parameters
from .tensors import _subclass_dispatch

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["GradsProbe"]


class GradsProbe(Probe):
    name = "grads"

    def __init__(self) -> None:
        super().__init__()
        self.reset()

    def reset(self) -> None:
        super().reset()
        #: Gradient storage address -> (parameter, gradient shape), rebuilt lazily (see :meth:`index`).
        self.grad_owners: dict[int, tuple[weakref.ref, tuple]] = {}
        #: The optimizers that stepped while a run checked this invariant.
        self.optimizers_seen: weakref.WeakSet[Any] = weakref.WeakSet()
        #: Optimizer steps seen, and the step count when ``grad_owners`` was last built.
        self.generation = 0
        self.indexed_at = -1
        #: > 0 inside a wrapped zero_grad (its own in-place zeroing is that call's, not a manual one).
        self.inside_zero_grad = 0
        self.strided: Any = None

    def index(self) -> dict[int, tuple[weakref.ref, tuple]]:
        """The gradient index, rebuilt once per optimizer step, when a ``zero_`` call first needs it."""
        if self.indexed_at != self.generation:
            self.indexed_at = self.generation
            self.grad_owners.clear()
            for optimizer in list(self.optimizers_seen):
                for p in parameters(optimizer):
                    grad = p.grad
                    if grad is not None and grad.layout is self.strided:
                        ptr = grad.data_ptr()
                        if ptr:
                            self.grad_owners[ptr] = (weakref.ref(p), tuple(grad.shape))
        return self.grad_owners

    def install(self, patcher: Patcher) -> None:
        """Wrap the zeroing calls and index gradients; undone by ``patcher``."""
        import torch

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        is_compiling = is_compiling_function()
        probe = self
        self.strided = torch.strided
        tensor_type = torch.Tensor
        dispatch = _subclass_dispatch(torch)

        def wrap_zero_grad(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def zero_grad(self: Any, *args: Any, **kwargs: Any) -> Any:
                __tracebackhide__ = True
                if not is_compiling() and flags.active:
                    try:
                        set_to_none = kwargs.get("set_to_none", args[0] if args else True)
                        if not set_to_none and core.handlers("on_zero_grad"):
                            core.notify("on_zero_grad", type(self).__name__, capture(2))
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)
                probe.inside_zero_grad += 1
                try:
                    return original(self, *args, **kwargs)
                finally:
                    probe.inside_zero_grad -= 1

            return zero_grad

        def wrap_zero_(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def zero_(self: Any) -> Any:
                if type(self) is not tensor_type and dispatch.overrides(self):
                    return dispatch.call(original, self, (), {})
                # is_compiling() first: under torch.compile this wrapper is traced, and reading the
                # flags would make the compiled code guard on torchperf's state.
                if not is_compiling() and flags.active and probe.optimizers_seen and not probe.inside_zero_grad:
                    try:
                        probe._zeroed(self)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return original(self)

            return zero_

        try:
            optimizer_module = importlib.import_module("torch.optim.optimizer")
            register = getattr(optimizer_module, "register_optimizer_step_post_hook", None)
        except ImportError:  # pragma: no cover
            register = None
        if register is not None:

            def stepped(optimizer: Any, args: Any, kwargs: Any) -> None:  # a step post-hook
                """Remember the optimizer and invalidate the gradient index (only while a run checks this)."""
                try:
                    if flags.active and not probe.disabled and core.handlers("on_grad_zeroed"):
                        probe.generation += 1
                        if optimizer not in probe.optimizers_seen:
                            probe.optimizers_seen.add(optimizer)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)

            handle = register(stepped)
            patcher.callback(handle.remove, deferred=True)
        else:  # pragma: no cover - torch < 2.0
            self.unavailable["grad_index"] = "this torch has no global optimizer step hook"

        patcher.wrap(torch.optim.Optimizer, "zero_grad", wrap_zero_grad)
        patcher.wrap(torch.nn.Module, "zero_grad", wrap_zero_grad)
        patcher.wrap(tensor_type, "zero_", wrap_zero_)

    def _zeroed(self, tensor: Any) -> None:
        try:
            ptr = tensor.data_ptr()
        except Exception:  # noqa: BLE001 - tensors without storage (sparse, meta, subclasses)
            ptr = 0
        owner = self.index().get(ptr) if ptr else None
        if owner is not None:
            param = owner[0]()
            grad = getattr(param, "grad", None)
            if grad is not None and grad.data_ptr() == ptr and core.handlers("on_grad_zeroed"):
                core.notify("on_grad_zeroed", owner[1], capture(3))
