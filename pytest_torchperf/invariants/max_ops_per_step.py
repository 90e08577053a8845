"""Invariant ``max_ops_per_step``: the ATen operations a training step runs, counted exactly, by name.

Timing a step on a shared CI machine is noisy; how much work the step issues
is not. The same model, data and code run the same operators every time, so a
count that grew is a change in the code, never noise: an optimizer built with
``foreach=False`` (one ``lerp_``, ``addcdiv_``... per parameter instead of one
``_foreach_*`` call over all of them), a per-parameter Python loop (an EMA
update issuing one ``lerp_`` per parameter), an extra cast, a norm computed
twice.

The value is a budget (``max_ops_per_step=400``: the heaviest counted step may
run at most 400 ops) or ``"baseline"``: every op's count per step becomes an
entry of the baseline file (:mod:`pytest_torchperf.glue.baseline`) per test, op and
device type; a count that grew fails, naming the op, both counts and the line
that issued most of them, and a count that shrank is reported so that
``--torchperf-baseline-update`` lowers it.

Counted by the probe :mod:`pytest_torchperf.probes.ops` in each counted step:
a Lightning train batch (the step, its backward, the optimizer step and the
hooks between), or a ``with run.step():`` block; the first
``count_warmup_steps`` steps are not counted (lazy optimizer state, the first
step's caches). Counts are per device type: a CPU run's counts are compared
with a CPU run's.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Argument, Integer
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Frame, site_of
from ..text import plural
from ._counts import BASELINE, CountOrBaseline, StepWindows, counted_entry, per_step

if TYPE_CHECKING:
    from ..core import Run

NAME = "max_ops_per_step"
#: Namespaces of ops that are bookkeeping, not work (``record_function`` ranges).
_LEFT_OUT = ("profiler::",)
#: How many ops a report lists.
SHOWN = 8
#: One line issuing an op this often per step is a Python loop over tensors.
LOOP_CALLS = 3
#: Ops an optimizer's per-parameter (``foreach=False``) implementation runs, one call per parameter.
_OPTIMIZER_OPS = frozenset((
    "aten::lerp_", "aten::addcdiv_", "aten::addcmul_", "aten::mul_", "aten::add_", "aten::sqrt", "aten::div",
    "aten::div_", "aten::sqrt_", "aten::maximum", "aten::sub_", "aten::copy_", "aten::zero_", "aten::neg",
))


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))


def _where(frame: Optional[Frame]) -> str:
    return f"{frame.location()} in {frame.function}" if frame is not None else "(no Python frame)"


class OpsCheck(StepWindows, Check):
    """Per-run state and verdict of ``max_ops_per_step``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        Check.__init__(self, run)
        StepWindows.__init__(self, run, run.options.count_warmup_steps)
        self.budget = run.options.max_ops_per_step
        self.limit = run.options.count_steps
        self.probe = run.probe("ops")
        #: id(op) -> calls over the counted steps; total calls of each counted step.
        self.totals: dict[Any, int] = {}
        self.step_totals: list[int] = []
        self.sample: Any = None
        #: On a CUDA run: the kernel launches of one counted step (see probes._kernels).
        self.kernels: Any = None
        self._kernel_step = False
        #: func -> whether it is left out of the counts (profiler bookkeeping).
        self._skipped: dict[Any, bool] = {}

    def window_opened(self, counted: bool) -> None:
        if counted and (self.limit is None or len(self.step_totals) < self.limit):
            self.probe.begin(self, sample=self.sample is None)
            if self.kernels is not None and self.kernels.launches is None and not self.kernels.why_not:
                self._kernel_step = True
                self.kernels.start()

    def window_closed(self, counted: bool) -> None:
        if not counted or self not in self.probe.open:
            return
        if self._kernel_step:
            self._kernel_step = False
            self.kernels.stop()
        counts, sample = self.probe.end(self)
        if sample is not None and self.sample is None:
            self.sample = sample
            if "cuda" in sample.devices.values():  # the next counted step counts its kernel launches too
                from ..probes._kernels import KernelStep

                self.kernels = KernelStep()
        totals, skipped = self.totals, self._skipped
        step = 0
        for func, n in counts.items():
            totals[func] = totals.get(func, 0) + n
            skip = skipped.get(func)
            if skip is None:
                from ..probes.ops import op_name

                skip = skipped[func] = op_name(self.probe.op_of(func)).startswith(_LEFT_OUT)
            if not skip:
                step += n
        self.step_totals.append(step)

    def on_run_end(self) -> None:
        StepWindows.on_run_end(self)

    # -- the verdict ------------------------------------------------------------------------------
    def _by_name(self) -> dict[tuple[str, str], dict[str, Any]]:
        """(op name, device type) -> its calls, and the sample step's sites of it."""
        from ..probes.ops import op_name

        devices = self.sample.devices if self.sample is not None else {}
        fallback = next((d for d in devices.values() if d), "cpu")
        out: dict[tuple[str, str], dict[str, Any]] = {}
        names: dict[Any, tuple[str, str]] = {}
        for func, n in self.totals.items():
            name = op_name(self.probe.op_of(func))
            if name.startswith(_LEFT_OUT):
                continue
            key = (name, devices.get(func) or fallback)
            names[func] = key
            item = out.setdefault(key, {"count": 0, "sites": {}})
            item["count"] += n
        if self.sample is not None:
            for (func, _), (calls, stack, optim, targets) in self.sample.sites.items():
                known = names.get(func)
                if known is None:
                    continue
                sites = out[known]["sites"]
                frame = site_of(stack)
                where = (frame.filename, frame.lineno) if frame is not None else None
                if where in sites:
                    sites[where][0] += calls
                    if sites[where][3] is not None and targets is not None:
                        sites[where][3] = sites[where][3] | targets
                else:
                    sites[where] = [calls, stack, optim, set(targets) if targets is not None else None]
        return out

    def result(self) -> CheckResult:
        steps = len(self.step_totals)
        figures: Figures = {
            "max_ops_per_step": self.budget,
            "count_warmup_steps": self.warmup,
            "steps_seen": self.windows,
            "counted_steps": steps,
            "count_steps": self.limit,
        }
        if self.probe.unavailable:
            return CheckResult(NAME, NOT_CHECKED, "; ".join(self.probe.unavailable.values()), 0, [], figures)
        if not steps:
            why = (
                f"no training step counted: {plural(self.windows, 'step')} seen, the first {self.warmup} are "
                "warm-up (count_warmup_steps)" if self.windows else
                "no training step observed: mark steps with `with run.step():` or fit a LightningModule"
            )
            return CheckResult(NAME, NOT_CHECKED, why, 0, [], figures)
        ops = self._by_name()
        total = sum(item["count"] for item in ops.values())
        worst = max(self.step_totals)
        mean = per_step(total, steps)
        figures.update({
            "ops_per_step": mean,
            "worst_step_ops": worst,
            "distinct_ops": len(ops),
            "ops": {f"{device}:{name}": per_step(item["count"], steps) for (name, device), item in sorted(ops.items())},
        })
        kernels = self.kernels
        if kernels is not None:
            figures["kernel_launches_per_step"] = kernels.launches
            if kernels.launches is None:
                figures["kernel_launches_missing"] = kernels.why_not or "no counted step after the sample step"
        ranked = sorted(ops.items(), key=lambda kv: (-kv[1]["count"], kv[0]))
        shown = self._shown(ranked, steps)
        over = f"over {plural(steps, 'counted step')}"
        if self.budget == BASELINE:
            entries = []
            for (name, device), item in sorted(ops.items()):
                top = self._top_site(name, item)
                entries.append(counted_entry(
                    NAME, function=name, source=device, count=item["count"], per_step=per_step(item["count"], steps),
                    label=f"from {_where(site_of(top[1]))}" if top else "",
                ))
            if kernels is not None and kernels.launches is not None:
                entries.append(counted_entry(
                    NAME, function="kernel launches", source="cuda", count=kernels.launches,
                    per_step=float(kernels.launches), label="one profiled step",
                ))
            figures["baseline_counts"] = entries  # BASELINE_FIGURE: what a baseline compares
            summary = (
                f"{_number(mean)} ATen ops per step ({len(ops)} distinct) {over}: the counts per op are "
                "compared with the baseline file (--torchperf-baseline; write it with --torchperf-baseline-update)"
            )
            # Every op's finding: the baseline ranks them by what changed (glue.baseline's rank_findings).
            every = [f for f, _ in sorted(
                ((self._finding(k, v, steps), _known_fix(k[0], v)) for k, v in ranked), key=lambda fx: not fx[1],
            )]
            return CheckResult(NAME, FAILED, summary, int(round(mean)), every, figures)
        if worst <= self.budget:
            return CheckResult(
                NAME, PASSED, f"at most {worst} ATen ops per step {over} (max_ops_per_step={self.budget})",
                0, [], figures,
            )
        # A budget holds no count per op: which op grew is not known here, and the most frequent op (an
        # optimizer's step counter, the model's matmuls) is rarely the one that did. The findings list the ops
        # with a known fix first; the baseline names the ops whose count grew.
        summary = (
            f"{worst} ATen ops in one step, max_ops_per_step={self.budget} ({_number(mean)} per step {over}; "
            f"{worst - self.budget} over the budget: max_ops_per_step='baseline' names the ops whose count grew)"
        )
        return CheckResult(NAME, FAILED, summary, worst - self.budget, shown, figures)

    def _shown(self, ranked: list[tuple[tuple[str, str], dict[str, Any]]], steps: int) -> list[Finding]:
        """The ops a report lists: those with a known fix first, then the most frequent."""
        findings = [(self._finding(k, v, steps), _known_fix(k[0], v)) for k, v in ranked]
        return ([f for f, fix in findings if fix] + [f for f, fix in findings if not fix])[:SHOWN]

    @staticmethod
    def _top_site(name: str, item: dict[str, Any]) -> Optional[list[Any]]:
        """The site that issued most calls of the op (a tie: the line of your code that calls it by name)."""
        sites = item["sites"]
        if not sites:
            return None
        bare = name.split("::", 1)[-1]

        def rank(site: list[Any]) -> tuple[int, bool]:
            frame = site_of(site[1])
            return site[0], bool(frame is not None and frame.is_user and _calls(bare, frame.source))

        return max(sites.values(), key=rank)

    def _finding(self, key: tuple[str, str], item: dict[str, Any], steps: int) -> Finding:
        name, device = key
        each = per_step(item["count"], steps)
        ranked = sorted(item["sites"].values(), key=lambda s: -s[0])
        sites = [
            Site(f"{name} ({plural(calls, 'call')} in the sample step)", stack, calls)
            for calls, stack, *_ in ranked[:3]
        ]
        facts = []
        if len(ranked) > 3:
            facts.append(f"issued from {len(ranked)} lines; the 3 that issued most are shown")
        return Finding(f"{name}: {_number(each)} per step on {device}", facts, sites, hint_for(name, ranked))


