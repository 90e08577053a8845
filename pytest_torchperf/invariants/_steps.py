"""What the step checks (``no_host_sync``, ``on_device``) share: per-step counts, cadence, and their verdict.

A *site* (one operation at one line) is counted per step (``per_unit``),
outside steps (``outside``) and per epoch (a pass over a DataLoader, see
:class:`PerStep`). :func:`cadence` tells a site that repeats in most steps
from one that repeats on a period, like real projects keep their logging:

- ``every step`` (or nearly): fails;
- ``periodic``: after its first step in each epoch, the site was seen in at
  most ``limit`` of the observed steps (``limit=0.1``: every 10th step or
  rarer; ``if batch_idx % 10 == 0:`` is seen at the first batch of every
  epoch, so that one is free: with 15 batches an epoch it syncs in 2 of
  each 15 steps, 1 of them free);
- ``once per epoch``: at most once in each pass over the training data
  (steps with an event, and events outside steps, counted per epoch), and
  not in every step;
- ``once``: a single step (or a single event outside steps) in the run.

An epoch is a training pass over a DataLoader (:func:`training_pass`): a pass
begun with gradients off (an evaluation loop) begins none.

A run too short to show a period is judged by what it shows: one step with
an event among several is ``once``; a site seen in every observed step is
never periodic (a 1-step run fails any event); and telling every 5th step
from every 10th needs about 2/limit steps (20 for the default).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run

__all__ = [
    "DEFAULT_RATE",
    "ONCE",
    "PER_EPOCH",
    "PERIODIC",
    "PerStep",
    "cadence",
    "cadence_text",
    "cadences_text",
    "extent",
    "frequency",
    "over_budget",
    "periodic_rate",
    "periodic_text",
    "rate",
    "rate_text",
    "step_verdict",
    "training_pass",
]

#: The default of ``max_sync_rate`` / ``max_empty_cache_rate``: every 10th step or rarer is periodic.
#: Chosen from the logging intervals real projects keep after fixing a per-step ``.item()``
#: (10 in pytorch/examples' MNIST, torchtitan's log_freq and DeepSpeed's steps_per_print;
#: 50 in timm and Lightning's log_every_n_steps; 500 in the Hugging Face Trainer; once per epoch),
#: while the bugs they fixed synced in every step (1.0), every other step (0.5) or at each optimizer
#: step under 2-4 steps of gradient accumulation (0.5-0.25). See the README.
DEFAULT_RATE = 0.1

PERIODIC = "periodic"
PER_EPOCH = "once per epoch"
ONCE = "once"


class PerStep:
    """How often one thing happened: in total, per step, outside steps and per epoch.

    ``epoch`` is whatever the check counts epochs with (passes over DataLoaders);
    the same epoch value for every event when nothing marks epochs.
    """

    def __init__(self) -> None:
        self.count = 0
        self.per_unit: dict[int, int] = {}
        self.outside = 0
        #: epoch -> steps with an event in that epoch.
        self.steps_per_epoch: dict[int, int] = {}
        #: epoch -> events outside steps in that epoch.
        self.outside_per_epoch: dict[int, int] = {}

    def add(self, unit: Optional[int], epoch: int = 0) -> None:
        self.count += 1
        if unit is None:
            self.outside += 1
            self.outside_per_epoch[epoch] = self.outside_per_epoch.get(epoch, 0) + 1
        else:
            seen = self.per_unit.get(unit, 0)
            self.per_unit[unit] = seen + 1
            if not seen:
                self.steps_per_epoch[epoch] = self.steps_per_epoch.get(epoch, 0) + 1

    @property
    def per_step_max(self) -> int:
        return max(self.per_unit.values()) if self.per_unit else 0


class CountsEpochs:
    """What the step checks share: :attr:`epoch`, the training passes over DataLoaders begun so far (the
    epoch an event belongs to, for its cadence). A pass begun with gradients off begins none
    (:func:`training_pass`)."""

    epoch: int = 0

    def on_dataloader_pass(self, loader: Any) -> None:
        if training_pass():
            self.epoch += 1


def training_pass() -> bool:
    """Whether a DataLoader pass beginning now begins an epoch: one begun with gradients on (training).

    An evaluation pass (Lightning's validation and sanity check, a plain loop's ``with torch.no_grad(): for
    batch in val_loader``) runs with them off: it is no epoch, or a validation every 10 steps would make each
    10 steps an epoch whose first sync is free, and a sync every 5th step would read as periodic.
    """
    torch = sys.modules.get("torch")
    return torch is None or bool(torch.is_grad_enabled())


def rate(item: PerStep, total: int) -> Optional[float]:
    """The fraction of the observed steps in which ``item`` happened (None when no step was observed)."""
    steps = len(item.per_unit)
    total = max(total, steps)
    return round(steps / total, 4) if total else None


def periodic_rate(item: PerStep, total: int) -> Optional[float]:
    """The share of the observed steps in which ``item`` happened after its first step in each epoch: what
    :func:`cadence` holds against the limit (None when no step was observed)."""
    steps = len(item.per_unit)
    total = max(total, steps)
    if not total:
        return None
    return (steps - _free_steps(item)) / total


def _free_steps(item: PerStep) -> int:
    """The steps :func:`periodic_rate` leaves out: the first step with an event in each epoch."""
    return sum(1 for n in item.steps_per_epoch.values() if n) or (1 if item.per_unit else 0)


def periodic_text(item: PerStep, total: int, limit: float, setting: str, verb: str, unit: str = "step") -> str:
    """What a periodic note says of its rate: ``"synced in 4 of 40 steps, the first of them free; the other 3:
    0.07 of the steps, within max_sync_rate=0.1"``. The share it prints is the one held against the limit,
    with the steps it was counted from, never the raw share (0.10 here, 0.17 with two epochs) beside a limit
    it would exceed."""
    steps = len(item.per_unit)
    total = max(total, steps)
    free = _free_steps(item)
    share = (steps - free) / total if total else 0.0
    firsts = "the first of them free" if free == 1 else f"the first in each of {free} epochs free"
    return (
        f"{verb} in {steps} of {plural(total, unit)}, {firsts}; the other {steps - free}: "
        f"{rate_text(share, limit)} of the {unit}s, within {setting}={limit:g}"
    )


def rate_text(share: float, limit: Optional[float] = None) -> str:
    """``0.47``; with more digits where two would read as the limit itself (``0.1002`` against 0.1)."""
    text = f"{share:.2f}"
    if limit is not None and share != limit and text == f"{limit:.2f}":
        text = f"{share:.4f}".rstrip("0")
    return text


def cadence(item: PerStep, total: int, limit: Optional[float]) -> Optional[str]:
    """:data:`PERIODIC`, :data:`PER_EPOCH` or :data:`ONCE` for a site that repeats rarely; None otherwise.

    ``total``: the steps the run observed; ``limit``: the largest rate still
    periodic (None or 0: nothing is, every event counts). See the module's docstring.
    """
    if not limit or limit <= 0:
        return None
    steps = len(item.per_unit)
    total = max(total, steps)
    if steps and steps >= total:
        return None  # in every observed step
    per_epoch: dict[int, int] = dict(item.steps_per_epoch)
    for epoch, n in item.outside_per_epoch.items():
        per_epoch[epoch] = per_epoch.get(epoch, 0) + n
    if per_epoch and max(per_epoch.values()) <= 1:
        return ONCE if len(per_epoch) == 1 else PER_EPOCH
    outside_ok = max(item.outside_per_epoch.values(), default=0) <= 1
    share = periodic_rate(item, total)
    if steps and outside_ok and share is not None and share * total <= limit * total + 1e-9:
        return PERIODIC
    return None


def cadence_text(kind: str, item: PerStep, total: int, unit: str = "step") -> str:
    """``"periodic: 4 of 40 steps"``, ``"once per epoch: 3 of 12 steps"``, ``"once: 1 time outside training steps"``;
    a site with more than one event in a step says how many in all (``"once: 513 times in 1 of 40 steps"``)."""
    steps = len(item.per_unit)
    total = max(total, steps)
    parts = []
    if steps:
        in_steps = item.count - item.outside
        times = f"{in_steps} times in " if in_steps > steps else ""
        parts.append(f"{times}{steps} of {plural(total, unit)}")
    if item.outside:
        parts.append(f"{plural(item.outside, 'time')} outside training steps")
    return f"{kind}: {', '.join(parts) or 'never'}"


def _edges(per_unit: dict[int, int], total: int, unit: str) -> Optional[str]:
    """``"4 per step over 40 steps (8 in the first, none in the last)"`` when the count differs only in the run's
    first or last step; None otherwise.

    The steps between the first and the last ran whole; those two may be cut by the run's edges: automatic
    steps begin at an optimizer step, so the first holds what came before the second one, and the last step
    lasts until the watch ends (a loop's last iteration ended before it, or the run stopped mid-step). A site
    with the same count in every whole step makes that count per step, with the edges said as they were.
    """
    inner = [per_unit.get(u, 0) for u in range(2, total)]
    if len(inner) < 2 or min(inner) == 0 or len(set(inner)) != 1 or any(u < 1 or u > total for u in per_unit):
        return None
    each = inner[0]
    edges = []
    for name, u in (("first", 1), ("last", total)):
        n = per_unit.get(u, 0)
        if n != each:
            edges.append(f"{n or 'none'} in the {name}")
    units = plural(total, unit).split(" ", 1)[1]
    return f"{each} per {unit} over {total} {units} ({', '.join(edges)})"


#: How a summary names the events of each cadence (a one-off burst is not periodic: periodic is spread over steps).
_CADENCE_WORDS = {PERIODIC: "periodic", PER_EPOCH: "once-per-epoch", ONCE: "one-off"}


def cadences_text(items: Iterable[Any], noun: str = "", nouns: str = "") -> str:
    """``"4 periodic syncs"``, ``"4 periodic and 513 one-off syncs"``: the events of ``items`` (each with ``count``
    and ``cadence``) by cadence, for a summary; ``noun``/``nouns`` follow the counts (none when empty)."""
    counts: dict[str, int] = {}
    for item in items:
        if item.cadence is not None:
            counts[item.cadence] = counts.get(item.cadence, 0) + item.count
    parts = [f"{counts[kind]} {word}" for kind, word in _CADENCE_WORDS.items() if counts.get(kind)]
    text = parts[-1] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"
    word = noun if sum(counts.values()) == 1 else nouns
    return f"{text} {word}" if word else text


def frequency(per_unit: dict[int, int], outside: int, total: int, unit: str = "step") -> str:
    """``"3 per step over 12 steps"``, ``"5 times in 2 of 12 steps"``, ``"2 times outside steps"``..."""
    parts = []
    if per_unit:
        seen = len(per_unit)
        counts = set(per_unit.values())
        total = max(total, seen)
        units = plural(total, unit).split(" ", 1)[1]
        edges = _edges(per_unit, total, unit) if len(counts) > 1 or seen < total else None
        if edges is not None:
            parts.append(edges)
        elif len(counts) == 1:
            each = counts.pop()
            if seen == total:
                parts.append(f"{each} per {unit} over {total} {units}")
            else:
                parts.append(f"{each} per {unit} in {seen} of {total} {units}")
        else:
            count = sum(per_unit.values())
            lo, hi = min(per_unit.values()), max(per_unit.values())
            where = f"over {total} {units}" if seen == total else f"in {seen} of {total} {units}"
            parts.append(f"{count} times {where} ({lo} to {hi} per {unit})")
    if outside:
        times = "time" if outside == 1 else "times"
        parts.append(f"{outside} {times} outside training steps")
    return ", ".join(parts) or "never"


def extent(run: Run) -> str:
    """What the run covered, for summaries: ``"over 12 steps"``, or under scope="test" ``"in the whole test"``."""
    total = run.units
    if run.scope == "test":
        return f"in the whole test ({plural(total, run.unit_name)})" if total else "in the whole test"
    return f"over {plural(total, run.unit_name)}"


def over_budget(per_units: Iterable[dict[int, int]], outside: int, budget: Optional[int]) -> tuple[int, bool]:
    """``(worst, over)``: the most events in one step (summed over sites) and whether a budget is broken.

    Without a budget every event breaks it; with one, a step may make up to
    ``budget`` events, and events outside any step always break it.
    """
    per_step: dict[int, int] = {}
    for per_unit in per_units:
        for unit, count in per_unit.items():
            per_step[unit] = per_step.get(unit, 0) + count
    worst = max(per_step.values(), default=0)
    if budget is None:
        return worst, bool(per_step) or outside > 0
    return worst, worst > budget or outside > 0


def step_verdict(
    name: str,
    run: Run,
    *,
    what: str,
    failing: Sequence[Any],
    noted: Sequence[Any],
    allowed: Sequence[Any],
    finding: Callable[[Any, str], Finding],
    figures: Any,  # the caller's Figures (a TypedDict declaring worst_step_<what> and max_<what>_per_step)
    within: Callable[[int, int, Optional[int]], str],
    one_site: Callable[[Any], str],
    many_sites: Callable[[int, int], str],
    clean: str,
    extras: list[str],
) -> CheckResult:
    """The verdict both step checks give, from their sites sorted into failing / noted / allowed.

    Each site has ``count``, ``per_unit`` and ``outside``. ``what`` names the
    budget (``max_<what>_per_step``) and the figure ``worst_step_<what>``;
    ``within(count, worst, budget)`` words a pass within the budget, ``one_site``
    the summary when one site fails, ``many_sites(count, sites)`` when several
    do; ``clean`` is the summary's head when nothing fails. A noted site's
    finding title starts with ``note: `` unless ``finding`` words it itself.
    """
    budget_name = f"max_{what}_per_step"
    budget = getattr(run.options, budget_name)
    worst, over = over_budget((s.per_unit for s in failing), sum(s.outside for s in failing), budget)
    figures[f"worst_step_{what}"] = worst
    figures[budget_name] = budget
    findings = [finding(s, "") for s in failing]
    findings += [finding(s, "note: ") for s in noted]
    findings += [finding(s, "allowed: ") for s in allowed]
    count = sum(s.count for s in failing)
    if failing and not over:
        return CheckResult(name, PASSED, within(count, worst, budget), 0, findings, figures)
    if failing:
        summary = one_site(failing[0]) if len(failing) == 1 else many_sites(count, len(failing))
        if budget is not None:
            summary += f"; {worst} in one {run.unit_name}, {budget_name}={budget}"
        return CheckResult(name, FAILED, summary, count, findings, figures)
    summary = clean + "".join(f"; {e}" for e in extras)
    if run.units == 0 and run.scope != "test" and not (noted or allowed):
        summary = (
            "no training step observed: mark steps with `with run.step():`, fit a LightningModule, "
            "or use scope='test'"
        )
        return CheckResult(name, NOT_CHECKED, summary, 0, findings, figures)
    return CheckResult(name, PASSED, summary, 0, findings, figures)
