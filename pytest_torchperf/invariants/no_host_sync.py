"""Invariant ``no_host_sync``: no GPU->CPU synchronisation inside the step, caught on CPU-only CI too.

An ``.item()`` in a training step makes the CPU wait until the GPU has run
every kernel queued so far, every step; so do ``float(t)``, ``if t > x:``, an
f-string or ``print`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``
and every operation whose output size depends on the data. The probe
:mod:`pytest_torchperf.probes.syncs` sends each such operation inside the
scope as an ``on_sync`` event; this check groups them by site (the innermost
frame outside torch: the user's line, or Lightning's when Lightning made it),
counts them per step, and fails on the user's own sites. Library syncs are
notes unless ``fail_on_framework_syncs``; ``allowed_syncs`` accepts known ones;
``max_syncs_per_step`` is a budget for code that syncs on purpose.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..allow import AllowList
from ..arguments import Argument, Flag, Integer, SiteList
from ..core import Check
from ..frames import Located, describe_frame, owner_label, stack_of
from ..probes.syncs import PROBE, WOULD, Op, Sync
from ..registry import Invariant
from ..report import CheckResult, Finding, Site
from ..stacks import USER, Frame, Stack
from ..text import plural
from ._steps import PerStep, frequency, short, step_verdict

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_host_sync"

# -- what is caught, and what to do instead -------------------------------------------------

_HINTS = {
    "value": (
        "keep the value on the device: pass the tensor itself to `self.log(...)` (Lightning reduces it "
        "without waiting), accumulate with tensor ops, and read it with `.item()` only every N steps or "
        "at epoch end (then list that site in allowed_syncs)"
    ),
    "host": (
        "keep the values on the device and accumulate them with torch ops or a torchmetrics metric; "
        "copy them to the host once at epoch end, not every step"
    ),
    "branch": (
        "a Python `if`/`while`/`assert`/`and`/`or` on a tensor makes the CPU wait for the GPU: compute "
        "both outcomes with `torch.where(cond, a, b)` (or multiply by the mask), or move the check out "
        "of the step"
    ),
    "print": (
        "printing or formatting a tensor copies it to the host: log the tensor with `self.log(...)`, "
        "or print only every N steps"
    ),
    "shape": (
        "the output size depends on the values, so the CPU must wait for the GPU to learn it: keep shapes "
        "static with `torch.where(mask, x, 0)`, `x * mask` or `x.masked_fill(~mask, 0)` and a masked "
        "sum/mean"
    ),
    "unique": (
        "`unique` has a data-dependent size: for class ids below a known N, count them with "
        "`torch.zeros(N, device=x.device).scatter_add_(0, x, torch.ones_like(x, dtype=torch.float))`"
    ),
    "bincount": (
        "`bincount` reads `x.max()` on the host to size its output: with a known N use "
        "`torch.zeros(N, device=x.device).scatter_add_(0, x, ...)` instead"
    ),
    "one_hot": "pass `num_classes=` to `F.one_hot` so it need not read `x.max()` on the host",
    "repeat": "pass `output_size=` to `repeat_interleave` so the output size need not be read from the device",
    "synchronize": (
        "an explicit `torch.cuda.synchronize()` stalls the pipeline every step: remove it, or keep it "
        "in timing code outside the watched scope"
    ),
    "cuda": (
        "torch.cuda.set_sync_debug_mode reported a synchronising CUDA operation at this line (a blocking "
        "copy, a data-dependent shape, a read of a device value)"
    ),
}



class _SyncSite(PerStep):
    """One operation at one line, as one run saw it."""

    def __init__(self, op: Op, located: Located, stack: Stack, allowed_by: Optional[str]) -> None:
        super().__init__()
        assert located.frame is not None
        self.op = op
        self.frame: Frame = describe_frame(located.frame)
        self.kind = located.kind
        self.via = located.via
        self.stack = stack
        self.allowed_by = allowed_by
        self.devices: set[str] = set()
        self.confirmed = 0

    def record(self, unit: Optional[int], device: str) -> None:
        self.add(unit)
        self.devices.add(device)

    @property
    def is_user(self) -> bool:
        return self.kind == USER

    @property
    def would_only(self) -> bool:
        return self.devices == {WOULD}

    def to_dict(self, total: int) -> dict[str, Any]:
        return {
            "operation": self.op.name,
            "label": self.op.label,
            "site": self.frame.location(),
            "function": self.frame.function,
            "source": self.frame.source,
            "code": "user" if self.is_user else self.kind,
            "via": self.via,
            "count": self.count,
            "steps_with_sync": len(self.per_unit),
            "per_step_max": self.per_step_max,
            "outside_steps": self.outside,
            "frequency": frequency(self.per_unit, self.outside, total),
            "devices": sorted(self.devices),
            "cuda_confirmed": self.confirmed,
            "allowed_by": self.allowed_by,
        }



class HostSyncCheck(Check):
    """Per-run state and verdict of ``no_host_sync``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        super().__init__(run)
        self.allow = AllowList(run.options.allowed_syncs)
        self.strict = run.options.fail_on_framework_syncs
        self._sites: dict[Any, _SyncSite] = {}
        self._host_reads_at_start = PROBE.host_reads
        self.host_reads = 0
        self.unavailable: dict[str, str] = {}

    # -- events from the probe ------------------------------------------------------
    def on_sync(self, event: Sync) -> Optional[_SyncSite]:
        located = event.located
        if located.frame is None:
            return None
        allowed_by = self.allow.match(located, event.frame) if self.allow else None
        key = (event.op.name, located.frame.f_code, located.frame.f_lineno, allowed_by)
        site = self._sites.get(key)
        if site is None:
            site = self._sites[key] = _SyncSite(event.op, located, stack_of(event.frame), allowed_by)
        site.record(self.run.unit, event.device)
        return site

    def on_run_end(self) -> None:
        self.host_reads = PROBE.host_reads - self._host_reads_at_start
        self.unavailable = dict(PROBE.unavailable)

    # -- verdict -----------------------------------------------------------------------
    def _finding(self, site: _SyncSite, note: str) -> Finding:
        total = self.run.units
        freq = frequency(site.per_unit, site.outside, total, self.run.unit_name)
        via = f" inside `{site.via}`" if site.via else ""
        title = f"{note}{site.op.label}{via} in {site.frame.function}: {freq}"
        facts = []
        if site.confirmed:
            facts.append(f"synchronised on {', '.join(sorted(site.devices - {WOULD}))} "
                         f"(confirmed {site.confirmed}x by torch.cuda.set_sync_debug_mode)")
        elif site.would_only:
            facts.append("on this CPU-only run: would synchronise on an accelerator (the tensor is not one built on the host)")
        else:
            facts.append(f"synchronises on {', '.join(sorted(site.devices - {WOULD}))}")
        if site.allowed_by:
            facts.append(f"accepted by allowed_syncs entry {site.allowed_by!r}")
        elif not site.is_user:
            owner = owner_label(site.frame)
            if self.strict:
                facts.append(f"made by {owner}, not by your code (failing because fail_on_framework_syncs=True)")
            else:
                facts.append(f"made by {owner}, not by your code: a note, not a failure (fail_on_framework_syncs=True fails on it)")
        label = site.op.label.split(" (")[0]
        failing = (site.is_user or self.strict) and not site.allowed_by
        hint = _HINTS[site.op.hint] if failing else ""
        # A note keeps its stack short: your frames that led there, and the frame that did it.
        stack = site.stack if failing else short(site.stack)
        return Finding(title, facts, [Site(label, stack, site.count)], hint)

    def result(self) -> CheckResult:
        run = self.run
        total = run.units
        sites = sorted(self._sites.values(), key=lambda s: -s.count)
        failing = [s for s in sites if not s.allowed_by and (s.is_user or self.strict)]
        noted = [s for s in sites if not s.allowed_by and not (s.is_user or self.strict)]
        allowed = [s for s in sites if s.allowed_by]
        user_count = sum(s.count for s in sites if s.is_user and not s.allowed_by)
        framework_count = sum(s.count for s in sites if not s.is_user and not s.allowed_by)
        allowed_count = sum(s.count for s in allowed)
        cuda_seen = any(s.devices - {WOULD} for s in sites)
        figures: dict[str, Any] = {
            "scope": run.scope,
            "steps": total,
            "syncs": user_count,
            "sites": len([s for s in sites if s.is_user and not s.allowed_by]),
            "framework_syncs": framework_count,
            "allowed_syncs": allowed_count,
            "host_tensor_reads": self.host_reads,
            "mode": "device" if cuda_seen else "inferred on cpu",
            "not_watched": sorted(self.unavailable.values()),
            "events": [s.to_dict(total) for s in sites],
        }
        extras = []
        if framework_count:
            owners = sorted({owner_label(s.frame) for s in noted})
            extras.append(f"{framework_count} in {', '.join(owners)} (noted)")
        if allowed_count:
            extras.append(f"{allowed_count} allowed")
        extras.extend(self.unavailable.values())
        unit = run.unit_name

        def one_site(s: _SyncSite) -> str:
            where = f"at {s.frame.location()}" + ("" if s.is_user else f" ({owner_label(s.frame)})")
            return f"{plural(s.count, 'sync')} {where}: {frequency(s.per_unit, s.outside, total, unit)}"

        def many_sites(count: int, n: int) -> str:
            where = "in your code" if all(s.is_user for s in failing) else "in your code and libraries"
            return f"{plural(count, 'sync')} at {n} sites {where} over {plural(total, unit)}"

        return step_verdict(
            NAME, run, what="syncs", failing=failing, noted=noted, allowed=allowed, finding=self._finding,
            figures=figures,
            within=lambda count, worst, budget: (
                f"{plural(count, 'sync')} in your code, at most {worst} in a {unit}: within max_syncs_per_step={budget}"
            ),
            one_site=one_site, many_sites=many_sites,
            clean=f"no sync in your code over {plural(total, unit)}", extras=extras,
        )


INVARIANT = Invariant(
    name=NAME,
    doc="no GPU->CPU synchronisation inside the scope",
    check=HostSyncCheck,
    kind=Flag(),
    default=True,
    probes=("tensors", "syncs"),
    arguments=(
        Argument(
            "allowed_syncs",
            SiteList(),
            (),
            "accept syncs at these sites ('file.py:LINE', 'file.py') or in these "
            "functions ('log_images', 'MyModule.on_train_batch_end')",
        ),
        Argument(
            "fail_on_framework_syncs",
            Flag(),
            False,
            "also fail on syncs made by Lightning, torchmetrics or other libraries",
        ),
        Argument(
            "max_syncs_per_step",
            Integer(minimum=0),
            None,
            "pass while no training step makes more than N syncs in your code "
            "(for code that syncs on purpose; syncs outside steps always count)",
            meaning="the most syncs in your code any training step may make",
        ),
    ),
)
