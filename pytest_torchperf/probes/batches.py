"""Probe ``batches``: how long the training process waits for a DataLoader's batches, and for each pass's first.

Patches, while installed:

- ``DataLoader.__iter__``: a pass begins; its clock starts before the loader
  makes its iterator, so a worker pool started for the pass is inside the
  time to its first batch (:class:`Pass`);
- ``_MultiProcessingDataLoaderIter.__init__``: counted, so a pass knows whether
  it started a pool or reused one;
- ``_BaseDataLoaderIter.__next__``: a batch is handed to the training process;
  the time inside the call is the time the process waited for it (the
  workers' hand-off, or the loading and collating itself with ``num_workers=0``);
- ``_MapDatasetFetcher.fetch`` / ``_IterableDatasetFetcher.fetch``: with
  ``num_workers=0``, the time in the dataset (``__getitem__``, ``__getitems__``
  or its iterator) and in ``collate_fn``; in a worker process forked while a
  run times every batch, the worker's time per batch, added to memory shared
  with the training process (workers started with ``spawn`` or ``forkserver``
  run unpatched: their time is not seen, and the checks say so).

Two modes. A run that only needs each pass's first batch (``no_iterator_reset``)
times one ``__next__`` per pass: after it the iterator leaves the table and a
batch costs one falsy-dict test. A run that asked for every batch
(:meth:`BatchesProbe.every_batch_for`, ``max_data_wait``) keeps its passes in
the table: two clock reads and a dict look-up per batch.

The clock is bound at import (:mod:`pytest_torchperf.clocks`): a test that
mocks the time module's ``perf_counter`` does not change what is measured.
"""

from __future__ import annotations

import mmap
import weakref
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import frameworks
from ..clocks import perf_counter as _perf_counter
from ..core import FLAGS
from ..patching import wraps
from . import Probe, finished_runs

if TYPE_CHECKING:
    from ..core import Run
    from ..patching import Patcher

__all__ = ["BatchesProbe", "LoaderInfo", "LoaderTimes", "Pass"]

#: Worker pools whose workers' times are kept (slots reused in turn), and workers per pool.
MAX_POOLS = 1024
MAX_WORKERS = 32


class Pass:
    """One pass over a DataLoader: when it began, its first batch, and the batches after it."""

    __slots__ = (
        "number", "label", "sanity", "training", "start", "first", "last", "waits", "span", "batches",
        "new_pool", "pool", "num_workers", "data_s", "collate_s", "fetches", "every_batch", "iterator",
        "ended",
    )

    def __init__(self, number: int, start: float, num_workers: int, every_batch: bool) -> None:
        self.number = number
        self.start = start
        self.num_workers = num_workers
        self.every_batch = every_batch
        stage = frameworks.stage()
        self.label, self.sanity = (stage.label, stage.sanity) if stage is not None else (f"pass {number}", False)
        #: Iterated by a framework in the training stage of a fit (outside one: judged by the loader's log).
        self.training = stage is not None and stage.training
        #: Seconds from the start of the pass to its first batch (None: no batch yet).
        self.first: Optional[float] = None
        self.last = 0.0
        #: Seconds waited inside ``__next__`` for the batches after the first, and from batch to batch.
        self.waits = 0.0
        self.span = 0.0
        self.batches = 0
        #: This pass started a worker pool (its slot in the shared table, -1: its workers are not timed).
        self.new_pool = False
        self.pool = -1
        #: With num_workers=0: seconds in the dataset and in collate_fn, over ``fetches`` batches after the first.
        self.data_s = 0.0
        self.collate_s = 0.0
        self.fetches = 0
        self.iterator: Optional[Any] = None
        self.ended = False


