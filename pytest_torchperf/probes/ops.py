"""Probe ``ops``: every ATen operation a counted training step runs, by name, exactly.

A ``TorchDispatchMode`` (``torch.utils._python_dispatch``) is pushed on the
dispatch-mode stack when the first counting check opens a step and popped when
the last one closes it; outside counted steps (warm-up, validation, between
steps) nothing is pushed, so nothing is paid. Inside, every operator call that
reaches the dispatcher's Python key comes through
:meth:`_CountingMode.__torch_dispatch__`: one dict increment keyed by the
operator, then the operator runs unchanged. That includes the backward's ops
(the autograd engine carries the mode stack to its threads) and a
``torch.distributed`` collective's ``c10d`` op.

What a dispatch mode sees is the ATen level, below autograd: an op that is a
composite of others (``linear``) shows as the ops it runs (``t``, ``addmm``).
The mode declares ``ignore_compile_internals()``: ``torch.compile`` compiles
as it would unwatched (a mode without it makes dynamo skip every frame), and a
compiled graph's ops are not passed to it, only the graph's own calls (an
inductor kernel is not an ATen op). Custom C++ extensions' kernels called
outside the dispatcher are not seen; ops in their own namespace registered
with the dispatcher are (``myext::fused_op``). ``profiler::`` bookkeeping ops
(``record_function`` ranges) are left out.

Attribution costs more than counting, so it is sampled: in the first counted
step (the *sample step*) each op call is also located (the innermost frame
outside torch, :func:`pytest_torchperf.frames.locate`), with the device type of
its first tensor argument. Later steps only count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from .. import core
from .._guard import caller_frame
from ..frames import StackCache, locate
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["OpsProbe", "op_name"]


def op_name(func: Any) -> str:
    """``aten::lerp_`` for ``torch.ops.aten.lerp_.Scalar`` (a higher-order operator: its name)."""
    schema = getattr(func, "_schema", None)
    if schema is not None:
        return str(schema.name)
    name = getattr(func, "name", None)
    return str(name() if callable(name) else (name or func))


def _device_of(args: Any) -> str:
    import torch

    for arg in args:
        if isinstance(arg, torch.Tensor):
            return arg.device.type
        if isinstance(arg, (list, tuple)) and arg and isinstance(arg[0], torch.Tensor):
            return arg[0].device.type
    return ""


#: Where torch's optimizers live: an op issued from there is the optimizer's.
_OPTIM = "/torch/optim/"


class Sample:
    """What the sample step located: per (op, site key) the calls, the stack and a device."""

    def __init__(self) -> None:
        #: (id(op), site key) -> [calls, stack, whether a torch optimizer issued it, the ids of the tensors an
        #: in-place op wrote (None: not an in-place op)]: an in-place op that wrote a different tensor on each
        #: call (an EMA's ``e.lerp_(p, w)`` over its lists) ran on independent tensors, one call per tensor
        self.sites: dict[Any, list[Any]] = {}
        #: id(op) -> whether it writes its first argument in place (``aten::lerp_``)
        self.inplace: dict[Any, bool] = {}
        #: id(op) -> device type of its first tensor argument ("" when it had none)
        self.devices: dict[Any, str] = {}
        self.stacks = StackCache()


class OpsProbe(Probe):
    name = "ops"

    def __init__(self) -> None:
        super().__init__()
        self.mode: Any = None
        #: Checks that have a step open now (each gets the counts of the steps it opened).
        self.open: list[Any] = []
        #: id(op) -> calls in the step open now (:meth:`op_of` gives the op).
        self.counts: dict[Any, int] = {}
        #: id(op) -> the op, for every op this probe counted (a few hundred objects torch keeps alive anyway).
        #: Held here, not by the module: a check reads it through its run's probe, never by importing this
        #: module again (a module imported anew, as an in-process pytester session does, has other globals).
        self.ops: dict[int, Any] = {}
        self.sample: Optional[Sample] = None

    def reset(self) -> None:
        super().reset()
        self._leave()
        self.open = []
        self.counts = {}
        self.sample = None

    def op_of(self, key: int) -> Any:
        """The op counted under ``key`` (a key of :attr:`counts`)."""
        return self.ops[key]

    def install(self, patcher: Patcher) -> None:
        self.reset()
        patcher.callback(self.reset, deferred=True)
        mode_class = _mode_class()
        self.mode = mode_class(self)
        code = mode_class.__torch_dispatch__.__code__  # type: ignore[attr-defined]

        def skip(eval_frame: Any) -> None:
            # Dynamo never compiles the counting frame (a compiled region's eager ops reach it), and the
            # mode is not wrapped in torch's per-call ``_disable_dynamo`` (tens of microseconds per op).
            skip_code = getattr(eval_frame, "skip_code", None)
            if callable(skip_code):
                skip_code(code)

        patcher.on_import("torch._dynamo.eval_frame", skip)

    # -- what the checks call -------------------------------------------------------------------
    def begin(self, owner: Any, sample: bool) -> None:
        """``owner`` opens a counted step (``sample``: locate every call in it)."""
        if self.disabled or self.mode is None or owner in self.open:
            return
        try:
            if not self.open:
                self.counts = {}
                self.sample = Sample() if sample else None
                self.mode.__enter__()
            elif sample and self.sample is None:
                self.sample = Sample()
            self.open.append(owner)
        except Exception as exc:  # noqa: BLE001 - never into the user's code
            self.failed(exc)

    def end(self, owner: Any) -> tuple[dict[Any, int], Optional[Sample]]:
        """``owner`` closes its step: the calls counted in it, and what was located if it sampled."""
        if owner not in self.open:
            return {}, None
        self.open.remove(owner)
        counts, sample = dict(self.counts), self.sample
        if not self.open:
            self._leave()
            self.sample = None
        return counts, sample

    def _leave(self) -> None:
        mode = self.mode
        if mode is None or not getattr(mode, "entered", False):
            return
        try:
            from torch.utils._python_dispatch import _get_current_dispatch_mode

            if _get_current_dispatch_mode() is not mode:
                raise RuntimeError("another TorchDispatchMode entered in a step is still active at its end")
            mode.__exit__(None, None, None)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)


def _mode_class() -> type:
    """The counting mode's class (built on first use: defining it imports torch)."""
    global _MODE
    if _MODE is not None:
        return _MODE
    from torch.utils._python_dispatch import TorchDispatchMode

    flags = core.FLAGS

    class _CountingMode(TorchDispatchMode):
        """Counts each operator call of the step (see the module's docstring)."""

        supports_higher_order_operators = True

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return False  # see OpsProbe.install: the frame is skipped by dynamo's code table instead

        @classmethod
        def ignore_compile_internals(cls) -> bool:
            return True

        def __init__(self, probe: OpsProbe) -> None:
            super().__init__()
            self.probe = probe
            self.entered = False

        def __enter__(self) -> Any:
            out = super().__enter__()
            self.entered = True
            return out

        def __exit__(self, *exc_info: Any) -> None:
            self.entered = False
            super().__exit__(*exc_info)

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            probe = self.probe
            if not flags.active:  # torchperf's own work inside a step (core.suspended())
                return func(*args, **(kwargs or {}))
            counts = probe.counts
            key = id(func)  # an OpOverload hashes in Python: its id is the same op, cheaper
            if key in counts:
                counts[key] += 1
            else:
                counts[key] = 1
                probe.ops[key] = func
            if probe.sample is not None:
                try:
                    _locate(probe.sample, func, args, caller_frame())
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.sample = None
                    core.probe_failed("ops", exc)
            return func(*args, **(kwargs or {}))

    _MODE = _CountingMode
    return _MODE


_MODE: Optional[type] = None


def _locate(sample: Sample, func: Any, args: Any, frame: Any) -> None:
    located = locate(frame)
    key = (id(func), located.key)
    site = sample.sites.get(key)
    inplace = sample.inplace.get(id(func))
    if inplace is None:
        name = op_name(func)
        inplace = sample.inplace[id(func)] = name.endswith("_") and "::_foreach_" not in name
    if site is None:
        optim = False
        f = frame
        while f is not None and f is not located.frame:
            if _OPTIM in f.f_code.co_filename.replace("\\", "/"):
                optim = True
                break
            f = f.f_back
        site = sample.sites[key] = [0, sample.stacks.get(located.key, located.frame), optim, set() if inplace else None]
    site[0] += 1
    if inplace and args:
        site[3].add(id(args[0]))
    if id(func) not in sample.devices:
        sample.devices[id(func)] = _device_of(args)
