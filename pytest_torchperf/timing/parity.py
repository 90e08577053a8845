"""``parity()``: time two callables against each other, and :class:`ParityResult`, the verdict it returns.

Calls alternate candidate/baseline then baseline/candidate (each pair adjacent
in time, so slow drifts of the machine cancel); the first ``warmup`` rounds
are dropped; :class:`~pytest_torchperf.timing.stats.Rounds` decides when to
stop and what the verdict is: passed, failed or inconclusive. The
``max_overhead`` invariant reports through the same :class:`ParityResult`.
"""

from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..arguments import suggest
from ..clocks import perf_counter
from ..options import OVERHEAD_INCONCLUSIVE, OVERHEAD_MAX_ROUNDS, OVERHEAD_ROUNDS, UsageError, parse_options
from ..report import FAILED, INCONCLUSIVE, PASSED, CheckResult, Finding, Report, settle
from .clock import RETURNED_TIME, UNIT_TEXT, LoadMeter, Stopwatch, frozen_heap, timing_lock, torch_threads
from .stats import (
    CONFIDENCE,
    MIN_ROUNDS,
    Estimate,
    Rounds,
    SideStats,
    check_int,
    estimate,
    fmt_pct,
    fmt_seconds,
    median,
    verdict,
)


@dataclass
class ParityResult:
    """A timed comparison: candidate vs baseline epochs, the overhead with its interval, the verdict.

    ``overhead`` is the candidate's epoch time over the baseline's, minus one
    (0.25: the candidate takes 25% longer): the geometric mean of the paired
    rounds' ratios, corrected for the order of each round; ``interval`` its
    95% interval (see :mod:`pytest_torchperf.timing.stats`). ``verdict`` is
    ``passed`` (the interval lies below ``max_overhead``), ``failed``
    (above), ``inconclusive`` (it straddles it) or None without a threshold.
    """

    candidate: SideStats
    baseline: SideStats
    ratios: list[float]
    max_overhead: Optional[float]
    warmup_rounds: int
    stop_reason: str
    #: Confidence of the interval at the look that ended the timing (the looks together keep the verdict at 95%).
    level: float = CONFIDENCE
    #: What the epoch times measure (see :func:`pytest_torchperf.timing.clock.clock_unit`).
    unit: str = ""
    threads: Optional[int] = None
    device: Optional[str] = None
    load: dict[str, Any] = field(default_factory=dict)
    lock: Optional[str] = None
    lock_wait_s: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    #: What to do for an inconclusive verdict, for :meth:`report` (one of ``"fail"``, ``"skip"``, ``"warn"``).
    on_inconclusive: str = "fail"
    #: The advice an inconclusive verdict gives (how to get a decisive one).
    advice: str = ""
    #: Per round, whether the candidate ran first (empty: rounds 0, 2, 4... did).
    candidate_first: list[bool] = field(default_factory=list)
    #: The systematic half-width (log scale) the machine's load added to the interval (see ``Rounds.shift``).
    load_shift: float = 0.0
    _estimate: Optional[Estimate] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_rounds(cls, rounds: Rounds, names: tuple[str, str], warmup_rounds: int, **context: Any) -> ParityResult:
        """The result of the comparison ``rounds`` timed (``context``: the other fields)."""
        candidate, baseline = rounds.sides(names)
        result = cls(
            candidate=candidate,
            baseline=baseline,
            ratios=rounds.ratios,
            max_overhead=rounds.max_overhead,
            warmup_rounds=warmup_rounds,
            stop_reason=rounds.stop_reason,
            level=rounds.level,
            candidate_first=list(rounds.candidate_first),
            load_shift=rounds.shift,
            **context,
        )
        result._estimate = rounds.estimate()  # with what the rounds know beyond their ratios (load, early look)
        return result

    @property
    def estimate(self) -> Estimate:
        if self._estimate is None:
            first = self.candidate_first if len(self.candidate_first) == len(self.ratios) else None
            self._estimate = estimate(self.ratios, self.level, candidate_first=first)
        return self._estimate

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    @property
    def overhead(self) -> float:
        return self.estimate.overhead

    @property
    def interval(self) -> tuple[float, float]:
        return self.estimate.interval

    @property
    def verdict(self) -> Optional[str]:
        """``passed``, ``failed``, ``inconclusive``, or None when no threshold was given."""
        return verdict(self.estimate, self.max_overhead)

    @property
    def exceeded(self) -> Optional[bool]:
        """Whether the whole interval lies above ``max_overhead`` (None without a threshold)."""
        return None if self.max_overhead is None else self.verdict == FAILED

    @property
    def inconclusive(self) -> bool:
        return self.verdict == INCONCLUSIVE

    @property
    def passed(self) -> bool:
        """Whether the whole interval lies below ``max_overhead`` (True without a threshold)."""
        return self.verdict in (None, PASSED)

    @property
    def decisive(self) -> bool:
        """Whether the whole interval lies on one side of the threshold."""
        return self.verdict in (PASSED, FAILED)

    @property
    def loaded(self) -> bool:
        return bool(self.load.get("loaded"))

    def _ci(self) -> str:
        lo, hi = self.interval
        return f"95% CI {fmt_pct(lo)}..{fmt_pct(hi)}"

    def summary(self) -> str:
        """One line: ``+18.2% over vanilla loop (95% CI +15.0%..+21.1%, 6 rounds) < 30%``."""
        text = f"{fmt_pct(self.overhead)} over {self.baseline.name} ({self._ci()}, {self.rounds} rounds)"
        if self.max_overhead is not None:
            relations: dict[str, str] = {PASSED: "<", FAILED: ">", INCONCLUSIVE: "straddles"}
            relation = relations[self.verdict or INCONCLUSIVE]
            text += f" {relation} {self.max_overhead:.0%}"
        return text

    def facts(self) -> list[str]:
        """The lines a report shows under the verdict."""
        lo, hi = self.interval
        est = self.estimate
        lines = [self.candidate.describe(), self.baseline.describe()]
        over = (
            f"overhead {fmt_pct(self.overhead)} (the geometric mean of {self.rounds} rounds, each timing the "
            f"{self.candidate.name} and the {self.baseline.name} once, in alternating order; when the "
            f"{self.candidate.name} ran first it measured {fmt_pct(est.order_effect)} against the rounds where it ran "
            f"second, which alternating cancels out), 95% interval {fmt_pct(lo)}..{fmt_pct(hi)}"
        )
        if self.max_overhead is not None:
            threshold = f"the threshold {self.max_overhead:.0%}"
            endings: dict[str, str] = {
                PASSED: f": entirely below {threshold}",
                FAILED: f": entirely above {threshold}",
                INCONCLUSIVE: f": it includes {threshold}, so this run can neither pass nor fail it",
            }
            over += endings[self.verdict or INCONCLUSIVE]
        lines.append(over)
        shares = (self.candidate.wait_share, self.baseline.wait_share)
        if shares[0] is not None and shares[1] is not None:
            lines.append(
                "epoch times exclude the time the timing thread was ready to run but waited for a CPU "
                f"(Linux run-queue delay): {shares[0]:.1%} of {self.candidate.name}'s wall time, "
                f"{shares[1]:.1%} of {self.baseline.name}'s"
            )
        if self.load_shift >= 0.005:
            lines.append(
                f"the interval is widened by {self.load_shift:.1%} (log scale) on both sides for that load: a core "
                "shared with other work also shares its caches, which moves both sides' times in every round alike"
            )
        warm = f"{self.warmup_rounds} warm-up round{'s' if self.warmup_rounds != 1 else ''} dropped"
        lines.append(
            f"rounds: {self.rounds} timed, interleaved A/B then B/A, {warm}; stopped: {self.stop_reason} "
            f"(that look's interval is a {self.level:.1%} one, so that all the looks together hold at 95%)"
        )
        setting = []
        if self.unit:
            setting.append(f"unit: {UNIT_TEXT.get(self.unit, self.unit)}")
        if self.threads is not None:
            setting.append(f"torch threads {self.threads} on both sides")
        if self.device:
            setting.append(f"device {self.device}")
        load_text = self.load.get("text")
        if load_text:
            setting.append(load_text)
        if self.lock:
            setting.append(f"timing lock {self.lock} (waited {fmt_seconds(self.lock_wait_s)})")
        if setting:
            lines.append("timing: " + "; ".join(setting))
        lines.extend(self.notes)
        return lines

    def to_dict(self) -> dict[str, Any]:
        lo, hi = self.interval
        est = self.estimate
        return {
            "overhead": self.overhead,
            "interval": [lo, hi if math.isfinite(hi) else None],
            "confidence": CONFIDENCE,
            "level": self.level,
            "verdict": self.verdict,
            "max_overhead": self.max_overhead,
            "exceeded": self.exceeded,
            "decisive": self.decisive,
            "rounds": self.rounds,
            "warmup_rounds": self.warmup_rounds,
            "stop_reason": self.stop_reason,
            "ratios": list(self.ratios),
            "candidate_first": list(self.candidate_first),
            "order_effect": est.order_effect,
            "round_sd": est.sd,
            "load_shift": self.load_shift,
            "unit": self.unit,
            "candidate": self.candidate.to_dict(),
            "baseline": self.baseline.to_dict(),
            "threads": self.threads,
            "device": self.device,
            "load": dict(self.load),
            "loaded": self.loaded,
            "lock": self.lock,
            "lock_wait_s": self.lock_wait_s,
            "elapsed_s": self.elapsed_s,
            "notes": list(self.notes),
        }

    def inconclusive_hint(self) -> str:
        """What to do about an inconclusive verdict."""
        lo, hi = self.interval
        hint = (
            f"after {self.rounds} rounds the interval {fmt_pct(lo)}..{fmt_pct(hi)} still includes "
            f"{self.max_overhead:.0%}: time more rounds for a narrower interval"
            f"{' (' + self.advice + ')' if self.advice else ''}, set the threshold with a margin "
            f"(above {fmt_pct(hi)} to pass, below {fmt_pct(lo)} to fail), or run on a quieter machine; "
            "overhead_inconclusive='skip' or 'warn' makes such a verdict a skip or a pass with a warning"
        )
        return hint

    def check_result(self, name: str = "max_overhead", *, title: Optional[str] = None) -> CheckResult:
        """This comparison as the verdict of one invariant (for a :class:`Report`)."""
        statuses: dict[Optional[str], str] = {PASSED: PASSED, FAILED: FAILED, INCONCLUSIVE: INCONCLUSIVE, None: PASSED}
        status = statuses[self.verdict]
        if title is None:
            title = (
                f"{self.candidate.name} took {fmt_seconds(self.candidate.median)} per epoch vs "
                f"{fmt_seconds(self.baseline.median)} for {self.baseline.name}: {fmt_pct(self.overhead)}"
            )
            if self.max_overhead is not None:
                title += f" (max_overhead {self.max_overhead:.0%}{', inconclusive' if self.inconclusive else ''})"
        findings = []
        if status == FAILED:
            hint = (
                f"{self.candidate.name} does more work per epoch than {self.baseline.name}; "
                "if that work is expected, raise max_overhead above the interval's upper end"
            )
            findings.append(Finding(title, self.facts(), [], hint))
        elif status == INCONCLUSIVE:
            findings.append(Finding(title, self.facts(), [], self.inconclusive_hint()))
        return CheckResult(name, status, self.summary(), 1 if status == FAILED else 0, findings, self.to_dict())

    def report(self) -> Report:
        """A torchperf :class:`Report` with this comparison as its ``max_overhead`` verdict."""
        return Report(checks={"max_overhead": self.check_result()}, on_inconclusive=self.on_inconclusive)

    def __str__(self) -> str:
        return "\n".join([self.summary()] + ["  " + line for line in self.facts()])