class LoaderInfo:
    """What a report says of a DataLoader, read when a pass over it begins (the loader may be gone by the verdict)."""

    def __init__(self, loader: Any) -> None:
        self.key = id(loader)
        self.ref = weakref.ref(loader)
        self.refresh(loader)

    def refresh(self, loader: Any) -> None:
        dataset = getattr(loader, "dataset", None)
        self.loader_type = type(loader).__name__
        self.dataset_type = type(dataset).__name__
        self.batch_size = getattr(loader, "batch_size", None)
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.persistent = bool(getattr(loader, "persistent_workers", False))
        self.pin_memory = bool(getattr(loader, "pin_memory", False))
        self.prefetch_factor = getattr(loader, "prefetch_factor", None)
        #: The dataset's own ``__getitems__`` / ``__getitem__`` (a class attribute: a function with a location).
        kind = type(dataset)
        self.getitem = getattr(kind, "__getitems__", None) or getattr(kind, "__getitem__", None)
        from torch.utils.data import IterableDataset

        self.iterable = isinstance(dataset, IterableDataset)
        if self.iterable:
            self.getitem = getattr(kind, "__iter__", None)
        self.collate = getattr(loader, "collate_fn", None)
        context = getattr(loader, "multiprocessing_context", None)
        if context is None and self.num_workers > 0:
            context = _default_start_method()
        self.start_method = getattr(context, "_name", context) if context is not None else None


def _default_start_method() -> Optional[str]:
    """The start method workers get by default, read without fixing it (``get_start_method()`` would)."""
    import multiprocessing

    try:
        method = multiprocessing.get_start_method(allow_none=True)
        if method is None:
            default = getattr(getattr(multiprocessing, "context", None), "_default_context", None)
            method = getattr(getattr(default, "_default_context", None), "_name", None)
        return method
    except Exception:  # noqa: BLE001 - only words in a report
        return None


class LoaderTimes:
    """The passes over one DataLoader since the probe was installed."""

    __slots__ = ("info", "passes", "last_iterator", "pool", "__weakref__")

    def __init__(self, loader: Any) -> None:
        self.info = LoaderInfo(loader)
        self.passes: list[Pass] = []
        self.last_iterator: Optional[Any] = None
        #: The slot of the pool its current iterator runs (-1: none, or not timed).
        self.pool = -1

    def since(self, start: float) -> list[Pass]:
        return [p for p in self.passes if p.start >= start]


