"""Framework vs vanilla timing: the vanilla loop derived from a module, and sound A/B statistics.

Plain Python, no pytest. Two public entry points:

- :func:`vanilla_fit` trains a LightningModule (or any ``nn.Module`` with
  ``training_step`` and ``configure_optimizers``) with the plain PyTorch loop
  its own methods describe, and returns the seconds each epoch took;
- :func:`parity` times two callables against each other (each runs one epoch,
  or returns the epoch times it measured itself) and says whether the first is
  within ``max_overhead`` of the second.

Timing method, shared with the ``max_overhead`` invariant: both sides run in
interleaved rounds (A B, B A, A B, ...: each pair adjacent in time, so slow
drifts of the machine cancel), warm-up rounds are dropped, CUDA is
synchronised at every boundary, torch runs with the same thread count on both
sides, and rounds continue until the 95% bootstrap interval of the median
paired ratio is clear of the threshold (at least :data:`MIN_ROUNDS` rounds) or
the round budget is spent. On Linux each timed section is its wall time less
the time the timing thread was ready to run but waited for a CPU (its
run-queue delay, ``/proc/thread-self/schedstat``): a burst of other work on a
small machine then costs neither side, where it would otherwise land in one
epoch of a pair. Sleeping, I/O and waiting for the GPU still count. Timed
sections take an exclusive file lock when ``PYTEST_TORCHPERF_TIMING_LOCK``
names a file (xdist workers of one run share it), and the run-queue wait of
all this process's threads tells whether the machine was loaded meanwhile.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import glob
import inspect
import itertools
import math
import numbers
import os
import random
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from .options import OVERHEAD_MAX_ROUNDS, OVERHEAD_MIN_ROUNDS, OVERHEAD_ROUNDS, UsageError, parse_options
from .report import FAILED, PASSED, CheckResult, Finding, InvariantViolation, Report

__all__ = [
    "LOCK_ENV",
    "MIN_ROUNDS",
    "LoadMeter",
    "NotMirrored",
    "ParityResult",
    "Rounds",
    "SideStats",
    "VanillaLoop",
    "Stopwatch",
    "bootstrap_interval",
    "cpu_wait",
    "frozen_heap",
    "parity",
    "timing_lock",
    "vanilla_fit",
]

#: Environment variable naming the file whose exclusive lock serialises timed sections.
LOCK_ENV = "PYTEST_TORCHPERF_TIMING_LOCK"
#: Fewest timed rounds before the interval may stop the timing.
MIN_ROUNDS = OVERHEAD_MIN_ROUNDS
CONFIDENCE = 0.95
BOOTSTRAP_RESAMPLES = 2000
#: Our runnable threads waited this fraction of their time for a CPU: the machine was busy with other work.
LOADED_WAIT_FRACTION = 0.10
#: Batches of the vanilla warm-up epoch (optimizer state, kernels, allocator): not timed.
WARMUP_BATCHES = 3

#: Modules whose classes are the framework's, not the user's (for "is this hook overridden").
_FRAMEWORK_MODULES = ("pytorch_lightning", "lightning", "torch")


class NotMirrored(Exception):
    """The vanilla loop cannot do what this module or configuration asks for (the message says what)."""


# ----------------------------------------------------------------------------- statistics


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
        return f"{self.name}: median {_seconds(self.median)} per epoch, spread (IQR) {self.spread:.1%}, {len(self.times)} epochs"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "median_s": self.median,
            "spread": self.spread,
            "times_s": list(self.times),
            "cpu_wait_s": list(self.waits) or None,
        }


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
            f"{_pct(self.overhead)} over {self.baseline.name} "
            f"(95% CI {_pct(lo)}..{_pct(hi)}, {self.rounds} rounds)"
        )
        if self.max_overhead is not None:
            text += f" {'>' if self.exceeded else '<='} {self.max_overhead:.0%}"
        return text

    def facts(self) -> list[str]:
        """The lines a report shows under the verdict."""
        lo, hi = self.interval
        lines = [self.candidate.describe(), self.baseline.describe()]
        over = f"overhead {_pct(self.overhead)} (median of {self.rounds} paired rounds), 95% interval {_pct(lo)}..{_pct(hi)}"
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
            setting.append(f"timing lock {self.lock} (waited {_seconds(self.lock_wait_s)})")
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
                f"{self.candidate.name} took {_seconds(self.candidate.median)} per epoch vs "
                f"{_seconds(self.baseline.median)} for {self.baseline.name}: {_pct(self.overhead)}"
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


def _pct(x: float) -> str:
    return f"{x:+.1%}"


def _seconds(s: float) -> str:
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

    def result(self, names: tuple[str, str], warmup_rounds: int, **context: Any) -> ParityResult:
        measured = len(self.candidate_waits) == len(self.candidate)
        return ParityResult(
            candidate=SideStats(names[0], list(self.candidate), list(self.candidate_waits) if measured else []),
            baseline=SideStats(names[1], list(self.baseline), list(self.baseline_waits) if measured else []),
            ratios=self.ratios,
            max_overhead=self.max_overhead,
            warmup_rounds=warmup_rounds,
            stop_reason=self.stop_reason,
            **context,
        )


# ----------------------------------------------------------------------------- the machine


def _schedstat() -> dict[str, tuple[int, int]]:
    """Per thread of this process: (ns on a CPU, ns runnable but waiting for one). Empty where Linux does not say."""
    out: dict[str, tuple[int, int]] = {}
    for path in glob.glob("/proc/self/task/*/schedstat"):
        try:
            with open(path) as f:
                fields = f.read().split()
            out[path] = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _loadavg() -> Optional[float]:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


class LoadMeter:
    """How much other work got in the way while timing.

    On Linux: the fraction of the time this process's runnable threads spent
    waiting for a CPU (``/proc/self/task/*/schedstat``); elsewhere the 1-minute
    load average against the CPU count.
    """

    def __init__(self) -> None:
        self._start: dict[str, tuple[int, int]] = {}
        self._load_start: Optional[float] = None
        self.figures: dict[str, Any] = {}

    def __enter__(self) -> "LoadMeter":
        self._start = _schedstat()
        self._load_start = _loadavg()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.figures = self._measure()

    def _measure(self) -> dict[str, Any]:
        end = _schedstat()
        cpu = wait = 0
        for task, (c, w) in end.items():
            c0, w0 = self._start.get(task, (0, 0))
            cpu += max(c - c0, 0)
            wait += max(w - w0, 0)
        cpus = os.cpu_count() or 1
        load_end = _loadavg()
        figures: dict[str, Any] = {
            "cpus": cpus,
            "loadavg_1m": [self._load_start, load_end],
            "cpu_wait_fraction": None,
        }
        if end:
            fraction = wait / (cpu + wait) if cpu + wait > 0 else 0.0
            figures["cpu_wait_fraction"] = fraction
            figures["loaded"] = fraction >= LOADED_WAIT_FRACTION
            figures["text"] = f"threads waited for a CPU {fraction:.1%} of their runnable time"
        elif load_end is not None:  # no per-thread scheduler figures (not Linux): the load average, ours included
            figures["loaded"] = load_end >= cpus
            figures["text"] = f"load average {load_end:.2f} on {cpus} CPUs"
        else:
            figures["loaded"] = False
        if figures.get("loaded"):
            figures["text"] = "machine visibly loaded during timing: " + figures["text"] + ", so the figures are noisier"
        return figures


_lock_depth = threading.local()


@dataclass
class LockInfo:
    path: Optional[str]
    waited_s: float = 0.0


@contextlib.contextmanager
def timing_lock() -> Iterator[LockInfo]:
    """Hold the exclusive lock on the file named by ``PYTEST_TORCHPERF_TIMING_LOCK`` (no lock when unset).

    Re-entrant within a thread; without ``fcntl`` (Windows) nothing is locked.
    """
    path = os.environ.get(LOCK_ENV)
    depth = getattr(_lock_depth, "n", 0)
    if not path or depth:
        _lock_depth.n = depth + 1
        try:
            yield LockInfo(path if depth else None)
        finally:
            _lock_depth.n = depth
        return
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield LockInfo(None)
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        started = time.perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        info = LockInfo(path, time.perf_counter() - started)
        _lock_depth.n = 1
        try:
            yield info
        finally:
            _lock_depth.n = 0
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep the objects alive now out of the cyclic collector's reach while timing.

    A full collection of a process holding torch and Lightning takes a good
    tenth of a second; left alone it lands in whichever epoch it happens to
    hit. Frozen objects are not scanned, so collections during the timing
    only look at what the timed code itself allocates, on both sides alike.
    Undone on exit (unless the heap was frozen already).
    """
    if not hasattr(gc, "freeze") or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def cpu_wait() -> Optional[float]:
    """Seconds the calling thread has spent ready to run but waiting for a CPU (Linux); None elsewhere.

    That is time other processes (or our own other threads) held the CPU; it
    is not time spent sleeping, on I/O or waiting for the GPU.
    """
    try:
        with open("/proc/thread-self/schedstat", "rb") as f:
            return int(f.read().split()[1]) * 1e-9
    except (OSError, ValueError, IndexError):
        return None


class Stopwatch:
    """Times a section on this thread: wall seconds (CUDA synchronised) and how much of it went waiting for a CPU."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self._started = 0.0
        self._wait: Optional[float] = None

    # The clock is read outside the two waits readings: returning from the /proc read is where the
    # scheduler likes to switch threads, and a wait that falls between the readings must be one the
    # wall time holds too, or it would be taken out of time it was never part of.

    def start(self) -> None:
        synchronize(self.device)
        self._started = time.perf_counter()
        self._wait = cpu_wait()

    def stop(self) -> tuple[float, Optional[float]]:
        """``(wall seconds, seconds waiting for a CPU or None)`` since :meth:`start`."""
        synchronize(self.device)
        wait = cpu_wait()
        wall = time.perf_counter() - self._started
        if wait is None or self._wait is None:
            return wall, None
        return wall, min(max(wait - self._wait, 0.0), wall)


def torch_threads() -> Optional[int]:
    """torch's intra-op thread count, when torch is already imported."""
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def synchronize(device: Any = None) -> None:
    """Wait for queued CUDA work (on ``device``, or everywhere when CUDA is initialised); CPU: nothing to wait for."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    if device is not None:
        if getattr(device, "type", None) == "cuda":
            torch.cuda.synchronize(device)
        return
    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


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


def _check_int(value: Any, name: str, lo: int, hi: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise UsageError(f"{where}: {name} must be an integer from {lo} to {hi}, got {value!r}")
    return value


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
    _check_int(rounds, "rounds", MIN_ROUNDS, OVERHEAD_MAX_ROUNDS, where)
    _check_int(warmup, "warmup", 0, 100, where)
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
    result = controller.result(
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


# ----------------------------------------------------------------------------- the vanilla loop


def _defined_by_user(obj: Any, name: str) -> bool:
    """Whether ``type(obj).name`` comes from a class outside torch and Lightning."""
    for klass in type(obj).__mro__:
        if name in vars(klass):
            module = getattr(klass, "__module__", "") or ""
            return module.split(".")[0] not in _FRAMEWORK_MODULES
    return False


def _module_device(module: Any) -> Any:
    import torch

    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _to_device(obj: Any, device: Any, non_blocking: bool) -> Any:
    """Move every tensor of a batch to ``device`` (what Lightning's ``batch_to_device`` does)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        items = [(k, _to_device(v, device, non_blocking)) for k, v in obj.items()]
        try:
            return type(obj)(items)
        except TypeError:
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if f.init:
                object.__setattr__(out, f.name, _to_device(getattr(obj, f.name), device, non_blocking))
        return out
    to = getattr(obj, "to", None)
    if callable(to) and not isinstance(obj, (str, bytes, torch.nn.Module)):
        return to(device, non_blocking=non_blocking) if non_blocking else to(device)
    return obj


def _loss_of(output: Any) -> Any:
    import torch

    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise NotMirrored(
                f"training_step returned a dict without a 'loss' key (keys: {sorted(map(str, output))}); "
                "Lightning needs one too"
            )
        return output["loss"]
    raise NotMirrored(
        f"training_step returned {type(output).__name__}; the vanilla loop understands a loss tensor, "
        "a dict with 'loss', or None"
    )


def _single_loader(train_dataloaders: Any) -> Any:
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover
        DataLoader = ()  # type: ignore[assignment]
    if isinstance(train_dataloaders, Mapping):
        values = list(train_dataloaders.values())
    elif isinstance(train_dataloaders, (list, tuple)):
        values = list(train_dataloaders)
    else:
        values = None
    if values is not None and values and all(isinstance(v, DataLoader) for v in values):
        if len(values) == 1:
            return values[0]
        raise NotMirrored(
            f"the fit trains on {len(values)} dataloaders at once (Lightning's CombinedLoader); "
            "the vanilla loop mirrors a single training dataloader"
        )
    if train_dataloaders is None or not hasattr(train_dataloaders, "__iter__"):
        raise NotMirrored(f"train_dataloaders must be an iterable of batches, got {train_dataloaders!r}")
    return train_dataloaders


def _autocast_dtype(precision: Any) -> tuple[Optional[str], bool]:
    """``(autocast dtype name or None, use a GradScaler)`` for a Lightning precision setting."""
    p = str(precision).lower()
    if p in ("32", "32-true"):
        return None, False
    if p in ("bf16-mixed", "bf16"):
        return "bfloat16", False
    if p in ("16-mixed", "16"):
        return "float16", True
    raise NotMirrored(
        f"precision={precision!r} is not mirrored by the vanilla loop (it mirrors 32-true, 16-mixed and bf16-mixed)"
    )


@dataclass
class _Scheduler:
    scheduler: Any
    interval: str
    frequency: int


def _parse_optimizers(conf: Any) -> tuple[list[Any], list[_Scheduler], list[str]]:
    """Lightning's readings of ``configure_optimizers()``: optimizers, schedulers, notes."""
    import torch

    def is_optimizer(x: Any) -> bool:
        return isinstance(x, torch.optim.Optimizer) or all(hasattr(x, a) for a in ("step", "zero_grad", "param_groups"))

    notes: list[str] = []

    def scheduler(entry: Any) -> Optional[_Scheduler]:
        if entry is None:
            return None
        if isinstance(entry, Mapping):
            if "scheduler" not in entry:
                raise NotMirrored("an lr_scheduler dict from configure_optimizers() has no 'scheduler' key")
            sched = entry["scheduler"]
            interval = entry.get("interval", "epoch")
            frequency = entry.get("frequency", 1)
        else:
            sched, interval, frequency = entry, "epoch", 1
        if interval not in ("epoch", "step"):
            raise NotMirrored(f"lr scheduler interval {interval!r} is not 'epoch' or 'step'")
        plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)
        if plateau is not None and isinstance(sched, plateau):
            notes.append(
                "ReduceLROnPlateau is not stepped by the vanilla loop (it needs a monitored metric); "
                "its cost per epoch is negligible"
            )
            return None
        return _Scheduler(sched, interval, int(frequency))

    optimizers: list[Any]
    schedulers: list[Optional[_Scheduler]] = []
    if conf is None:
        optimizers = []
        notes.append("configure_optimizers() returned None: both loops run backward without an optimizer step")
    elif is_optimizer(conf):
        optimizers = [conf]
    elif isinstance(conf, Mapping):
        if "optimizer" not in conf:
            raise NotMirrored("configure_optimizers() returned a dict without an 'optimizer' key")
        optimizers = [conf["optimizer"]]
        schedulers.append(scheduler(conf.get("lr_scheduler")))
    elif isinstance(conf, (list, tuple)):
        items = list(conf)
        if len(items) == 2 and isinstance(items[0], (list, tuple)) and all(is_optimizer(o) for o in items[0]):
            optimizers = list(items[0])
            scheds = items[1] if isinstance(items[1], (list, tuple)) else [items[1]]
            schedulers.extend(scheduler(s) for s in scheds)
        elif items and all(isinstance(d, Mapping) for d in items):
            optimizers = [d.get("optimizer") for d in items]
            schedulers.extend(scheduler(d.get("lr_scheduler")) for d in items)
        elif all(is_optimizer(o) for o in items):
            optimizers = items
        else:
            raise NotMirrored(f"configure_optimizers() returned a {type(conf).__name__} the vanilla loop cannot read")
    else:
        raise NotMirrored(f"configure_optimizers() returned {type(conf).__name__}, which the vanilla loop cannot read")
    if len(optimizers) > 1:
        raise NotMirrored(
            f"configure_optimizers() returned {len(optimizers)} optimizers; the vanilla loop mirrors one "
            "(several optimizers need manual optimization in Lightning 2)"
        )
    return optimizers, [s for s in schedulers if s is not None], notes


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


@contextlib.contextmanager
def _attached(module: Any, trainer: Any) -> Iterator[None]:
    """``module.trainer = trainer`` for the hooks Lightning calls with the trainer attached."""
    # Not hasattr(module, "trainer"): Lightning 2's property raises RuntimeError while detached.
    if trainer is None or not (isinstance(getattr(type(module), "trainer", None), property) or "trainer" in vars(module)):
        yield
        return
    module.trainer = trainer
    try:
        yield
    finally:
        module.trainer = None


_LOG_WITHOUT_TRAINER = r"You are trying to `self\.log\(\)` but the `self\.trainer` reference is not registered"


class VanillaLoop:
    """The plain PyTorch loop a LightningModule's own methods describe, one epoch at a time.

    Per batch: the batch moved to the module's device (``non_blocking`` off
    the CPU, as Lightning does), ``training_step(batch, batch_idx)`` (under
    autocast for mixed precision), its loss (a tensor or ``output["loss"]``;
    None skips the batch), ``zero_grad`` at the first batch of each
    accumulation window, ``backward`` (scaled for 16-mixed, divided by
    ``accumulate_grad_batches``), gradient clipping, ``optimizer.step()``,
    step-interval schedulers; epoch-interval schedulers after each epoch.

    ``configure_model``/``setup("fit")`` (when the module overrides them) and
    ``configure_optimizers`` run once, with ``trainer`` attached if given (as
    Lightning calls them); ``training_step`` runs with no trainer, so
    ``self.log`` is a no-op, as it would be in a hand-written loop.
    Raises :class:`NotMirrored` for what it cannot mirror: manual
    optimization, several optimizers, several dataloaders, truncated BPTT,
    other precisions.
    """

    def __init__(
        self,
        module: Any,
        train_dataloaders: Any,
        *,
        device: Any = None,
        precision: Any = "32-true",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = "norm",
        trainer: Any = None,
    ) -> None:
        import torch

        self._torch = torch
        if not callable(getattr(module, "training_step", None)):
            raise NotMirrored(f"{type(module).__name__} has no training_step(batch, batch_idx)")
        if getattr(module, "automatic_optimization", True) is False:
            raise NotMirrored(
                "the module uses manual optimization (automatic_optimization = False): its training_step "
                "drives the optimizers through the Trainer"
            )
        if (getattr(module, "truncated_bptt_steps", 0) or 0) > 0:
            raise NotMirrored("truncated back-propagation through time (truncated_bptt_steps) is not mirrored")
        if isinstance(accumulate_grad_batches, bool) or not isinstance(accumulate_grad_batches, int) or accumulate_grad_batches < 1:
            raise NotMirrored(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}")
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise NotMirrored(f"gradient_clip_algorithm {gradient_clip_algorithm!r} is not 'norm' or 'value'")
        self.module = module
        self.loader = _single_loader(train_dataloaders)
        self.device = torch.device(device) if device is not None else _module_device(module)
        if device is not None:
            module.to(self.device)
        dtype_name, use_scaler = _autocast_dtype(precision)
        self._autocast_dtype = getattr(torch, dtype_name) if dtype_name else None
        self.accumulate = accumulate_grad_batches
        self.clip_val = float(gradient_clip_val) if gradient_clip_val else None
        self.clip_algorithm = algorithm
        self._non_blocking = self.device.type not in ("cpu", "mps")
        with _attached(module, trainer):
            if _defined_by_user(module, "configure_model"):
                module.configure_model()
            if _defined_by_user(module, "setup"):
                module.setup("fit")
            conf = module.configure_optimizers() if callable(getattr(module, "configure_optimizers", None)) else None
        optimizers, self.schedulers, self.notes = _parse_optimizers(conf)
        self.optimizer = optimizers[0] if optimizers else None
        self.scaler = None
        if use_scaler:
            amp = getattr(torch, "amp", None)
            if amp is not None and hasattr(amp, "GradScaler"):
                self.scaler = amp.GradScaler(self.device.type)
            else:  # pragma: no cover - torch < 2.3
                self.scaler = torch.cuda.amp.GradScaler()
        self._pass_batch_idx = _takes_batch_idx(module.training_step)
        self.epochs = 0
        self.steps = 0
        self.batches = 0

    def _autocast(self) -> Any:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return self._torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _optimizer_step(self, batch_idx: int) -> None:
        opt = self.optimizer
        if opt is None:
            return
        torch = self._torch
        if self.clip_val:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for group in opt.param_groups for p in group["params"]]
            if self.clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, self.clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, self.clip_val)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        self.steps += 1
        for s in self.schedulers:
            if s.interval == "step" and (batch_idx + 1) % s.frequency == 0:
                s.scheduler.step()

    def _batch(self, batch: Any, batch_idx: int) -> bool:
        """Train on one batch; True when gradients are waiting for an optimizer step."""
        batch = _to_device(batch, self.device, self._non_blocking)
        with self._autocast():
            if self._pass_batch_idx:
                output = self.module.training_step(batch, batch_idx)
            else:
                output = self.module.training_step(batch)
        loss = _loss_of(output)
        if loss is None:
            return False
        k = self.accumulate
        if batch_idx % k == 0 and self.optimizer is not None:
            self.optimizer.zero_grad()
        if k > 1:
            loss = loss / k
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if (batch_idx + 1) % k == 0:
            self._optimizer_step(batch_idx)
            return False
        return True

    def run_epoch(self, max_batches: Optional[int] = None) -> float:
        """Train one epoch (at most ``max_batches`` batches); return its seconds, CUDA synchronised."""
        torch = self._torch
        self.module.train()
        batches = self.loader if max_batches is None else itertools.islice(self.loader, max_batches)
        synchronize(self.device)
        started = time.perf_counter()
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LOG_WITHOUT_TRAINER)
            pending = False
            batch_idx = -1
            for batch_idx, batch in enumerate(batches):
                pending = self._batch(batch, batch_idx)
            if pending:  # the epoch ended inside an accumulation window: Lightning steps on the last batch
                self._optimizer_step(batch_idx)
            self.batches += batch_idx + 1
            self.epochs += 1
            for s in self.schedulers:
                if s.interval == "epoch" and self.epochs % s.frequency == 0:
                    s.scheduler.step()
        synchronize(self.device)
        return time.perf_counter() - started


def _batches_per_epoch(loader: Any, limit: Optional[float]) -> Optional[int]:
    try:
        n: Optional[int] = len(loader)
    except TypeError:
        n = None
    if limit is None:
        return n
    if isinstance(limit, int):
        return limit if n is None else min(n, limit)
    if n is None:
        raise UsageError("vanilla_fit(): a fractional limit_train_batches needs a dataloader with a length")
    return int(n * limit)


def vanilla_fit(
    module: Any,
    train_dataloaders: Any,
    max_epochs: int = 1,
    *,
    max_steps: Optional[int] = None,
    limit_train_batches: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: Optional[float] = None,
    gradient_clip_algorithm: str = "norm",
    precision: Any = "32-true",
    device: Any = None,
) -> list[float]:
    """Train ``module`` with the plain PyTorch loop its own methods describe; return each epoch's seconds.

    The loop a user would write by hand for ``Trainer(max_epochs=...).fit(module,
    train_dataloaders)``: ``configure_optimizers()`` as Lightning reads it,
    then per batch ``training_step`` -> ``zero_grad`` -> ``backward`` ->
    ``step`` (see :class:`VanillaLoop`). The keyword arguments mean what the
    ``Trainer`` arguments of the same names mean. ``module`` is trained in
    place, on its own device unless ``device`` is given. Raises
    :class:`NotMirrored` for what the loop cannot do (manual optimization,
    several optimizers, ...).
    """
    where = "vanilla_fit()"
    _check_int(max_epochs, "max_epochs", 1, 10**9, where)
    if max_steps is not None:
        _check_int(max_steps, "max_steps", 1, 10**12, where)
    if limit_train_batches is not None:
        ok = (isinstance(limit_train_batches, int) and not isinstance(limit_train_batches, bool) and limit_train_batches >= 0) or (
            isinstance(limit_train_batches, float) and 0.0 <= limit_train_batches <= 1.0
        )
        if not ok:
            raise UsageError(
                f"{where}: limit_train_batches must be a batch count (int >= 0) or a fraction (float in [0, 1]), "
                f"got {limit_train_batches!r}"
            )
    loop = VanillaLoop(
        module,
        train_dataloaders,
        device=device,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
    )
    per_epoch = _batches_per_epoch(loop.loader, limit_train_batches)
    times = []
    for _ in range(max_epochs):
        n = per_epoch
        if max_steps is not None:
            left = (max_steps - loop.steps) * loop.accumulate
            if left <= 0:
                break
            n = left if n is None else min(n, left)
        if n == 0:
            break
        times.append(loop.run_epoch(n))
    return times
