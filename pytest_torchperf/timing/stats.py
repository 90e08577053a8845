"""The statistics of a timed A/B comparison: pure Python, no torch, no clocks.

Quantiles and a seeded bootstrap (for the spread figures), the epoch times of
one side (:class:`SideStats`), and :class:`Rounds`: the paired epoch times of
a comparison and the rule that says when to stop timing.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from ..options import OVERHEAD_MIN_ROUNDS, OVERHEAD_ROUNDS, UsageError

#: Fewest timed rounds before the interval may stop the timing.
MIN_ROUNDS = OVERHEAD_MIN_ROUNDS
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000


def check_int(value: Any, name: str, lo: int, hi: int, where: str) -> int:
    """``value`` if it is an int in ``[lo, hi]``; else a :class:`UsageError` naming ``name`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"{where}: {name} must be an integer from {lo} to {hi}, got {value!r}")
    return value


def median(values: Sequence[float]) -> float:
    return quantile(values, 0.5)


def quantile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile (numpy's default) of a non-empty sequence."""
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of no values")
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def bootstrap_interval(
    values: Sequence[float],
    *,
    level: float = CONFIDENCE,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``values`` (seeded: the same data gives the same interval)."""
    xs = list(values)
    if len(xs) == 1:
        return xs[0], xs[0]
    rng = random.Random(seed)
    n = len(xs)
    lo_i, hi_i = (n - 1) // 2, n // 2  # the middle one, or the middle two
    medians = []
    for _ in range(resamples):
        sample = sorted(rng.choices(xs, k=n))
        medians.append((sample[lo_i] + sample[hi_i]) / 2)
    medians.sort()
    tail = (1.0 - level) / 2
    return quantile(medians, tail), quantile(medians, 1.0 - tail)


@dataclass
class SideStats:
    """The epoch times of one side of a comparison."""

    name: str
    #: Epoch seconds, less the time the timing thread waited for a CPU when that was measured.
    times: list[float]
    #: Per epoch, the seconds the timing thread waited for a CPU (run-queue delay); empty where not measured.
    waits: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return median(self.times)

    @property
    def wait_share(self) -> Optional[float]:
        """The share of the wall time spent waiting for a CPU, taken out of ``times``; None when not measured."""
        if not self.waits:
            return None
        wall = sum(self.times) + sum(self.waits)
        return sum(self.waits) / wall if wall > 0 else 0.0

    @property
    def spread(self) -> float:
        """Interquartile range relative to the median (0.02: the middle half of the epochs lie within 2%)."""
        m = self.median
        return (quantile(self.times, 0.75) - quantile(self.times, 0.25)) / m if m > 0 else 0.0

    def describe(self) -> str:
        return f"{self.name}: median {fmt_seconds(self.median)} per epoch, spread (IQR) {self.spread:.1%}, {len(self.times)} epochs"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_s": self.median,
            "spread": self.spread,
            "times_s": list(self.times),
            "cpu_wait_s": list(self.waits) or None,
        }



def fmt_pct(x: float) -> str:
    return f"{x:+.1%}"


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


class Rounds:
    """Paired epoch times and the rule that says when to stop timing.

    Stops once ``min_rounds`` rounds are in and the interval is clear of
    ``max_overhead`` (or, without a threshold, narrower than 4 points), or when
    ``rounds`` rounds are in.
    """

    def __init__(self, max_overhead: Optional[float] = None, rounds: int = OVERHEAD_ROUNDS, min_rounds: int = MIN_ROUNDS) -> None:
        self.max_overhead = max_overhead
        self.max_rounds = rounds
        self.min_rounds = min(min_rounds, rounds)
        self.candidate: list[float] = []
        self.baseline: list[float] = []
        self.candidate_waits: list[float] = []
        self.baseline_waits: list[float] = []
        self.stop_reason = "not stopped"

    def __len__(self) -> int:
        return len(self.candidate)

    @property
    def ratios(self) -> list[float]:
        return [c / b if b > 0 else math.inf for c, b in zip(self.candidate, self.baseline)]

    def add(
        self,
        candidate_s: float,
        baseline_s: float,
        candidate_wait_s: Optional[float] = None,
        baseline_wait_s: Optional[float] = None,
    ) -> None:
        """One round: wall seconds of each side and, where measured, the part spent waiting for a CPU."""
        if candidate_wait_s is not None and baseline_wait_s is not None:
            # A thread cannot have waited through (nearly) all of a section it did work in: distrust such a reading.
            candidate_wait_s = candidate_wait_s if candidate_wait_s < 0.9 * candidate_s else 0.0
            baseline_wait_s = baseline_wait_s if baseline_wait_s < 0.9 * baseline_s else 0.0
            self.candidate_waits.append(candidate_wait_s)
            self.baseline_waits.append(baseline_wait_s)
            candidate_s -= candidate_wait_s
            baseline_s -= baseline_wait_s
        self.candidate.append(candidate_s)
        self.baseline.append(baseline_s)

    def done(self) -> bool:
        n = len(self)
        if n >= self.min_rounds:
            lo, hi = bootstrap_interval(self.ratios)
            if self.max_overhead is not None:
                limit = 1.0 + self.max_overhead
                if lo > limit:
                    self.stop_reason = f"after {n} rounds the 95% interval was entirely above the threshold"
                    return True
                if hi < limit:
                    self.stop_reason = f"after {n} rounds the 95% interval was entirely below the threshold"
                    return True
            elif hi - lo <= 0.04:
                self.stop_reason = f"after {n} rounds the 95% interval was narrower than 4 points"
                return True
        if n >= self.max_rounds:
            self.stop_reason = f"round budget of {self.max_rounds} spent"
            return True
        return False

    def sides(self, names: tuple[str, str]) -> tuple[SideStats, SideStats]:
        """Both sides' epoch times (with their waits for a CPU where every round measured them)."""
        measured = len(self.candidate_waits) == len(self.candidate)
        return (
            SideStats(names[0], list(self.candidate), list(self.candidate_waits) if measured else []),
            SideStats(names[1], list(self.baseline), list(self.baseline_waits) if measured else []),
        )