class BatchesProbe(Probe):
    """The DataLoader timing probe (see the module's docstring)."""

    name = "batches"
    keeps_wrappers = True

    def __init__(self) -> None:
        super().__init__()
        self.loaders: weakref.WeakKeyDictionary[Any, LoaderTimes] = weakref.WeakKeyDictionary()
        #: id(iterator) -> the pass whose batches are being timed.
        self.timed: dict[int, Pass] = {}
        #: The runs that time every batch (not only each pass's first).
        self.every_batch: weakref.WeakSet[Run] = weakref.WeakSet()
        #: Run -> the passes begun while it was active, with their loaders (see :meth:`passes_for`).
        self.listeners: weakref.WeakKeyDictionary[Run, list[tuple[LoaderInfo, Pass]]] = weakref.WeakKeyDictionary()
        #: The pass whose single-process ``__next__`` is running (its fetch is timed).
        self.fetching: Optional[Pass] = None
        #: The slot of the pool being started; in a worker process, the slot of its own pool.
        self.forking = -1
        self._next_slot = 0
        #: Worker pools started (``_MultiProcessingDataLoaderIter.__init__`` calls) since the probe was installed.
        self.pools_started = 0
        #: The workers' table: (seconds, batches) per worker of each pool slot, as doubles.
        self._shared: Any = None
        self._mmap: Optional[mmap.mmap] = None

    def reset(self) -> None:
        super().reset()
        self.loaders = weakref.WeakKeyDictionary()
        self.timed.clear()
        self.fetching = None
        self.forking = -1
        for run in finished_runs(self.listeners):
            del self.listeners[run]
        for run in finished_runs(self.every_batch):
            self.every_batch.discard(run)

    # -- what checks read -----------------------------------------------------------------
    def every_batch_for(self, run: Run) -> list[tuple[LoaderInfo, Pass]]:
        """Time every batch while ``run`` is active; returns the list the passes it sees are added to
        (checks ask in their ``__init__``)."""
        self.every_batch.add(run)
        return self.listeners.setdefault(run, [])

    def passes_of(self, loader: Any, since: float = 0.0) -> list[Pass]:
        times = self.loaders.get(loader)
        return times.since(since) if times is not None else []

    def latest_pass(self, loader: Any) -> Optional[Pass]:
        """The pass over ``loader`` begun last (inside ``iter(loader)``: the pass being started)."""
        times = self.loaders.get(loader)
        return times.passes[-1] if times is not None and times.passes else None

    def worker_times(self, pool: int, num_workers: int) -> tuple[float, int]:
        """``(seconds, batches)`` the workers of pool slot ``pool`` spent fetching, summed over its workers."""
        shared = self._shared
        if pool < 0 or shared is None:
            return 0.0, 0
        base = pool * MAX_WORKERS * 2
        total, count = 0.0, 0.0
        for worker in range(min(num_workers, MAX_WORKERS)):
            total += shared[base + 2 * worker]
            count += shared[base + 2 * worker + 1]
        return total, int(count)

    @staticmethod
    def clock() -> float:
        return _perf_counter()

    # -- bookkeeping ------------------------------------------------------------------------
    def _wants_every_batch(self) -> bool:
        return any(run.active for run in self.every_batch)

    def _shared_table(self) -> Any:
        if self._shared is None:
            self._mmap = mmap.mmap(-1, MAX_POOLS * MAX_WORKERS * 2 * 8)  # anonymous, shared with forked workers
            self._shared = memoryview(self._mmap).cast("d")
        return self._shared

    def _begin(self, loader: Any, start: float) -> tuple[Pass, int, int]:
        times = self.loaders.get(loader)
        if times is None:
            times = self.loaders[loader] = LoaderTimes(loader)
        else:
            times.info.refresh(loader)
        workers = times.info.num_workers
        full = self._wants_every_batch()
        p = Pass(len(times.passes) + 1, start, workers, full)
        times.passes.append(p)
        for run, seen in self.listeners.items():
            if run.active:
                seen.append((times.info, p))
        slot = -1
        if full and workers > 0:
            shared = self._shared_table()
            slot = self._next_slot % MAX_POOLS
            base = slot * MAX_WORKERS * 2
            for i in range(base, base + MAX_WORKERS * 2):
                shared[i] = 0.0
        return p, slot, self.pools_started

    def _began(self, loader: Any, iterator: Any, p: Pass, slot: int, pools: int, base_iter: type) -> None:
        times = self.loaders.get(loader)
        if times is None or not isinstance(iterator, base_iter):
            return
        previous = times.last_iterator() if times.last_iterator is not None else None
        if self.pools_started != pools:  # a pool was started inside this iter(loader)
            p.new_pool = True
            if slot >= 0:
                self._next_slot += 1
            times.pool = slot
        elif iterator is not previous:  # a pool started before the run (or not by iter()): its workers are not timed
            times.pool = -1
        p.pool = times.pool
        times.last_iterator = weakref.ref(iterator)
        p.iterator = weakref.ref(iterator)
        self.timed[id(iterator)] = p

    # -- install ----------------------------------------------------------------------------
    def install(self, patcher: Patcher) -> None:
        """Patch the DataLoader machinery for the active runs; undone by ``patcher``."""
        from torch.utils.data import dataloader as dl
        from torch.utils.data._utils import fetch as fetch_mod
        from torch.utils.data._utils import worker as worker_mod

        self.reset()
        patcher.callback(self.reset, deferred=True)
        probe = self
        flags = FLAGS
        timed = self.timed
        clock = _perf_counter
        base_iter = dl._BaseDataLoaderIter
        single = dl._SingleProcessDataLoaderIter

        def wrap_iter(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __iter__(self: Any) -> Any:
                __tracebackhide__ = True
                if not flags.active:
                    return original(self)
                start = clock()
                p, slot, pools = None, -1, 0
                try:
                    p, slot, pools = probe._begin(self, start)
                    probe.forking = slot
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)
                try:
                    iterator = original(self)
                finally:
                    probe.forking = -1
                if p is not None:
                    try:
                        probe._began(self, iterator, p, slot, pools, base_iter)
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                return iterator

            return __iter__

        def wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __next__(self: Any) -> Any:
                __tracebackhide__ = True
                if not timed:
                    return original(self)
                p = timed.get(id(self))
                if p is None or p.iterator is None or p.iterator() is not self:
                    return original(self)
                t0 = clock()
                if p.first is not None and type(self) is single:
                    probe.fetching = p
                try:
                    batch = original(self)
                except StopIteration:
                    probe.fetching = None
                    p.ended = True
                    timed.pop(id(self), None)
                    raise
                except BaseException:
                    probe.fetching = None
                    raise
                t1 = clock()
                probe.fetching = None
                if p.first is None:
                    p.first = t1 - p.start
                    if not p.every_batch:
                        timed.pop(id(self), None)
                else:
                    p.waits += t1 - t0
                    p.span += t1 - p.last
                    p.batches += 1
                p.last = t1
                return batch

            return __next__

        def wrap_pool_init(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
                __tracebackhide__ = True
                probe.pools_started += 1
                original(self, *args, **kwargs)

            return __init__

        def wrap_fetch(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def fetch(self: Any, possibly_batched_index: Any) -> Any:
                __tracebackhide__ = True
                p = probe.fetching
                if p is not None:
                    probe.fetching = None  # a loader iterated inside the dataset is not this batch's time
                    return _timed_fetch(original, self, possibly_batched_index, p)
                if probe.forking >= 0 and worker_mod._worker_info is not None:
                    return _worker_fetch(original, self, possibly_batched_index)
                return original(self, possibly_batched_index)

            return fetch

        def _timed_fetch(original: Callable[..., Any], fetcher: Any, index: Any, p: Pass) -> Any:
            collate = fetcher.collate_fn
            t0 = clock()

            def timed_collate(data: Any) -> Any:
                t1 = clock()
                p.data_s += t1 - t0
                try:
                    return collate(data)
                finally:
                    p.collate_s += clock() - t1
                    p.fetches += 1

            fetcher.collate_fn = timed_collate  # torch's fetcher, for this one call
            try:
                return original(fetcher, index)
            finally:
                fetcher.collate_fn = collate

        def _worker_fetch(original: Callable[..., Any], fetcher: Any, index: Any) -> Any:
            t0 = clock()
            out = original(fetcher, index)
            elapsed = clock() - t0
            try:
                worker = worker_mod._worker_info.id  # type: ignore[union-attr]
                shared = probe._shared
                if shared is not None and 0 <= worker < MAX_WORKERS:
                    i = (probe.forking * MAX_WORKERS + worker) * 2
                    shared[i] += elapsed
                    shared[i + 1] += 1.0
            except Exception:  # noqa: BLE001 - a worker has nobody to report to; its batch is what matters
                pass
            return out

        patcher.wrap(dl.DataLoader, "__iter__", wrap_iter)
        patcher.wrap(dl._BaseDataLoaderIter, "__next__", wrap_next)
        patcher.wrap(dl._MultiProcessingDataLoaderIter, "__init__", wrap_pool_init)
        patcher.wrap(fetch_mod._MapDatasetFetcher, "fetch", wrap_fetch)
        patcher.wrap(fetch_mod._IterableDatasetFetcher, "fetch", wrap_fetch)
