"""Invariant ``no_host_sync``: no GPU->CPU synchronisation inside the step, caught on CPU-only CI too.

An ``.item()`` in a training step makes the CPU wait until the GPU has run
every kernel queued so far, every step; so do ``float(t)``, ``if t > x:``, an
f-string or ``print`` of a tensor, ``.tolist()``, ``.numpy()``, ``.cpu()``
and every operation whose output size depends on the data. The probe
:mod:`pytest_torchperf.probes.syncs` sends each such operation inside the
scope as an ``on_sync`` event; this check groups them by site (the innermost
frame outside torch: the user's line, or Lightning's when Lightning made it),
counts them per step and per epoch (a pass over a DataLoader), and fails on
the user's own sites that sync in most steps. A site that syncs on a period
(every 10th step or rarer with the default ``max_sync_rate=0.1``, once per
epoch, once) is a note with its rate, as are library syncs (unless
``fail_on_framework_syncs``); ``allowed_syncs`` accepts known ones;
``max_syncs_per_step`` is a budget for code that syncs on purpose.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import frameworks
from ..allow import AllowList
from ..arguments import Argument, Flag, Fraction, Integer, SiteList
from ..core import Check
from ..frames import Located, describe_frame, owner_label, stack_of
from ..probes.syncs import WOULD, Op, Sync
from ..registry import Invariant
from ..report import CheckResult, Finding, Site
from ..stacks import TORCH, TORCHPERF, USER, Frame, Stack, classify, until_user_frame
from ..text import plural
from ._steps import (
    DEFAULT_RATE,
    PERIODIC,
    CountsEpochs,
    PerStep,
    cadence,
    cadence_text,
    cadences_text,
    extent,
    frequency,
    periodic_rate,
    periodic_text,
    rate,
    rate_text,
    step_verdict,
)

if TYPE_CHECKING:
    from ..core import Run

NAME = "no_host_sync"

# -- what is caught, and what to do instead -------------------------------------------------

_PERIODIC = "(that periodic sync is a note, not a failure, at max_sync_rate={rate})"

_HINTS = {
    "value": (
        "keep the value on the device: accumulate it with tensor ops (`total += loss.detach()`) and read "
        "it with `.item()` only every N steps or at epoch end " + _PERIODIC
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
        "printing or formatting a tensor copies it to the host: print only every N steps or at epoch end, "
        "from a value accumulated on the device " + _PERIODIC
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

#: Syncs torch's own Python code makes for the caller, and what the caller can pass to avoid them:
#: ``(file under torch/, function) -> hint``, matched on the stack's torch frames.
_TORCH_SITES = {
    ("nn/modules/transformer.py", "_detect_is_causal_mask"): (
        "torch's TransformerEncoder/TransformerDecoder compare a mask given without `is_causal` with a causal "
        "mask on the host in every call (`bool((mask == causal).all())`): pass `is_causal=True` with a causal "
        "mask (`tgt_is_causal=True` to TransformerDecoder, `src_is_causal`/`tgt_is_causal` to nn.Transformer), "
        "`is_causal=False` with any other, and the check is skipped"
    ),
    ("distributions/distribution.py", "__init__"): (
        "torch.distributions checks the parameters on the host when a distribution is built (`validate_args`): "
        "build it with `validate_args=False` in the step, or call "
        "`torch.distributions.Distribution.set_default_validate_args(False)` once (it is on by default)"
    ),
    ("distributions/distribution.py", "_validate_sample"): (
        "torch.distributions checks each value given to `log_prob` on the host (`validate_args`): build the "
        "distribution with `validate_args=False` in the step, or call "
        "`torch.distributions.Distribution.set_default_validate_args(False)` once (it is on by default)"
    ),
}


def _torch_site_hint(stack: Stack) -> Optional[str]:
    """The hint for a sync torch's own code makes for its caller (:data:`_TORCH_SITES`), if the stack shows one."""
    for frame in reversed(stack):
        if frame.kind != TORCH:
            if frame.kind != TORCHPERF:
                return None  # only the torch frames inside the site's own line
            continue
        path = frame.filename.replace("\\", "/")
        for (suffix, function), hint in _TORCH_SITES.items():
            if frame.function == function and path.endswith("torch/" + suffix):
                return hint
    return None


