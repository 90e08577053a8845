"""The clocks of a timed comparison and the machine around them.

:class:`Stopwatch` times a section on this thread in a unit load cannot
inflate where the platform allows (:func:`clock_unit`): CUDA events on a GPU,
wall time less the thread's run-queue delay on a Linux CPU
(``/proc/thread-self/schedstat``), wall time elsewhere.
:func:`timing_threads` says how many torch threads to time a CPU fit with;
:class:`LoadMeter` says how much other work got in the way;
:func:`timing_lock` keeps timed sections of xdist workers apart;
:func:`frozen_heap` keeps the cyclic collector out of the timing. Nothing
here imports torch.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..clocks import perf_counter

#: Environment variable naming the file whose exclusive lock serialises timed sections.
LOCK_ENV = "PYTEST_TORCHPERF_TIMING_LOCK"
#: Our runnable threads waited this fraction of their time for a CPU: the machine was busy with other work.
LOADED_WAIT_FRACTION = 0.10
#: ... and this fraction: the cores were shared several times over, and their caches with them.
HEAVILY_LOADED_WAIT_FRACTION = 0.50



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

    def __enter__(self) -> LoadMeter:
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
            figures["heavily_loaded"] = fraction >= HEAVILY_LOADED_WAIT_FRACTION
            figures["text"] = f"threads waited for a CPU {fraction:.1%} of their runnable time"
        elif load_end is not None:  # no per-thread scheduler figures (not Linux): the load average, ours included
            figures["loaded"] = load_end >= cpus
            figures["text"] = f"load average {load_end:.2f} on {cpus} CPUs"
        else:
            figures["loaded"] = False
        if figures.get("heavily_loaded"):
            # Measured: a tiny module's overhead read +80-85% with waits under 20%, +95-134% with waits of 54-77%.
            figures["text"] = (
                "machine heavily loaded during timing: " + figures["text"] + "; the waits are taken out, but a "
                "core shared this much also shares its caches, which slows Python-heavy work (Lightning's) more "
                "than tensor work, so the overhead may read high"
            )
        elif figures.get("loaded"):
            figures["text"] = (
                "machine visibly loaded during timing: " + figures["text"] + ", so the figures are noisier"
            )
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
        started = perf_counter()
        fcntl.flock(fd, fcntl.LOCK_EX)
        info = LockInfo(path, perf_counter() - started)
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


#: Units a :class:`Stopwatch` measures in (see :func:`clock_unit`).
THREAD_TIME = "thread time"
WALL_TIME = "wall time"
CUDA_EVENT_TIME = "CUDA event time"
#: ``parity()`` callables that return the epoch times they measured themselves.
RETURNED_TIME = "returned time"
UNIT_TEXT = {
    THREAD_TIME: "wall time of the timing thread less the time it waited for a CPU (Linux run-queue delay)",
    WALL_TIME: "wall time (this platform has no per-thread scheduler figures, so other work on the machine counts)",
    CUDA_EVENT_TIME: "GPU time between CUDA events on the current stream (the queue drained before each epoch)",
    RETURNED_TIME: "the epoch times the callables returned",
}


def _cuda_device(device: Any) -> Any:
    """The CUDA device to time on: ``device`` if it is one; with no device, the current one once CUDA is in use."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    if device is not None:
        return device if getattr(device, "type", None) == "cuda" else None
    try:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - a broken driver: time on the host
        return None


def clock_unit(device: Any = None) -> str:
    """The unit a :class:`Stopwatch` on ``device`` measures in.

    CUDA events on a GPU: the GPU's own clock between two points of its queue,
    which keeps the host's scheduling out of a GPU-bound epoch. On a CPU under
    Linux, the thread's wall time less its run-queue delay: unlike its CPU
    time, that keeps the time the thread blocks (on I/O, a lock, DataLoader
    workers), and other processes cannot inflate it. Elsewhere, wall time.
    """
    if _cuda_device(device) is not None:
        return CUDA_EVENT_TIME
    return THREAD_TIME if cpu_wait() is not None else WALL_TIME


