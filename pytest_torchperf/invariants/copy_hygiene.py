"""Invariant ``copy_hygiene`` (opt-in): asynchronous copies that overlap nothing, or return wrong data.

Three patterns inside the step, each reported at its line:

- **non_blocking from unpinned memory**: ``x.to(device, non_blocking=True)`` of a
  batch from a DataLoader built without ``pin_memory=True``. A copy from pageable
  memory goes through a staging buffer and the host waits for it: the flag
  overlaps nothing. On a CPU-only run, where the "device" is the CPU and nothing
  can be pinned, the loader's ``pin_memory`` setting is judged; on CUDA, also any
  real host-to-device ``non_blocking`` copy of memory that is not pinned.
- **a device-to-host non_blocking result read too early**: ``y = x.to("cpu",
  non_blocking=True)`` (or ``buf.copy_(x, non_blocking=True)``) read on the host
  (``.item()``, ``.tolist()``, ``.numpy()``, ``print``...) before any
  synchronisation. On a GPU the copy may not have landed: the values are wrong
  (PyTorch's pinned-memory tutorial). Always a failure. On a CPU-only run a copy
  is device-to-host when the line writes ``"cpu"`` out (or ``copy_``'s destination
  is a host tensor by construction), and the synchronisations that count are
  the ones the run makes: ``torch.cuda.synchronize()``, a stream's or event's
  ``synchronize()``, ``torch.get_device_module(device).synchronize()``
  (``torch.cpu.synchronize`` on a CPU), or a read of a device tensor (``loss.item()``).
  A sync under ``if torch.cuda.is_available():`` is not made on a CPU-only run:
  write it device-agnostically.
- **``.pin_memory()`` in the step**: pinning copies the tensor into page-locked
  memory on the host, which blocks the host every step; pin in the DataLoader
  (``pin_memory=True``, its own thread) or into a buffer allocated once. On a
  CPU-only machine torch raises on the call; it is reported before torch runs it.

Copies made by a library's code are notes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..frames import locate, owner_label, stack_of
from ..probes.syncs import UnsyncedRead
from ..probes.tensors import AsyncCopy
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import USER, Frame, Stack, site_of
from ..text import plural
from ._steps import PerStep, extent, frequency

if TYPE_CHECKING:
    from types import FrameType

    from ..core import Run

NAME = "copy_hygiene"

UNPINNED = "unpinned_non_blocking_copies"
EARLY_READ = "unsynchronised_reads"
PIN_IN_STEP = "pin_memory_in_step"
KINDS = (UNPINNED, EARLY_READ, PIN_IN_STEP)

_TITLES = {
    UNPINNED: "non_blocking=True copy from memory that is not pinned",
    EARLY_READ: "device-to-host non_blocking copy read before a synchronisation",
    PIN_IN_STEP: "`.pin_memory()` called in the step",
}
_REASONS = {
    UNPINNED: "from pageable memory the copy is staged by the host and nothing overlaps it: the flag does nothing",
    EARLY_READ: "the copy may not have landed when the host reads it: on a GPU the values are wrong (stale or "
                "partly written), with no error",
    PIN_IN_STEP: "pinning copies the tensor into page-locked host memory, and the host waits for it, every step",
}
_HINTS = {
    UNPINNED: "build the DataLoader with `pin_memory=True` (it pins in its own thread), or drop non_blocking",
    EARLY_READ: "synchronise before the read: `torch.cuda.synchronize()`, or record an event after the copy "
                "(`ev = torch.cuda.Event(); ev.record()`) and `ev.synchronize()` before reading; or copy "
                "without non_blocking",
    PIN_IN_STEP: "pin in the DataLoader (`pin_memory=True`), or allocate a pinned buffer once "
                 "(`torch.empty(shape, pin_memory=True)`) and `buf.copy_(x)` into it",
}


class _Pattern(PerStep):
    """One pattern at one line."""

    def __init__(self, kind: str, stack: Stack, by_user: bool, facts: list[str]) -> None:
        super().__init__()
        self.kind = kind
        self.stack = stack
        self.frame: Optional[Frame] = site_of(stack)
        self.by_user = by_user
        self.facts = facts

    def to_dict(self, total: int) -> dict[str, Any]:
        frame = self.frame
        return {
            "kind": self.kind,
            "site": frame.location() if frame else None,
            "function": frame.function if frame else None,
            "source": frame.source if frame else None,
            "code": "user" if self.by_user else "framework",
            "count": self.count,
            "frequency": frequency(self.per_unit, self.outside, total),
        }


class CopyHygieneCheck(Check):
    """Per-run state and verdict of ``copy_hygiene``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self._patterns: dict[Any, _Pattern] = {}
        self._log = run.probe("loaders").log_for(run, batches=True)
        self._syncs = run.probe("syncs")
        self._log.contents = True
        self.copies = 0

    def _add(self, kind: str, frame: Optional[FrameType], facts: list[str]) -> None:
        located = locate(frame)
        if located.frame is None:
            return
        key = (kind, located.frame.f_code, located.frame.f_lineno)
        pattern = self._patterns.get(key)
        if pattern is None:
            pattern = self._patterns[key] = _Pattern(kind, stack_of(frame), located.kind == USER, facts)
        pattern.add(self.run.unit, 0)

    # -- events from the probes ------------------------------------------------------------
    def on_async_copy(self, event: AsyncCopy) -> None:
        self.copies += 1
        if event.to_host:
            self._syncs.await_sync(event.result, (self, _where(event.frame)))
            return
        source = event.source
        rec = self._log.loader_of_tensor(source)
        if rec is not None:
            loader = rec.ref()
            if loader is not None:
                rec.refresh(loader)
            if rec.pin_memory:
                return
            facts = [f"the batch comes from {rec.describe(pin_memory=False)}"]
        elif source.device.type == "cpu" and event.result.device.type != "cpu" and not _pinned(source):
            facts = ["a real host-to-device copy from pageable memory on this machine"]
        else:
            return
        self._add(UNPINNED, event.frame, facts)

    def on_unsynced_read(self, read: UnsyncedRead) -> None:
        owner, copied_at = read.token
        if owner is not self:
            return
        facts = [f"copied with non_blocking=True at {copied_at}" if copied_at else "copied with non_blocking=True"]
        facts.append(f"read with {read.op.label} before any synchronisation")
        self._add(EARLY_READ, read.frame, facts)

    def on_pin_memory(self, frame: Optional[FrameType]) -> None:
        self._add(PIN_IN_STEP, frame, [])

    # -- verdict -------------------------------------------------------------------------------
    def _finding(self, p: _Pattern) -> Finding:
        total = self.run.units
        note = "" if p.by_user else "note: "
        where = f" in {p.frame.function}" if p.frame is not None else ""
        title = f"{note}{_TITLES[p.kind]}{where}: {frequency(p.per_unit, p.outside, total, self.run.unit_name)}"
        facts = list(p.facts) + [_REASONS[p.kind]]
        if not p.by_user and p.frame is not None:
            facts.append(f"made by {owner_label(p.frame)}, not by your code: a note, not a failure")
        return Finding(title, facts, [Site(_TITLES[p.kind], p.stack, p.count)], _HINTS[p.kind] if p.by_user else "")

    def result(self) -> CheckResult:
        run = self.run
        total = run.units
        patterns = list(self._patterns.values())
        failing = [p for p in patterns if p.by_user]
        noted = [p for p in patterns if not p.by_user]
        figures: Figures = {"scope": run.scope, "steps": total, "non_blocking_copies": self.copies}
        for kind in KINDS:
            figures[kind] = sum(p.count for p in failing if p.kind == kind)  # type: ignore[literal-required]
        figures["sites"] = len(failing)
        figures["framework_copies"] = sum(p.count for p in noted)
        figures["events"] = [p.to_dict(total) for p in patterns]
        findings = [self._finding(p) for p in failing + noted]
        count = sum(p.count for p in failing)
        if failing:
            first = failing[0]
            where = f" at {first.frame.location()}" if first.frame else ""
            more = f" (+{plural(len(failing) - 1, 'more site')})" if len(failing) > 1 else ""
            return CheckResult(NAME, FAILED, f"{_TITLES[first.kind]}{where}{more}", count, findings, figures)
        if not total:
            return CheckResult(NAME, NOT_CHECKED, "no training step ran: nothing to judge", 0, findings, figures)
        what = f"{plural(self.copies, 'non_blocking copy', 'non_blocking copies')}, none wasted or read early"
        return CheckResult(NAME, PASSED, f"{what} {extent(run)}", 0, findings, figures)


def _where(frame: Optional[FrameType]) -> str:
    located = locate(frame)
    if located.frame is None:
        return ""
    code = located.frame.f_code
    return f"{code.co_filename.rsplit('/', 1)[-1]}:{located.frame.f_lineno}"


def _pinned(tensor: Any) -> bool:
    try:
        return bool(tensor.is_pinned())
    except Exception:  # noqa: BLE001 - no pinned memory on this build
        return False


class Figures(TypedDict, total=False):
    """The figures of a copy_hygiene verdict (see :mod:`pytest_torchperf.figures`)."""

    scope: str
    steps: int
    non_blocking_copies: int
    unpinned_non_blocking_copies: int
    unsynchronised_reads: int
    pin_memory_in_step: int
    sites: int
    framework_copies: int
    events: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc="no non_blocking copy from unpinned memory, no device-to-host non_blocking result read before a "
        "synchronisation, no .pin_memory() inside the step",
    check=CopyHygieneCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("tensors", "syncs", "loaders"),
)
