"""What the step checks (``no_host_sync``, ``on_device``) share: per-step counts and their verdict."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional, Sequence

from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..stacks import Stack
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run

__all__ = ["PerStep", "frequency", "over_budget", "short", "step_verdict"]


class PerStep:
    """How often one thing happened: in total, per step, and outside steps."""

    def __init__(self) -> None:
        self.count = 0
        self.per_unit: dict[int, int] = {}
        self.outside = 0

    def add(self, unit: Optional[int]) -> None:
        self.count += 1
        if unit is None:
            self.outside += 1
        else:
            self.per_unit[unit] = self.per_unit.get(unit, 0) + 1

    @property
    def per_step_max(self) -> int:
        return max(self.per_unit.values()) if self.per_unit else 0


def frequency(per_unit: dict[int, int], outside: int, total: int, unit: str = "step") -> str:
    """``"3 per step over 12 steps"``, ``"5 times in 2 of 12 steps"``, ``"2 times outside steps"``..."""
    parts = []
    if per_unit:
        seen = len(per_unit)
        counts = set(per_unit.values())
        total = max(total, seen)
        units = plural(total, unit).split(" ", 1)[1]
        if len(counts) == 1:
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


def short(stack: Stack) -> Stack:
    """Your frames and the innermost one: enough to see which of your calls led to a library's event."""
    return tuple(f for i, f in enumerate(stack) if f.is_user or i == len(stack) - 1)


def step_verdict(
    name: str,
    run: "Run",
    *,
    what: str,
    failing: Sequence[Any],
    noted: Sequence[Any],
    allowed: Sequence[Any],
    finding: Callable[[Any, str], Finding],
    figures: dict[str, Any],
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
    do; ``clean`` is the summary's head when nothing fails.
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