def _known_fix(name: str, item: dict[str, Any]) -> bool:
    """The op's hint is a fix (not only what was counted): its finding is listed first."""
    return bool(_hint(name, sorted(item["sites"].values(), key=lambda s: -s[0]))[1])


def hint_for(name: str, sites: list[list[Any]]) -> str:
    """The fix for an op count's known causes (a per-parameter optimizer, a Python loop over tensors), or what
    was counted where the cause is not known."""
    return _hint(name, sites)[0]


def _hint(name: str, sites: list[list[Any]]) -> tuple[str, bool]:
    """``(hint, whether it is a fix)``."""
    if "_foreach_" in name or "_fused_" in name:
        return "", False
    bare = name.split("::", 1)[-1]
    for calls, stack, in_optim, targets in sites:
        if in_optim and name in _OPTIMIZER_OPS:
            return (
                "the optimizer runs one op per parameter: build it with foreach=True (or fused=True, one kernel "
                "for the whole update), e.g. torch.optim.AdamW(params, foreach=True)"
            ), True
        frame = site_of(stack)
        if calls >= LOOP_CALLS and frame is not None and frame.is_user and _calls(bare, frame.source):
            if targets is not None and len(targets) >= calls:
                # in place, a different tensor each call: a loop over independent tensors (parameters, a list)
                return (
                    f"{frame.location()} runs {bare} once per tensor in a Python loop: one torch._foreach_{bare} "
                    "call over the lists does the same in one op (an EMA: torch._foreach_lerp_(ema_params, params, "
                    "1 - decay))" if bare.rstrip("_") in _FOREACH else
                    f"{frame.location()} runs {bare} once per tensor in a Python loop: batch the tensors "
                    "(torch.stack / torch.cat, or a torch._foreach_* op) into one call"
                ), True
            # Whether those calls take independent tensors is not known (a block's output feeding the next one's
            # input cannot be batched): say what was counted, not a fix.
            return (
                f"{frame.location()} runs {bare} {calls} times a step: where those calls take independent tensors "
                f"(a loop over parameters or a list), one batched call (torch.stack / torch.cat, a torch._foreach_* "
                "op) does the same; where each call feeds the next (layers applied in sequence), there is nothing to "
                "batch"
            ), False
    return "", False