# ----------------------------------------------------------------------------- parity(callables)


def _call_time(fn: Callable[[], Any], side: str) -> tuple[float, Optional[float], str]:
    """``(seconds, seconds waiting for a CPU or None, unit)`` of one call, or the epoch time the call returned."""
    watch = Stopwatch()
    watch.start()
    value = fn()
    elapsed, waited = watch.stop()
    if value is None:
        return elapsed, waited, watch.unit
    def is_number(v: Any) -> bool:
        return isinstance(v, numbers.Real) and not isinstance(v, bool)

    if is_number(value):
        times = [float(value)]
    elif isinstance(value, (list, tuple)) and value and all(is_number(v) for v in value):
        times = [float(v) for v in value]
    else:
        raise TypeError(
            f"torchperf.parity(): the {side} callable returned {value!r} ({type(value).__name__}); "
            "return None (the call is timed as one epoch) or the epoch times it measured, in seconds"
        )
    if not all(math.isfinite(t) and t > 0 for t in times):
        raise ValueError(
            f"torchperf.parity(): the {side} callable returned epoch times that are not positive: {times!r}"
        )
    return median(times), None, RETURNED_TIME


def parity(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    max_overhead: Optional[float] = None,
    rounds: int = OVERHEAD_ROUNDS,
    warmup: int = 1,
    names: tuple[str, str] = ("candidate", "baseline"),
    check: bool = True,
    inconclusive: str = "fail",
) -> ParityResult:
    """Time ``candidate`` against ``baseline``; fail when it is more than ``max_overhead`` slower.

    Each callable runs one epoch and returns None (its call is timed), or
    returns the epoch time(s) in seconds it measured itself (a round then uses
    their median). Calls alternate candidate/baseline then baseline/candidate;
    the first ``warmup`` rounds are dropped; timing stops once at least
    ``MIN_ROUNDS`` rounds are in and the 95% interval of the overhead is
    clear of ``max_overhead``, or after ``rounds`` rounds. Each call is timed
    on this thread, in the unit :func:`~pytest_torchperf.timing.clock.clock_unit`
    picks, with torch's thread count held at what it was when timing began.

    Returns the :class:`ParityResult`. With ``check`` true and a
    ``max_overhead``, acts on its verdict: a failed one raises
    :class:`InvariantViolation` whose ``report["max_overhead"]`` carries the
    same figures (``result.report()``); an inconclusive one (the interval
    still includes the threshold after ``rounds`` rounds) does what
    ``inconclusive`` says: ``"fail"`` raises the same, ``"skip"`` raises
    :class:`~pytest_torchperf.report.Inconclusive` (a ``unittest.SkipTest``),
    ``"warn"`` warns (:class:`~pytest_torchperf.report.InconclusiveWarning`).
    """
    where = "torchperf.parity()"
    for side, fn in (("candidate", candidate), ("baseline", baseline)):
        if not callable(fn):
            raise UsageError(f"{where}: {side} must be a callable that runs one epoch, got {fn!r}")
    max_overhead = parse_options({"max_overhead": max_overhead}, where=where).max_overhead
    if not isinstance(inconclusive, str) or inconclusive not in OVERHEAD_INCONCLUSIVE:
        hint = suggest(inconclusive, OVERHEAD_INCONCLUSIVE) if isinstance(inconclusive, str) else ""
        raise UsageError(
            f"{where}: inconclusive must be one of {', '.join(repr(c) for c in OVERHEAD_INCONCLUSIVE)}, "
            f"got {inconclusive!r}{hint}"
        )
    check_int(rounds, "rounds", MIN_ROUNDS, OVERHEAD_MAX_ROUNDS, where)
    check_int(warmup, "warmup", 0, 100, where)
    if not (isinstance(names, (tuple, list)) and len(names) == 2 and all(isinstance(n, str) and n for n in names)):
        raise UsageError(f"{where}: names must be two non-empty strings, got {names!r}")
    controller = Rounds(max_overhead, rounds)
    units: dict[str, None] = {}  # the units the calls were measured in, in order
    with timing_lock() as lock:
        locked = perf_counter()
        threads = torch_threads()
        repinned = 0
        with frozen_heap(), LoadMeter() as load:

            def timed(fn: Callable[[], Any], side: str) -> tuple[float, Optional[float]]:
                nonlocal repinned
                torch = sys.modules.get("torch")
                if threads is not None and torch is not None and torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                    repinned += 1
                seconds, waited, unit = _call_time(fn, side)
                units.setdefault(unit)
                return seconds, waited

            index = 0
            while True:
                first_candidate = index % 2 == 0
                if first_candidate:
                    c, c_wait = timed(candidate, "candidate")
                    b, b_wait = timed(baseline, "baseline")
                else:
                    b, b_wait = timed(baseline, "baseline")
                    c, c_wait = timed(candidate, "candidate")
                index += 1
                if index <= warmup:
                    continue
                controller.add(c, b, c_wait, b_wait, candidate_first=first_candidate)
                if controller.done():
                    break
    notes = []
    if repinned:
        notes.append(f"a callable changed torch's thread count; it was set back to {threads} before {repinned} calls")
    result = ParityResult.from_rounds(
        controller,
        (names[0], names[1]),
        warmup,
        unit=" and ".join(UNIT_TEXT.get(u, u) for u in units) if len(units) > 1 else next(iter(units), ""),
        threads=threads,
        load=load.figures,
        lock=lock.path,
        lock_wait_s=lock.waited_s,
        elapsed_s=perf_counter() - locked,
        notes=notes,
        on_inconclusive=inconclusive,
        advice=f"rounds={rounds}",
    )
    if check:
        settle(result.report())
    return result
