"""Invariant ``no_oversubscription`` (opt-in): the run's processes ask for no more CPU threads than it has cores.

torch runs one intra-op thread per core by default, in every process that
does not say otherwise. A training process with ``num_workers`` DataLoader
workers beside it, or several ranks on one machine each with their own pool,
then runs more compute threads than there are cores: they preempt each other,
spin on the OpenMP barriers and thrash the caches (up to 10x slower steps in
reports).

Counted at the steps, on this machine:

- the cores the process may run on (``os.sched_getaffinity``);
- the main process: ``torch.get_num_threads()``, and who set it
  (``torch.set_num_threads`` at your line, ``OMP_NUM_THREADS`` /
  ``MKL_NUM_THREADS`` in the environment, or torch's default of one per core);
- the DataLoader workers whose pools the run started: ``num_workers`` of the
  largest pool, plus the other loaders' persistent pools; torch sets one
  thread in each worker;
- the ranks on this machine (``LOCAL_WORLD_SIZE``, or the Lightning
  Trainer's devices of a multi-process strategy), each a copy of the above.

It fails when their sum is over the cores.

Blind spots: a worker's own thread count set in ``worker_init_fn`` (another
process) is assumed to be torch's 1; threads of other libraries (numpy's BLAS,
OpenCV) in the workers are not counted, but an unset ``OMP_NUM_THREADS`` is
named as their risk; inter-op threads and idle pools are not counted.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Flag
from ..core import Check
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..text import plural

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "no_oversubscription"
_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


class OversubscriptionCheck(Check):
    """Per-run state and verdict of ``no_oversubscription``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.main = 0
        #: id(loader) -> (num_workers, persistent) of the loaders whose worker pools started.
        self.pools: dict[int, tuple[int, bool]] = {}
        self.ranks = 1
        self.ranks_from = ""
        self.set_at: Any = None
        self.set_value: Optional[int] = None
        self._threads = run.probe("threads")

    def on_step_start(self) -> None:
        if not self.main:
            import torch

            self.main = int(torch.get_num_threads())

    def on_worker_pool(self, kind: str, loader: Any, stack: Any, how: Any) -> None:
        if kind == "pool":
            workers = int(getattr(loader, "num_workers", 0) or 0)
            self.pools[id(loader)] = (workers, bool(getattr(loader, "persistent_workers", False)))

    def on_framework_call(self, call: FrameworkCall) -> None:
        trainer = call.trainer
        devices = int(getattr(trainer, "num_devices", 1) or 1)
        if devices > 1 and int(getattr(trainer, "world_size", 1) or 1) > 1:
            self.ranks, self.ranks_from = devices, f"the Trainer runs {devices} processes on this machine"

    def on_run_end(self) -> None:
        import torch

        self.main = max(self.main, int(torch.get_num_threads()))
        self.set_at, self.set_value = self._threads.set_at, self._threads.value
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        if local.isdigit() and int(local) > self.ranks:
            self.ranks, self.ranks_from = int(local), f"LOCAL_WORLD_SIZE={local}: {local} ranks on this machine"

    def _who(self) -> tuple[str, Optional[Site]]:
        if self.set_at is not None and self.set_value == self.main:
            return f"torch.set_num_threads({self.main})", Site("thread count set", self.set_at)
        for name in _ENV:
            if os.environ.get(name):
                return f"{name}={os.environ[name]} in the environment", None
        return "torch's default: one thread per core", None

    def _workers(self) -> int:
        if not self.pools:
            return 0
        largest = max(workers for workers, _ in self.pools.values())
        persistent = sum(workers for workers, keep in self.pools.values() if keep)
        return max(largest, persistent)

    def result(self) -> CheckResult:
        cores = usable_cores()
        workers = self._workers()
        per_rank = self.main + workers
        total = per_rank * self.ranks
        figures: Figures = {
            "cores": cores,
            "main_threads": self.main,
            "dataloader_workers": workers,
            "threads_per_worker": 1,
            "ranks": self.ranks,
            "threads": total,
        }
        if not self.main:
            return CheckResult(NAME, NOT_CHECKED, "no training step ran: nothing to count", 0, [], figures)
        if total <= cores:
            summary = f"{plural(total, 'CPU thread')} for {plural(cores, 'core')}"
            return CheckResult(NAME, PASSED, summary, 0, [], figures)
        who, site = self._who()
        facts = [f"cores this process may use: {cores} (os.sched_getaffinity)"]
        facts.append(f"main process: {plural(self.main, 'torch thread')} ({who})")
        if workers:
            facts.append(f"DataLoader workers: {workers} x 1 thread (torch sets one thread in each worker)")
        if self.ranks > 1:
            facts.append(f"ranks: {self.ranks_from}, each with the threads above")
        if workers and not any(os.environ.get(n) for n in _ENV):
            facts.append("OMP_NUM_THREADS is not set: numpy/OpenCV in each worker may start one thread per core too")
        budget = max(cores // max(self.ranks, 1) - workers, 1)
        hint = (
            f"give the compute threads the cores the workers leave: torch.set_num_threads({budget}) in the training "
            f"process (or OMP_NUM_THREADS={budget}), fewer DataLoader workers, or fewer ranks per machine"
        )
        title = f"{plural(total, 'CPU thread')} for {plural(cores, 'core')}"
        finding = Finding(title, facts, [site] if site is not None else [], hint)
        return CheckResult(NAME, FAILED, title, 1, [finding], figures)


class Figures(TypedDict, total=False):
    """The figures of a no_oversubscription verdict (see :mod:`pytest_torchperf.figures`)."""

    cores: int
    main_threads: int
    dataloader_workers: int
    threads_per_worker: int
    ranks: int
    threads: int


INVARIANT = Invariant(
    name=NAME,
    doc="the main process, its DataLoader workers and the ranks on this machine ask for no more CPU threads "
    "than the cores they may use",
    check=OversubscriptionCheck,
    figures=Figures,
    kind=Flag(),
    default=False,
    probes=("threads", "iterators"),
)