def _calls(bare: str, source: str) -> bool:
    """Whether the line calls the op by name (``e.lerp_(p, w)``, ``torch.lerp(...)``)."""
    return re.search(r"\b" + re.escape(bare.rstrip("_")) + r"_?\s*\(", source) is not None


#: Ops with a ``torch._foreach_*`` counterpart (their names without the trailing ``_``).
_FOREACH = frozenset((
    "add", "sub", "mul", "div", "lerp", "addcdiv", "addcmul", "sqrt", "exp", "abs", "neg", "copy", "zero",
    "clamp_min", "clamp_max", "maximum", "minimum", "pow", "norm", "sign", "reciprocal",
))


class Figures(TypedDict, total=False):
    """The figures of a max_ops_per_step verdict (see :mod:`pytest_torchperf.figures`)."""

    max_ops_per_step: Optional[int]
    count_warmup_steps: int
    steps_seen: int
    counted_steps: int
    count_steps: Optional[int]
    ops_per_step: float
    worst_step_ops: int
    distinct_ops: int
    ops: dict[str, float]
    kernel_launches_per_step: Optional[float]
    kernel_launches_missing: str
    baseline_counts: list[dict[str, Any]]


INVARIANT = Invariant(
    name=NAME,
    doc=(
        "the ATen ops a training step runs, counted exactly (warm-up steps excluded): at most this many per step, "
        "or 'baseline': per op, no more than the baseline file has"
    ),
    check=OpsCheck,
    figures=Figures,
    kind=CountOrBaseline(),
    default=None,
    probes=("ops",),
    meaning="ATen ops a training step may run",
    arguments=(
        Argument(
            "count_steps",
            Integer(minimum=1),
            None,
            "count the ops of this many steps after the warm-up, then stop paying for it (None: every step)",
        ),
        Argument(
            "count_warmup_steps",
            Integer(minimum=0, optional=False),
            2,
            "training steps max_ops_per_step and max_collectives_per_step do not count, at the start of the run",
        ),
    ),
)