#: Operations whose value Python may really need every step (a reinforcement-learning environment takes an
#: int action): their hint also says how to accept the site.
_HOST_NEEDS = frozenset(("value", "host", "branch"))

#: Inside a Lightning call, the Lightning way to get a value out without waiting.
_LIGHTNING_HINTS = {
    "value": (
        "keep the value on the device: pass the tensor itself to `self.log(...)` (Lightning reduces it "
        "without waiting), accumulate with tensor ops, and read it with `.item()` only every N steps or "
        "at epoch end " + _PERIODIC
    ),
    "print": (
        "printing or formatting a tensor copies it to the host: log the tensor with `self.log(...)` "
        "(shown in the progress bar with prog_bar=True), or print only every N steps " + _PERIODIC
    ),
}


class _SyncSite(PerStep):
    """One operation at one line, as one run saw it."""

    def __init__(self, op: Op, located: Located, stack: Stack, allowed_by: Optional[str], in_lightning: bool) -> None:
        super().__init__()
        assert located.frame is not None
        self.op = op
        self.frame: Frame = describe_frame(located.frame)
        self.kind = located.kind
        self.via = located.via
        #: The sync is inside a library the user's line called.
        self.library = located.library
        self.stack = stack
        self.allowed_by = allowed_by
        #: Seen inside a Lightning Trainer call (the hint then speaks Lightning).
        self.in_lightning = in_lightning
        self.devices: set[str] = set()
        self.confirmed = 0
        #: PERIODIC / PER_EPOCH / ONCE, or None: set when the verdict is made.
        self.cadence: Optional[str] = None

    def record(self, unit: Optional[int], epoch: int, device: str) -> None:
        self.add(unit, epoch)
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
            "rate": rate(self, total),
            "cadence": self.cadence,
            "devices": sorted(self.devices),
            "cuda_confirmed": self.confirmed,
            "allowed_by": self.allowed_by,
        }


