"""The statistics of a timed A/B comparison: pure Python, no torch, no clocks.

A comparison is a sequence of *rounds*, each one epoch of the candidate (A)
and one of the baseline (B), in alternating order: A B, then B A, then A B...
A side that runs right after itself runs warm; right after the other side it
runs cold (caches, branch predictors, the allocator's free lists). On a tiny
Lightning module that made rounds of one order 8 points more expensive than
rounds of the other (+89.6% against +81.3%), so consecutive rounds were not
independent draws of one quantity. The estimator models it:

    log(A_i / B_i) = mu + s_i * delta + e_i,     s_i = +1 or -1 by the order of round i

``mu`` (the overhead on a log scale) is the mean of the two orders' mean log
ratios, ``delta`` half their difference; the residuals ``e_i`` give a Student
t interval with ``n - 2`` degrees of freedom (:func:`estimate`), widened by
:data:`RUN_TO_RUN_SD`, the spread measured between independent runs beyond
what one run's rounds show.

Timing stops early (:class:`Rounds`) when the interval is clear of the
threshold. Every look at the data is a chance to stop on a fluke, so the
looks share the 5% error a verdict may have (a weighted Bonferroni bound):
the first look, after 4 rounds, gets half of it, the later ones split the
other half (:func:`look_levels`). The verdict holds at 95% however many looks
it took, and most clear cases stop at the first.

On a machine measured quiet, an *early look* comes after 2 rounds (one of each
order, so the order effect cancels). Two rounds cannot estimate their own
spread, so it assumes one (2.5 times a quiet machine's), spends a quarter of the
5% and leaves the rest to the regular looks: a case far from the threshold
stops there, anything closer goes on. Where our threads waited for a CPU, the
interval also carries a systematic term proportional to that wait share
(:data:`LOAD_SHIFT_PER_WAIT`): rounds alike cannot show a shift that load
brings to every round. A verdict is *passed* (the
interval lies below the threshold), *failed* (above) or *inconclusive* (it
straddles the threshold when the round budget is spent).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any, Optional

from ..options import OVERHEAD_MIN_ROUNDS, OVERHEAD_ROUNDS, UsageError

__all__ = [
    "CONFIDENCE",
    "MIN_ROUNDS",
    "RUN_TO_RUN_SD",
    "VERDICTS",
    "Estimate",
    "Rounds",
    "SideStats",
    "check_int",
    "estimate",
    "look_levels",
    "looks",
    "median",
    "quantile",
    "t_quantile",
    "verdict",
]

#: Fewest timed rounds before the interval may stop the timing (two rounds of each order).
MIN_ROUNDS = OVERHEAD_MIN_ROUNDS
#: Confidence of a verdict over all the looks it took.
CONFIDENCE = 0.95
#: Standard deviation of the log overhead between independent runs of one fit, beyond the spread of each
#: run's own rounds (memory layout of the copies, slow drifts). Measured on CPU, 1 torch thread, 6-8 runs
#: of 16-20 rounds: between-run SD 0.45-0.79% against 0.40-0.55% predicted from the rounds.
RUN_TO_RUN_SD = 0.006
#: Without a threshold, timing stops once the interval is narrower than this (in overhead points).
MEASURE_WIDTH = 0.04
#: The early look: after this many rounds (one of each order), on a quiet machine only (see :class:`Rounds`).
EARLY_ROUNDS = 2
#: The share of the 5% error the early look spends when it is taken (the later looks share the rest).
EARLY_ALPHA_SHARE = 0.25
#: The spread of a round's log ratio the early look assumes, since two rounds cannot estimate it: 2.5 times
#: the typical residual of a quiet machine (0.02), and at least the difference the two rounds show.
EARLY_ROUND_SD = 0.05
#: The early look is taken only while both sides waited for a CPU less than this share of their time.
QUIET_WAIT_SHARE = 0.05
#: Half-width added on the log scale per unit of CPU-wait share (0.1 at waits of 50%): a core shared with
#: other work also shares its caches, which moves a Python-heavy side (Lightning's) more than a tensor-heavy
#: one. Measured on a tiny module: +80-85% quiet against +95-134% with waits of 54-77%. Rounds alike cannot
#: show a shift that hits every round, so the interval carries it as a systematic term.
LOAD_SHIFT_PER_WAIT = 0.2

PASSED = "passed"
FAILED = "failed"
INCONCLUSIVE = "inconclusive"
VERDICTS = (PASSED, FAILED, INCONCLUSIVE)


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


# ----------------------------------------------------------------------------- Student t


def _betainc(a: float, b: float, x: float) -> float:
    """Regularized incomplete beta I_x(a, b), by its continued fraction (modified Lentz)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    if x > (a + 1.0) / (a + b + 2.0):  # the fraction converges fast on this side only
        return 1.0 - _betainc(b, a, 1.0 - x)
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)) / a
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 500):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            h *= c * d
        if abs(c * d - 1.0) < 1e-15:
            break
    return front * h


