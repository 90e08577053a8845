"""Invariant ``no_constant_buffer_broadcast``: DDP does not broadcast buffers that never change.

With ``broadcast_buffers=True`` (the default), ``DistributedDataParallel``
broadcasts every module buffer from rank 0 before each forward pass, so that
buffers a forward updates (BatchNorm's running statistics) agree on every
rank. A buffer that never changes (a causal mask, positional tables, a
constant scale) is sent on every step for nothing: 8-10% of the forward in
public reports for a large causal mask.

Seen through the probe :mod:`pytest_torchperf.probes.collectives`: at each of
DDP's buffer broadcasts, every buffer DDP syncs is compared with its value at
the first one (a copy kept for the run), on its own device and without a host
sync: the comparisons accumulate in a flag read once when the run ends (not
every write bumps a tensor's version: BatchNorm's running statistics are
updated inside its kernel). A buffer that is the same tensor with the same
values over at least two broadcasts is constant.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import core
from ..arguments import Flag
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Stack, capture, until_user_frame
from ..text import plural
from ._ddp import Context

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_constant_buffer_broadcast"


def _bytes(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


class _Module:
    """One DDP module's buffers as first seen, and whether each changed since."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        #: Where the DDP module was built (the ``ddp`` probe saw it), if it was built while a run watched.
        self.created: Optional[Stack] = None
        self.broadcasts = 0
        #: buffer name -> [id of the tensor, its first value, bytes, changed (a bool tensor until the run ends)]
        self.buffers: dict[str, list[Any]] = {}


class ConstantBufferCheck(Check):
    """Per-run state and verdict of ``no_constant_buffer_broadcast``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.context = Context()
        #: id(ddp) -> what its broadcasts showed (no reference to the module: a rank must free it).
        self.modules: dict[int, _Module] = {}
        self.forwards = 0
        self._ddp = run.probe("ddp")

    def on_framework_call(self, call: FrameworkCall) -> None:
        self.context.on_framework_call(call)

    def on_ddp_forward(self, ddp: Any) -> None:
        self.forwards += 1

    def on_ddp_buffers(self, ddp: Any) -> None:
        seen = self.modules.get(id(ddp))
        if seen is None:
            seen = self.modules[id(ddp)] = _Module(until_user_frame(capture(3)))
            seen.created = self._ddp.created.get(ddp)
        seen.broadcasts += 1
        named = getattr(ddp, "named_module_buffers", None) or {}
        with core.suspended():  # torchperf's own ops: not the step's (max_ops_per_step), never a finding
            for name, buf in named.items():
                state = seen.buffers.get(name)
                if state is None:
                    seen.buffers[name] = [id(buf), buf.detach().clone(), buf.numel() * buf.element_size(), None]
                elif state[3] is not True:
                    if state[0] != id(buf) or state[1].shape != buf.shape or state[1].dtype != buf.dtype:
                        state[3] = True
                    else:  # on the buffer's device, no host sync: read once, at the end
                        differs = (buf.detach() != state[1]).any()
                        state[3] = differs if state[3] is None else state[3].logical_or_(differs)

    def on_run_end(self) -> None:
        with core.suspended():
            for module in self.modules.values():
                for state in module.buffers.values():
                    flag = state[3]
                    state[3] = bool(flag) if flag is not None else False
                    state[1] = None  # the snapshot goes

    def result(self) -> CheckResult:
        broadcasts = sum(m.broadcasts for m in self.modules.values())
        figures: Figures = {"ddp_modules": len(self.modules), "buffer_broadcasts": broadcasts}
        figures["ddp_forwards"] = self.forwards
        if not self.modules and self.forwards:
            return CheckResult(
                NAME, PASSED, f"DDP broadcast no buffers in {plural(self.forwards, 'forward')} "
                "(broadcast_buffers=False, or no buffers)", 0, [], figures,
            )
        if not self.modules:
            why = "no DistributedDataParallel forward pass in this process"
            return CheckResult(NAME, NOT_CHECKED, why, 0, [], figures)
        findings = []
        constant_bytes = 0
        for module in self.modules.values():
            if module.broadcasts < 2:
                continue
            constant = [(n, s[2]) for n, s in module.buffers.items() if s[3] is False]
            if not constant:
                continue
            nbytes = sum(b for _, b in constant)
            constant_bytes += nbytes * module.broadcasts
            changing = [n for n, s in module.buffers.items() if s[3] is True]
            names = ", ".join(f"{n} ({_bytes(b)})" for n, b in constant[:6]) + (" ..." if len(constant) > 6 else "")
            facts = [
                f"broadcast from rank 0 before each of {plural(module.broadcasts, 'forward')}: {names}",
                f"{_bytes(nbytes * module.broadcasts)} sent for nothing in this process",
            ]
            if changing:
                facts.append(f"buffers that did change (they need the broadcast): {', '.join(changing[:6])}")
            findings.append(Finding(
                f"DDP broadcast {plural(len(constant), 'buffer')} that never changed",
                facts, self._sites(module),
                self._hint(bool(changing)),
            ))
        figures["constant_bytes_broadcast"] = constant_bytes
        if not any(m.broadcasts >= 2 for m in self.modules.values()):
            return CheckResult(NAME, NOT_CHECKED, "a single DDP buffer broadcast: nothing to compare", 0, [], figures)
        if not findings:
            return CheckResult(
                NAME, PASSED, f"every buffer DDP broadcast changed during the run ({plural(broadcasts, 'broadcast')})",
                0, [], figures,
            )
        count = sum(len(f.facts) and 1 for f in findings)
        return CheckResult(
            NAME, FAILED, f"DDP broadcast constant buffers before every forward: {_bytes(constant_bytes)} for nothing",
            count, findings, figures,
        )

    @staticmethod
    def _sites(module: _Module) -> list[Site]:
        built = [Site("DDP built with its buffer broadcast on (the default)", module.created)] if module.created else []
        return built + [Site("its forward, which broadcast them", module.stack, module.broadcasts)]

    def _hint(self, some_change: bool) -> str:
        flag = _flag()
        where = (
            f"strategy=DDPStrategy({flag}=False)" if self.context.lightning
            else f"DistributedDataParallel(model, {flag}=False)"
        )
        fix = f"build DDP with {where}"
        if some_change:
            fix = (
                "other buffers do change, so keep the broadcast and take the constant ones out of it: register them "
                "with register_buffer(name, tensor, persistent=False) built identically on every rank and list them "
                "in DDP's parameters_to_ignore (DistributedDataParallel._set_params_and_buffers_to_ignore_for_model), "
                f"or {fix} if the changing ones may differ per rank"
            )
        else:
            fix += (
                "; or register the buffer with persistent=False and build it on each rank "
                "(it then needs no broadcast)"
            )
        return fix


def _flag() -> str:
    """DDP's argument that turns the broadcast off (``forward_sync_buffers`` where torch deprecates the other)."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    try:
        names: Any = inspect.signature(DistributedDataParallel.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        names = {}
    return "forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers"


class Figures(TypedDict, total=False):
    """The figures of a no_constant_buffer_broadcast verdict (see :mod:`pytest_torchperf.figures`)."""

    ddp_modules: int
    buffer_broadcasts: int
    ddp_forwards: int
    constant_bytes_broadcast: int


INVARIANT = Invariant(
    name=NAME,
    doc="DDP does not broadcast module buffers that never change before every forward (broadcast_buffers=False)",
    check=ConstantBufferCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("collectives", "ddp"),
)
