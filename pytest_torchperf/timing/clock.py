"""The clocks of a timed comparison and the machine around them.

:class:`Stopwatch` times a section on this thread (CUDA synchronised), less
the time the thread waited for a CPU (Linux run-queue delay,
``/proc/thread-self/schedstat``); :class:`LoadMeter` says how much other work
got in the way; :func:`timing_lock` keeps timed sections of xdist workers
apart; :func:`frozen_heap` keeps the cyclic collector out of the timing.
Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

#: Environment variable naming the file whose exclusive lock serialises timed sections.
LOCK_ENV = "PYTEST_TORCHPERF_TIMING_LOCK"
#: Our runnable threads waited this fraction of their time for a CPU: the machine was busy with other work.
LOADED_WAIT_FRACTION = 0.10



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