def _t_cdf(t: float, df: float) -> float:
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (``t_quantile(0.975, 2)`` = 4.303)."""
    if not 0.0 < p < 1.0 or df <= 0:
        raise ValueError(f"t_quantile needs 0 < p < 1 and df > 0, got p={p!r}, df={df!r}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):  # bisection: plenty for 1e-12 on any quantile used here
        mid = (lo + hi) / 2.0
        if _t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


# ----------------------------------------------------------------------------- the estimate


@dataclass(frozen=True)
class Estimate:
    """The overhead of A over B from paired rounds, with its interval (see the module docstring)."""

    #: exp(mu) - 1: 0.25 means A takes 25% longer than B.
    overhead: float
    #: The interval of ``overhead`` at ``level``; ``(-1.0, inf)`` when fewer than 3 rounds allow none.
    interval: tuple[float, float]
    #: Confidence of ``interval`` at this look (above 95% when several looks are allowed).
    level: float
    rounds: int
    #: exp(2 delta) - 1: how much more the overhead measured in A-first rounds than in B-first ones
    #: (0.0 when the rounds did not run in both orders).
    order_effect: float
    #: Standard deviation of the residual log ratios (0.02: a round is typically 2% off the model).
    sd: float

    @property
    def width(self) -> float:
        lo, hi = self.interval
        return hi - lo


def _logs(ratios: Sequence[float]) -> list[float]:
    return [math.log(min(max(r, 1e-9), 1e9)) if math.isfinite(r) else math.log(1e9) for r in ratios]


def estimate(
    ratios: Sequence[float],
    level: float = CONFIDENCE,
    run_to_run_sd: float = RUN_TO_RUN_SD,
    candidate_first: Optional[Sequence[bool]] = None,
    round_sd: Optional[float] = None,
    shift: float = 0.0,
) -> Estimate:
    """The overhead and its ``level`` interval from per-round ratios A/B.

    ``candidate_first[i]`` says whether A ran first in round ``i`` (default:
    rounds 0, 2, 4... did). Rounds of both orders: the two-order model of the
    module docstring, ``n - 2`` degrees of freedom; rounds of one order only:
    a plain mean, ``n - 1``. With no degree of freedom left (one round of each
    order), ``round_sd`` gives a known spread of a round (normal quantiles)
    instead of no interval. ``shift`` widens the interval by that much on the
    log scale on both sides (a systematic error no spread of the rounds
    shows). Pure arithmetic: the same rounds always give the same estimate.
    """
    ys = _logs(ratios)
    n = len(ys)
    if n == 0:
        raise ValueError("estimate of no rounds")
    if candidate_first is None:
        candidate_first = [i % 2 == 0 for i in range(n)]
    first = [y for y, f in zip(ys, candidate_first) if f]
    second = [y for y, f in zip(ys, candidate_first) if not f]
    groups = [g for g in (first, second) if g]
    means = [sum(g) / len(g) for g in groups]
    mu = sum(means) / len(means)
    order_effect = math.exp(means[0] - means[1]) - 1.0 if len(groups) == 2 else 0.0
    df = n - len(groups)
    tail = 1.0 - (1.0 - level) / 2.0
    if df < 1:
        if round_sd is None:
            return Estimate(math.exp(mu) - 1.0, (-1.0, math.inf), level, n, order_effect, 0.0)
        # A known spread: normal quantiles for both parts.
        sd = round_sd
        se = (sd / len(groups)) * math.sqrt(sum(1.0 / len(g) for g in groups))
        half = NormalDist().inv_cdf(tail) * math.hypot(se, run_to_run_sd) + shift
    else:
        ss = sum((y - m) ** 2 for g, m in zip(groups, means) for y in g)
        sd = math.sqrt(ss / df)
        # Standard error of mu, the mean of the group means.
        se = (sd / len(groups)) * math.sqrt(sum(1.0 / len(g) for g in groups))
        # The rounds' own spread is estimated (Student t); the run-to-run part is a known constant (normal).
        half = math.hypot(t_quantile(tail, df) * se, NormalDist().inv_cdf(tail) * run_to_run_sd) + shift
    return Estimate(
        overhead=math.exp(mu) - 1.0,
        interval=(math.exp(mu - half) - 1.0, math.exp(mu + half) - 1.0),
        level=level,
        rounds=n,
        order_effect=order_effect,
        sd=sd,
    )


def verdict(est: Estimate, max_overhead: Optional[float]) -> Optional[str]:
    """``passed`` / ``failed`` when the interval lies below / above ``max_overhead``, else ``inconclusive``; None
    without one.
    """
    if max_overhead is None:
        return None
    lo, hi = est.interval
    if lo > max_overhead:
        return FAILED
    if hi < max_overhead:
        return PASSED
    return INCONCLUSIVE


def looks(max_rounds: int, min_rounds: int = MIN_ROUNDS) -> list[int]:
    """The round counts at which :class:`Rounds` looks at the data: complete pairs of orders, and the last round."""
    first = min(min_rounds, max_rounds)
    return [n for n in range(first, max_rounds + 1) if n % 2 == 0 or n == max_rounds]


def look_levels(looks_at: Sequence[int], confidence: float = CONFIDENCE) -> dict[int, float]:
    """The confidence of the interval at each look: the first takes half of the error allowed, the rest share the other
    half.
    """
    alpha = 1.0 - confidence
    if len(looks_at) == 1:
        return {looks_at[0]: confidence}
    later = alpha / 2.0 / (len(looks_at) - 1)
    return {n: 1.0 - (alpha / 2.0 if i == 0 else later) for i, n in enumerate(looks_at)}


# ----------------------------------------------------------------------------- sides and rounds


@dataclass
class SideStats:
    """The epoch times of one side of a comparison."""

    name: str
    #: Epoch seconds in the comparison's unit (less the time the timing thread waited for a CPU, where measured).
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
        return (f"{self.name}: median {fmt_seconds(self.median)} per epoch, spread (IQR) {self.spread:.1%}, "
                f"{len(self.times)} epochs")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_s": self.median,
            "spread": self.spread,
            "times_s": list(self.times),
            "cpu_wait_s": list(self.waits) or None,
        }


def fmt_pct(x: float) -> str:
    return f"{x:+.1%}" if math.isfinite(x) else ("+inf" if x > 0 else "-inf")


def fmt_seconds(s: float) -> str:
    if s >= 1.0:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.1f} ms"
    return f"{s * 1e6:.0f} us"


class Rounds:
    """Paired epoch times and the rule that says when to stop timing.

    Looks at the data after ``min_rounds`` rounds, then after every second
    round (both orders equally often) and after the last one; stops at the
    first look whose interval is clear of ``max_overhead`` (without a
    threshold: narrower than 4 points), or when ``rounds`` rounds are in.
    Each look's interval has the confidence :func:`look_levels` gives it (see
    the module docstring).
    """

    def __init__(
        self, max_overhead: Optional[float] = None, rounds: int = OVERHEAD_ROUNDS, min_rounds: int = MIN_ROUNDS
    ) -> None:
        self.max_overhead = max_overhead
        self.max_rounds = rounds
        self.min_rounds = min(min_rounds, rounds)
        self.looks = looks(rounds, self.min_rounds)
        #: Confidence of the interval at each look.
        self.levels = look_levels(self.looks)
        self.candidate: list[float] = []
        self.baseline: list[float] = []
        self.candidate_waits: list[float] = []
        self.baseline_waits: list[float] = []
        #: Per round, whether the candidate ran first.
        self.candidate_first: list[bool] = []
        self.stop_reason = "not stopped"
        #: The early look was taken (it spent its share of the error; the later looks share the rest).
        self.early_taken = False
        self.early_level = 1.0 - (1.0 - CONFIDENCE) * EARLY_ALPHA_SHARE

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
        candidate_first: Optional[bool] = None,
    ) -> None:
        """One round: seconds of each side, where measured the part spent waiting for a CPU, and which ran
        first (default: the candidate in rounds 0, 2, 4...)."""
        self.candidate_first.append(len(self) % 2 == 0 if candidate_first is None else bool(candidate_first))
        if candidate_wait_s is not None and baseline_wait_s is not None:
            # The kernel's run-queue delay of this thread, taken out whatever its share: on a core shared several
            # times over, a short epoch does wait through most of its wall time. (Readings of 90% and more used
            # to be replaced by 0, which left those epochs at their whole wall time: a round of a far case then
            # read +19% against +86%, and the machine looked quiet to the early look.)
            candidate_wait_s = min(max(candidate_wait_s, 0.0), candidate_s)
            baseline_wait_s = min(max(baseline_wait_s, 0.0), baseline_s)
            self.candidate_waits.append(candidate_wait_s)
            self.baseline_waits.append(baseline_wait_s)
            candidate_s -= candidate_wait_s
            baseline_s -= baseline_wait_s
        self.candidate.append(candidate_s)
        self.baseline.append(baseline_s)

    @property
    def level(self) -> float:
        """The confidence of the interval now: that of the last look taken (the first one before it)."""
        if self._at_early_look():
            return self.early_level
        taken = [n for n in self.looks if n <= len(self)]
        return self.levels[taken[-1] if taken else self.looks[0]]

    @property
    def wait_share(self) -> Optional[float]:
        """The larger share of its wall time either side waited for a CPU; None unless every round measured it."""
        if not self.candidate or len(self.candidate_waits) != len(self.candidate):
            return None
        shares = []
        for times, waits in ((self.candidate, self.candidate_waits), (self.baseline, self.baseline_waits)):
            wall = sum(times) + sum(waits)
            shares.append(sum(waits) / wall if wall > 0 else 0.0)
        return max(shares)

    @property
    def shift(self) -> float:
        """The systematic half-width load adds to the interval (log scale; see :data:`LOAD_SHIFT_PER_WAIT`)."""
        share = self.wait_share
        return LOAD_SHIFT_PER_WAIT * share if share else 0.0

    def _at_early_look(self) -> bool:
        return self.early_taken and len(self) == EARLY_ROUNDS

    def _early_round_sd(self) -> float:
        """The spread the early look assumes: at least :data:`EARLY_ROUND_SD`, the two rounds' difference, and
        what each side's own two epochs differ by (a workload whose epochs vary, one side against itself, has
        ratios that vary as much even where two of them happen to agree)."""
        ys = _logs(self.ratios)
        sides = [abs(math.log(a / b)) * math.sqrt(2.0) for a, b in (self.candidate, self.baseline) if a > 0 and b > 0]
        return max([EARLY_ROUND_SD, abs(ys[0] - ys[1]), *sides])

    def _early_look_allowed(self) -> bool:
        """After one round of each order, on a quiet machine, before the first regular look, with a threshold.

        Two rounds cannot estimate their own spread, so the early look assumes one
        (:data:`EARLY_ROUND_SD`, or the two rounds' difference if larger) and is only
        taken where that assumption was measured to hold: both sides' waits for a CPU
        measured and under :data:`QUIET_WAIT_SHARE`. Anything close to the threshold
        goes on to the regular looks.
        """
        if self.early_taken or self.max_overhead is None or len(self) != EARLY_ROUNDS:
            return False
        if self.looks[0] <= EARLY_ROUNDS or sorted(self.candidate_first) != [False, True]:
            return False
        share = self.wait_share
        return share is not None and share < QUIET_WAIT_SHARE

    def estimate(self) -> Estimate:
        if self._at_early_look():
            return estimate(
                self.ratios, self.early_level, candidate_first=self.candidate_first,
                round_sd=self._early_round_sd(), shift=self.shift,
            )
        return estimate(self.ratios, self.level, candidate_first=self.candidate_first, shift=self.shift)

    @property
    def verdict(self) -> Optional[str]:
        """The verdict on the rounds so far (None without a threshold)."""
        return verdict(self.estimate(), self.max_overhead)

    def done(self) -> bool:
        n = len(self)
        if self._early_look_allowed():
            self.early_taken = True
            self.levels = look_levels(self.looks, 1.0 - (1.0 - CONFIDENCE) * (1.0 - EARLY_ALPHA_SHARE))
            decided = verdict(self.estimate(), self.max_overhead)
            if decided in (PASSED, FAILED):
                side = "above" if decided == FAILED else "below"
                self.stop_reason = (
                    f"after {n} rounds (one of each order, on a quiet machine) the interval was entirely {side} "
                    "the threshold"
                )
                return True
        if n in self.looks:
            est = self.estimate()
            decided = verdict(est, self.max_overhead)
            if decided in (PASSED, FAILED):
                side = "above" if decided == FAILED else "below"
                self.stop_reason = f"after {n} rounds the interval was entirely {side} the threshold"
                return True
            if decided is None and est.width <= MEASURE_WIDTH:
                self.stop_reason = f"after {n} rounds the interval was narrower than {MEASURE_WIDTH * 100:.0f} points"
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
