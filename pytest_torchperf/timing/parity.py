"""``parity()``: time two callables against each other, and :class:`ParityResult`, the verdict it returns.

Calls alternate candidate/baseline then baseline/candidate (each pair adjacent
in time, so slow drifts of the machine cancel); the first ``warmup`` rounds
are dropped; :class:`~pytest_torchperf.timing.stats.Rounds` decides when to
stop. The ``max_overhead`` invariant reports through the same
:class:`ParityResult`.
"""

from __future__ import annotations

import math
import numbers
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..options import OVERHEAD_MAX_ROUNDS, OVERHEAD_ROUNDS, UsageError, parse_options
from ..report import FAILED, PASSED, CheckResult, Finding, InvariantViolation, Report
from .clock import LoadMeter, Stopwatch, frozen_heap, timing_lock, torch_threads
from .stats import CONFIDENCE, MIN_ROUNDS, Rounds, SideStats, bootstrap_interval, check_int, fmt_pct, fmt_seconds, median


@dataclass
class ParityResult:
    """A timed comparison: candidate vs baseline epochs, the overhead with its interval, the verdict.

    ``overhead`` is the median of the per-round ratios candidate/baseline, minus
    one (0.25: the candidate takes 25% longer); ``interval`` its 95% bootstrap
    interval over the rounds. ``exceeded`` is None when no threshold was given.
    """

    candidate: SideStats
    baseline: SideStats
    ratios: list[float]
    max_overhead: Optional[float]
    warmup_rounds: int
    stop_reason: str
    threads: Optional[int] = None
    device: Optional[str] = None
    load: dict[str, Any] = field(default_factory=dict)
    lock: Optional[str] = None
    lock_wait_s: float = 0.0
    elapsed_s: float = 0.0
    notes: list[str] = field(default_factory=list)
    _interval: Optional[tuple[float, float]] = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_rounds(cls, rounds: Rounds, names: tuple[str, str], warmup_rounds: int, **context: Any) -> "ParityResult":
        """The result of the comparison ``rounds`` timed (``context``: the other fields)."""
        candidate, baseline = rounds.sides(names)
        return cls(
            candidate=candidate,
            baseline=baseline,
            ratios=rounds.ratios,
            max_overhead=rounds.max_overhead,
            warmup_rounds=warmup_rounds,
            stop_reason=rounds.stop_reason,
            **context,
        )

    @property
    def rounds(self) -> int:
        return len(self.ratios)

    @property
    def overhead(self) -> float:
        return median(self.ratios) - 1.0

    @property
    def interval(self) -> tuple[float, float]:
        if self._interval is None:
            lo, hi = bootstrap_interval(self.ratios)
            self._interval = (lo - 1.0, hi - 1.0)
        return self._interval

    @property
    def exceeded(self) -> Optional[bool]:
        if self.max_overhead is None:
            return None
        return self.overhead > self.max_overhead

    @property
    def passed(self) -> bool:
        return not self.exceeded

    @property
    def decisive(self) -> bool:
        """Whether the whole interval lies on one side of the threshold."""
        if self.max_overhead is None:
            return False
        lo, hi = self.interval
        return lo > self.max_overhead or hi < self.max_overhead

    @property
    def loaded(self) -> bool:
        return bool(self.load.get("loaded"))

    def summary(self) -> str:
        """One line: ``+18.2% over vanilla loop (95% CI +15.0%..+21.1%, 6 rounds) <= 30%``."""
        lo, hi = self.interval
        text = (
            f"{fmt_pct(self.overhead)} over {self.baseline.name} "
            f"(95% CI {fmt_pct(lo)}..{fmt_pct(hi)}, {self.rounds} rounds)"
        )
        if self.max_overhead is not None:
            text += f" {'>' if self.exceeded else '<='} {self.max_overhead:.0%}"
        return text

    def facts(self) -> list[str]:
        """The lines a report shows under the verdict."""
        lo, hi = self.interval
        lines = [self.candidate.describe(), self.baseline.describe()]
        over = f"overhead {fmt_pct(self.overhead)} (median of {self.rounds} paired rounds), 95% interval {fmt_pct(lo)}..{fmt_pct(hi)}"
        if self.max_overhead is not None:
            if self.decisive:
                side = "above" if lo > self.max_overhead else "below"
                over += f": entirely {side} the threshold {self.max_overhead:.0%}"
            else:
                over += f": includes the threshold {self.max_overhead:.0%}, so the verdict is a close call"
        lines.append(over)
        shares = (self.candidate.wait_share, self.baseline.wait_share)
        if shares[0] is not None and shares[1] is not None:
            lines.append(
                "epoch times exclude the time the timing thread was ready to run but waited for a CPU "
                f"(Linux run-queue delay): {shares[0]:.1%} of {self.candidate.name}'s wall time, "
                f"{shares[1]:.1%} of {self.baseline.name}'s"
            )
        warm = f"{self.warmup_rounds} warm-up round{'s' if self.warmup_rounds != 1 else ''} dropped"
        lines.append(f"rounds: {self.rounds} timed, interleaved A/B then B/A, {warm}; stopped: {self.stop_reason}")
        setting = []
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
        return {
            "overhead": self.overhead,
            "interval": [lo, hi],
            "confidence": CONFIDENCE,
            "max_overhead": self.max_overhead,
            "exceeded": self.exceeded,
            "decisive": self.decisive,
            "rounds": self.rounds,
            "warmup_rounds": self.warmup_rounds,
            "stop_reason": self.stop_reason,
            "ratios": list(self.ratios),
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

    def check_result(self, name: str = "max_overhead", *, title: Optional[str] = None) -> CheckResult:
        """This comparison as the verdict of one invariant (for a :class:`Report`)."""
        status = FAILED if self.exceeded else PASSED
        if title is None:
            title = (
                f"{self.candidate.name} took {fmt_seconds(self.candidate.median)} per epoch vs "
                f"{fmt_seconds(self.baseline.median)} for {self.baseline.name}: {fmt_pct(self.overhead)}"
            )
            if self.max_overhead is not None:
                title += f" (max_overhead {self.max_overhead:.0%})"
        hint = ""
        if self.exceeded:
            hint = (
                f"{self.candidate.name} does more work per epoch than {self.baseline.name}; "
                "if that work is expected, raise max_overhead above the interval's upper end"
            )
        finding = Finding(title, self.facts(), [], hint)
        return CheckResult(name, status, self.summary(), 1 if self.exceeded else 0, [finding] if self.exceeded else [], self.to_dict())

    def report(self) -> Report:
        """A torchperf :class:`Report` with this comparison as its ``max_overhead`` verdict."""
        return Report(checks={"max_overhead": self.check_result()})

    def __str__(self) -> str:
        return "\n".join([self.summary()] + ["  " + line for line in self.facts()])



# ----------------------------------------------------------------------------- parity(callables)


def _call_time(fn: Callable[[], Any], side: str) -> tuple[float, Optional[float]]:
    """``(seconds, seconds waiting for a CPU or None)`` of one call, or the epoch time the call returned."""
    watch = Stopwatch()
    watch.start()
    value = fn()
    elapsed, waited = watch.stop()
    if value is None:
        return elapsed, waited
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
        raise ValueError(f"torchperf.parity(): the {side} callable returned epoch times that are not positive: {times!r}")
    return median(times), None


def parity(
    candidate: Callable[[], Any],
    baseline: Callable[[], Any],
    *,
    max_overhead: Optional[float] = None,
    rounds: int = OVERHEAD_ROUNDS,
    warmup: int = 1,
    names: tuple[str, str] = ("candidate", "baseline"),
    check: bool = True,
) -> ParityResult:
    """Time ``candidate`` against ``baseline``; fail when it is more than ``max_overhead`` slower.

    Each callable runs one epoch and returns None (its call is timed), or
    returns the epoch time(s) in seconds it measured itself (a round then uses
    their median). Calls alternate candidate/baseline then baseline/candidate;
    the first ``warmup`` rounds are dropped; timing stops once at least
    ``MIN_ROUNDS`` rounds are in and the 95% interval of the median ratio is
    clear of ``max_overhead``, or after ``rounds`` rounds.

    Returns the :class:`ParityResult`. When ``max_overhead`` is given, the
    median overhead exceeds it and ``check`` is true, raises
    :class:`InvariantViolation` whose ``report["max_overhead"]`` carries the
    same figures (``result.report()``).
    """
    where = "torchperf.parity()"
    for side, fn in (("candidate", candidate), ("baseline", baseline)):
        if not callable(fn):
            raise UsageError(f"{where}: {side} must be a callable that runs one epoch, got {fn!r}")
    max_overhead = parse_options({"max_overhead": max_overhead}, where=where).max_overhead
    check_int(rounds, "rounds", MIN_ROUNDS, OVERHEAD_MAX_ROUNDS, where)
    check_int(warmup, "warmup", 0, 100, where)
    if not (isinstance(names, (tuple, list)) and len(names) == 2 and all(isinstance(n, str) and n for n in names)):
        raise UsageError(f"{where}: names must be two non-empty strings, got {names!r}")
    controller = Rounds(max_overhead, rounds)
    with timing_lock() as lock:
        locked = time.perf_counter()
        threads = torch_threads()
        repinned = 0
        with frozen_heap(), LoadMeter() as load:

            def timed(fn: Callable[[], Any], side: str) -> tuple[float, Optional[float]]:
                nonlocal repinned
                torch = sys.modules.get("torch")
                if threads is not None and torch is not None and torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
                    repinned += 1
                return _call_time(fn, side)

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
                controller.add(c, b, c_wait, b_wait)
                if controller.done():
                    break
    notes = []
    if repinned:
        notes.append(f"a callable changed torch's thread count; it was set back to {threads} before {repinned} calls")
    result = ParityResult.from_rounds(
        controller,
        (names[0], names[1]),
        warmup,
        threads=threads,
        load=load.figures,
        lock=lock.path,
        lock_wait_s=lock.waited_s,
        elapsed_s=time.perf_counter() - locked,
        notes=notes,
    )
    if check and result.exceeded:
        raise InvariantViolation(result.report())
    return result