class HostSyncCheck(CountsEpochs, Check):
    """Per-run state and verdict of ``no_host_sync``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.allow = AllowList(run.options.allowed_syncs)
        self.strict = run.options.fail_on_framework_syncs
        self.limit: float = run.options.max_sync_rate
        self._sites: dict[Any, _SyncSite] = {}
        self._syncs = run.probe("syncs")
        self._host_reads_at_start = self._syncs.host_reads
        self.host_reads = 0
        self.unavailable: dict[str, str] = {}

    # -- events from the probes ------------------------------------------------------
    def on_sync(self, event: Sync) -> Optional[_SyncSite]:
        located = event.located
        if located.frame is None:
            return None
        allowed_by = self.allow.match(located, event.frame) if self.allow else None
        key = (event.op.name, located.frame.f_code, located.frame.f_lineno, allowed_by)
        site = self._sites.get(key)
        if site is None:
            in_lightning = frameworks.current_call("lightning") is not None
            stack = stack_of(event.frame)
            if located.library:  # the user's line is the site: the library's frames inside it are not shown
                stack = until_user_frame(stack)
            site = self._sites[key] = _SyncSite(event.op, located, stack, allowed_by, in_lightning)
        site.record(self.run.unit, self.epoch, event.device)
        return site

    def on_run_end(self) -> None:
        self.host_reads = self._syncs.host_reads - self._host_reads_at_start
        self.unavailable = dict(self._syncs.unavailable)

    # -- verdict -----------------------------------------------------------------------
    def _hint(self, site: _SyncSite) -> str:
        torch_site = _torch_site_hint(site.stack)
        if torch_site is not None:
            return torch_site
        key = site.op.hint
        text = _LIGHTNING_HINTS.get(key, _HINTS[key]) if site.in_lightning else _HINTS[key]
        text = text.format(rate=f"{self.limit:g}")
        if site.library:
            text = (
                f"the sync is inside {site.via}, which your line calls every step: turn off the library's input "
                "checks if it has a switch (torchmetrics: validate_args=False), or call it less often (update "
                "every N steps, or on a batch of steps' values kept on the device). Else: " + text
            )
        if key in _HOST_NEEDS:
            where = f"{os.path.basename(site.frame.filename)}:{site.frame.lineno}"
            text += (f". If Python needs the value every step (an environment's step, a decision only the host "
                     f"can make), accept the site: allowed_syncs=[{where!r}]")
        return text

    def _finding(self, site: _SyncSite, note: str) -> Finding:
        total = self.run.units
        unit = self.run.unit_name
        if site.cadence is not None:
            freq = cadence_text(site.cadence, site, total, unit)
        else:
            freq = frequency(site.per_unit, site.outside, total, unit)
        via = f" inside `{site.via}`" if site.via else ""
        title = f"{note}{site.op.label}{via} in {site.frame.function}: {freq}"
        facts = []
        if site.confirmed:
            facts.append(f"synchronised on {', '.join(sorted(site.devices - {WOULD}))} "
                         f"(confirmed {site.confirmed}x by torch.cuda.set_sync_debug_mode)")
        elif site.would_only:
            facts.append(
                "on this CPU-only run: would synchronise on an accelerator (the tensor is not one built on the host)"
            )
        else:
            facts.append(f"synchronises on {', '.join(sorted(site.devices - {WOULD}))}")
        if site.cadence is not None and not site.allowed_by:
            facts.append(self._cadence_fact(site, total, unit))
        elif not site.allowed_by and total and self.limit and (site.is_user or self.strict):
            share = rate(site, total)
            beyond = periodic_rate(site, total)
            if share is not None and beyond is not None and site.per_unit:
                measured = f"rate {rate_text(share)}"
                if len(site.per_unit) < total:  # a site in every step has no period to tell
                    measured += f"; {rate_text(beyond, self.limit)} after its first {unit} in each epoch"
                facts.append(
                    f"synced in {len(site.per_unit)} of {plural(total, unit)} ({measured}): more often than "
                    f"max_sync_rate={self.limit:g} allows for a periodic sync"
                )
        if site.allowed_by:
            facts.append(f"accepted by allowed_syncs entry {site.allowed_by!r}")
        elif not site.is_user:
            owner = owner_label(site.frame)
            rule = classify.rule(site.frame.filename)
            if self.strict and site.cadence is None:
                facts.append(
                    f"made by {owner}, not by your code ({rule}; failing because fail_on_framework_syncs=True)"
                )
            else:
                facts.append(f"made by {owner}, not by your code ({rule}): a note, not a failure"
                             + ("" if self.strict else " (fail_on_framework_syncs=True fails on it)"))
        elif classify.rule_matters(site.frame.filename):
            facts.append(f"counted as your code: {classify.rule(site.frame.filename)}")
        label = site.op.label.split(" (")[0]
        failing = (site.is_user or self.strict) and not site.allowed_by and site.cadence is None
        framework_hint = "" if site.is_user else frameworks.hint(site.frame, site.op.hint)  # the setting removing it
        hint = framework_hint or (self._hint(site) if failing else "")
        return Finding(title, facts, [Site(label, site.stack, site.count)], hint)

    def _cadence_fact(self, site: _SyncSite, total: int, unit: str) -> str:
        if site.cadence == PERIODIC:
            what = "periodic: " + periodic_text(site, total, self.limit, "max_sync_rate", "synced", unit)
        else:
            what = {
                "once per epoch": f"at most once per epoch (pass over a DataLoader), and not in every {unit}",
                "once": "once in the run",
            }[site.cadence or "once"]
        return f"{what}: a note, not a failure; max_sync_rate=0 fails on it"

    def result(self) -> CheckResult:
        run = self.run
        total = run.units
        sites = sorted(self._sites.values(), key=lambda s: -s.count)
        for s in sites:
            s.cadence = cadence(s, total, self.limit) if not s.allowed_by else None
        failing = [s for s in sites if not s.allowed_by and (s.is_user or self.strict) and s.cadence is None]
        noted = [s for s in sites if not s.allowed_by and s not in failing]
        allowed = [s for s in sites if s.allowed_by]
        user_count = sum(s.count for s in failing if s.is_user)
        framework = [s for s in noted if not s.is_user]
        periodic = [s for s in noted if s.is_user]
        framework_count = sum(s.count for s in sites if not s.is_user and not s.allowed_by)
        periodic_count = sum(s.count for s in periodic)
        allowed_count = sum(s.count for s in allowed)
        cuda_seen = any(s.devices - {WOULD} for s in sites)
        figures: Figures = {
            "scope": run.scope,
            "steps": total,
            "syncs": user_count,
            "sites": len([s for s in failing if s.is_user]),
            "periodic_syncs": periodic_count,
            "max_sync_rate": self.limit,
            "framework_syncs": framework_count,
            "allowed_syncs": allowed_count,
            "host_tensor_reads": self.host_reads,
            "mode": "device" if cuda_seen else "inferred on cpu",
            "not_watched": sorted(self.unavailable.values()),
            "events": [s.to_dict(total) for s in sites],
        }
        extras = []
        if periodic_count:
            extras.append(f"{cadences_text(periodic, 'sync', 'syncs')} in your code (noted)")
        if framework:
            owners = sorted({owner_label(s.frame) for s in framework})
            extras.append(f"{sum(s.count for s in framework)} in {', '.join(owners)} (noted)")
        if allowed_count:
            extras.append(f"{allowed_count} allowed")
        extras.extend(self.unavailable.values())
        unit = run.unit_name

        def one_site(s: _SyncSite) -> str:
            where = f"at {s.frame.location()}" + ("" if s.is_user else f" ({owner_label(s.frame)})")
            return f"{plural(s.count, 'sync')} {where}: {frequency(s.per_unit, s.outside, total, unit)}"

        def many_sites(count: int, n: int) -> str:
            where = "in your code" if all(s.is_user for s in failing) else "in your code and libraries"
            return f"{plural(count, 'sync')} at {n} sites {where} {extent(run)}"

        return step_verdict(
            NAME, run, what="syncs", failing=failing, noted=noted, allowed=allowed, finding=self._finding,
            figures=figures,
            within=lambda count, worst, budget: (
                f"{plural(count, 'sync')} in your code, at most {worst} in a {unit}: within max_syncs_per_step={budget}"
            ),
            one_site=one_site, many_sites=many_sites,
            clean=f"no sync in your code {extent(run)}", extras=extras,
        )


class Figures(TypedDict, total=False):
    """The figures of a no_host_sync verdict (see :mod:`pytest_torchperf.figures`)."""

    scope: str
    steps: int
    syncs: int
    sites: int
    periodic_syncs: int
    max_sync_rate: float
    framework_syncs: int
    allowed_syncs: int
    host_tensor_reads: int
    mode: str
    not_watched: list[str]
    events: list[dict[str, Any]]
    worst_step_syncs: int
    max_syncs_per_step: Optional[int]


INVARIANT = Invariant(
    name=NAME,
    doc="no GPU->CPU synchronisation inside the scope (a site that syncs on a period is a note)",
    check=HostSyncCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("tensors", "syncs", "iterators"),
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
        Argument(
            "max_sync_rate",
            Fraction(),
            DEFAULT_RATE,
            "no_host_sync notes, without failing, a site that syncs periodically: after its first step in each "
            "epoch, in at most this share of the steps (0.1: every 10th step or rarer), or at most once per epoch; "
            "0 fails on every sync (ini: torchperf_max_sync_rate)",
            meaning="the largest share of the steps a periodic sync may take",
        ),
    ),
)