class Stopwatch:
    """Times a section on this thread, in :attr:`unit` (see :func:`clock_unit`), CUDA synchronised.

    :meth:`stop` returns ``(seconds, seconds waiting for a CPU)``: in thread
    time the seconds are wall seconds and the wait is what to take out of them;
    in the other units the wait is None. :meth:`lap` reads the same without
    ending the section (on a GPU it drains the queue, as :meth:`stop` does).
    """

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.unit = clock_unit(device)
        self._cuda = _cuda_device(device) if self.unit == CUDA_EVENT_TIME else None
        self._started = 0.0
        self._wait: Optional[float] = None
        self._events: Any = None

    # The clock is read outside the two waits readings: returning from the /proc read is where the
    # scheduler likes to switch threads, and a wait that falls between the readings must be one the
    # wall time holds too, or it would be taken out of time it was never part of.

    def start(self) -> None:
        synchronize(self.device if self._cuda is None else self._cuda)
        if self._cuda is not None:
            torch = sys.modules["torch"]
            self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            self._events[0].record(torch.cuda.current_stream(self._cuda))
        self._started = perf_counter()
        self._wait = cpu_wait() if self.unit == THREAD_TIME else None

    def lap(self) -> tuple[float, Optional[float]]:
        """``(seconds, seconds waiting for a CPU or None)`` since :meth:`start`; the watch runs on."""
        if self._cuda is not None:
            torch = sys.modules["torch"]
            begin, end = self._events
            end.record(torch.cuda.current_stream(self._cuda))
            synchronize(self._cuda)
            return begin.elapsed_time(end) * 1e-3, None
        synchronize(self.device)
        wait = cpu_wait() if self.unit == THREAD_TIME else None
        wall = perf_counter() - self._started
        if wait is None or self._wait is None:
            return wall, None
        return wall, min(max(wait - self._wait, 0.0), wall)

    def stop(self) -> tuple[float, Optional[float]]:
        """The section's reading (:meth:`lap`: nothing needs stopping)."""
        return self.lap()


Reading = tuple[float, Optional[float]]


def whole_epoch(window: Reading, first: Reading, last: Reading, apart: int, left: int) -> Reading:
    """A whole epoch's ``(seconds, wait)`` from an epoch cut short: the ``window`` it ran in (its start and its end,
    so each per-epoch cost is in it once) plus the ``left`` batches it did not train at the per-batch rate between
    the readings ``first`` and ``last``, taken at the starts of two batches ``apart`` batches apart. The wait (where
    measured) is extrapolated alike, so that seconds less wait stays what the unit measures."""
    seconds = window[0] + (last[0] - first[0]) * left / apart
    waits = (window[1], first[1], last[1])
    if waits[0] is None or waits[1] is None or waits[2] is None:
        return seconds, None
    return seconds, waits[0] + (waits[2] - waits[1]) * left / apart


class EpochWatch:
    """Times an epoch; one cut short, ``left`` batches before its end, as the whole epoch it stands for.

    A :class:`Stopwatch` over the epoch as it ran, read at the start of its first batch and of the batch ``apart``
    batches later (:meth:`batch_start`, called with each batch's index as it begins); :meth:`stop` gives
    :func:`whole_epoch`. With ``left=0`` it is the epoch's own time.
    """

    def __init__(self, device: Any, left: int = 0, apart: int = 1) -> None:
        self.watch = Stopwatch(device)
        self.unit = self.watch.unit
        self.left = left
        self.apart = apart
        self._at = (0, apart) if left else ()
        self._readings: list[Reading] = []

    def start(self) -> None:
        self._readings.clear()
        self.watch.start()

    def batch_start(self, index: int) -> None:
        if index in self._at:
            self._readings.append(self.watch.lap())

    def stop(self) -> Reading:
        window = self.watch.stop()
        if not self.left:
            return window
        if len(self._readings) != 2:
            raise RuntimeError(f"an epoch cut short for timing was read at {len(self._readings)} of batches {self._at}")
        first, last = self._readings
        return whole_epoch(window, first, last, self.apart, self.left)


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


#: torch intra-op threads while the ``max_overhead`` replay times a fit on a CPU.
CPU_TIMING_THREADS = 1


def timing_threads(device: Any) -> Optional[int]:
    """The torch thread count to time a fit on ``device`` with.

    :data:`CPU_TIMING_THREADS` on a CPU, else None (leave it).

    With several intra-op threads, every parallel region ends at a barrier
    where the threads spin for each other; when another process holds a core,
    the thread that waited for it holds up the others, which spin on. Measured
    on 2 cores beside a bursty CPU hog with torch's default 2 threads: a 31 ms
    Lightning epoch took 1.3 s of wall time and 0.55 s of the training
    thread's CPU time, and no clock of this process takes that out. With one
    thread the epoch's time less its run-queue wait is what it is on a quiet
    machine. It also makes the figure the same on any core count.
    """
    return CPU_TIMING_THREADS if getattr(device, "type", "cpu") == "cpu" else None


@contextlib.contextmanager
def torch_threads_pinned() -> Iterator[Callable[[int], None]]:
    """Yields ``pin(n)``, which sets torch's intra-op thread count to ``n``; the count is restored on exit."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None

    def pin(n: int) -> None:
        if torch is not None and torch.get_num_threads() != n:
            torch.set_num_threads(n)

    try:
        yield pin
    finally:
        if torch is not None and before is not None and torch.get_num_threads() != before:
            torch.set_num_threads(before)
