"""What the DataLoader checks share: the loaders a run iterated, where each was made, which ones fed training.

``min_workers`` and ``pin_memory`` judge the *training* DataLoaders, and
``no_recompiles`` needs to know when a plain loop's first epoch ends. A check
that needs any of that asks for its run's :class:`LoaderLog`
(``run.probe("loaders").log_for(run)``); the probe fills the log of every active run that
has one:

- ``DataLoader.__init__``: the stack that built a loader, kept while a run is
  active (a loader built before the run has no creation site; its first
  ``iter()`` is shown instead);
- ``DataLoader.__iter__``: a pass (an epoch) begins, labelled with the
  Lightning stage that runs it (``epoch 1 (train)``, ``sanity check``) when a
  Trainer call is running;
- ``_BaseDataLoaderIter.__init__`` / ``__next__``: which loader an iterator
  belongs to, and each batch it yields.

A loader *feeds training* when Lightning iterates it in the training stage of
a fit, or, in a plain loop, when a training step starts between two batches of
one pass (``for x, y in loader: with run.step(): ...``); a validation loop run
between epochs never does. Per batch the probe costs a dict lookup and a
comparison per active run.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core, frameworks
from ..core import FLAGS
from ..patching import wraps
from ..stacks import Stack, capture
from . import Probe, finished_runs, record_creation

if TYPE_CHECKING:
    from ..core import Run
    from ..patching import Patcher

__all__ = ["LoaderRecord", "LoaderLog", "LoadersProbe"]

#: Pass labels kept per loader (the rest are counted).
_MAX_LABELS = 8


class LoaderRecord:
    """What one run saw of one DataLoader."""

    def __init__(self, loader: Any, created: Optional[Stack] = None) -> None:
        self.ref = weakref.ref(loader)
        self.loader_type = type(loader).__name__
        self.dataset_type = type(getattr(loader, "dataset", None)).__name__
        self.batch_size = getattr(loader, "batch_size", None)
        self.num_workers = 0
        self.pin_memory = False
        #: The stack that built the loader (the probe's :attr:`LoadersProbe.created`), if a run was active then.
        self.created: Optional[Stack] = created
        self.first_iterated: Optional[Stack] = None
        self.passes = 0
        self.labels: list[str] = []
        #: Iterated by Lightning in the training stage of a fit.
        self.lightning_training = False
        #: A training step started between two batches of one pass.
        self.feeds_steps = False
        #: Device type of the first batch's first tensor when it was not on the CPU ("cuda"...).
        self.batch_device: Optional[str] = None
        #: With ``LoaderLog.contents``: each batch's tensor shapes -> (batches with them, the pass and the batch
        #: number of the first), in the order first seen.
        self.shapes: dict[tuple[Any, ...], tuple[int, int, int]] = {}
        self._in_pass = 0
        self._steps_at_batch: Optional[int] = None

    @property
    def training(self) -> bool:
        return self.lightning_training or self.feeds_steps

    @property
    def site(self) -> Optional[Stack]:
        """Where it was built, else where it was first iterated."""
        return self.created if self.created is not None else self.first_iterated

    def refresh(self, loader: Any) -> None:
        """Read the attributes a check judges (``num_workers`` and ``pin_memory`` can change after ``__init__``)."""
        self.num_workers = int(getattr(loader, "num_workers", 0) or 0)
        self.pin_memory = bool(getattr(loader, "pin_memory", False))

    def describe(self, **fields: Any) -> str:
        """``DataLoader(dataset=RandomDataset, batch_size=8, num_workers=0)``."""
        parts = [f"dataset={self.dataset_type}", f"batch_size={self.batch_size!r}"]
        parts.extend(f"{name}={value!r}" for name, value in fields.items())
        return f"{self.loader_type}({', '.join(parts)})"

    def labels_text(self) -> str:
        more = self.passes - len(self.labels)
        return ", ".join(self.labels) + (f" and {more} more" if more > 0 else "")

    def to_dict(self) -> dict[str, Any]:
        return {
            "loader": self.describe(),
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "passes": self.passes,
            "training": self.training,
        }


class LoaderLog:
    """The DataLoaders one run iterated."""

    def __init__(self, run: Run, probe: LoadersProbe) -> None:
        # Weak: the probe's ``logs`` maps each run to its log weakly, and a log holding its run would keep
        # every run (its checks, its report) alive for the rest of the process.
        self._run = weakref.ref(run)
        self.records: dict[int, LoaderRecord] = {}
        #: Some check reads what the batches say (which loaders feed training steps, the batches' device).
        self.batches = False
        #: Some check reads what the batches hold: their shapes (:attr:`LoaderRecord.shapes`) and which loader
        #: the latest batch's tensors came from (:meth:`loader_of_tensor`). Set it with ``batches``.
        self.contents = False
        self._latest: dict[int, tuple[Any, LoaderRecord]] = {}
        #: The probe that fills the log (the stacks that built the loaders are its).
        self._created = probe.created

    def record(self, loader: Any) -> LoaderRecord:
        rec = self.records.get(id(loader))
        if rec is None or rec.ref() is not loader:
            rec = self.records[id(loader)] = LoaderRecord(loader, self._created.get(loader))
            rec.refresh(loader)
        return rec

    def training_loaders(self) -> list[LoaderRecord]:
        return [r for r in self.records.values() if r.training]

    @property
    def most_passes(self) -> int:
        """Passes of the loader iterated most: 2 means some loader's second epoch has begun."""
        return max((r.passes for r in self.records.values()), default=0)

    # -- events ------------------------------------------------------------------------
    def on_pass(self, loader: Any) -> None:
        rec = self.record(loader)
        rec.refresh(loader)
        rec.passes += 1
        rec._steps_at_batch = None
        rec._in_pass = 0
        if rec.first_iterated is None:
            rec.first_iterated = capture(3)
        stage = frameworks.stage()
        if stage is not None:
            label = stage.label
            if stage.training:
                rec.lightning_training = True
        else:
            label = f"pass {rec.passes}"
        if len(rec.labels) < _MAX_LABELS:
            rec.labels.append(label)

    def on_batch(self, loader: Any, batch: Any, done: bool) -> None:
        rec = self.records.get(id(loader))
        if rec is None or rec.ref() is not loader:
            rec = self.record(loader)  # an iterator started before the run began
        run = self._run()
        if run is None:  # pragma: no cover - a log outliving its run is not in ``active_logs()``
            return
        steps = run.steps
        if rec._steps_at_batch is not None and steps > rec._steps_at_batch:
            rec.feeds_steps = True
        if done:
            rec._steps_at_batch = None
            return
        if self.contents:
            tensors = _tensors_in(batch)
            self._latest = {id(t): (weakref.ref(t), rec) for t in tensors}
            shape = tuple(tuple(t.shape) for t in tensors)
            rec._in_pass += 1
            seen = rec.shapes.get(shape)
            rec.shapes[shape] = (seen[0] + 1, seen[1], seen[2]) if seen else (1, rec.passes, rec._in_pass)
        if rec._steps_at_batch is None and rec.batch_device is None:
            rec.batch_device = _device_type(batch)
        rec._steps_at_batch = steps


    def loader_of_tensor(self, tensor: Any) -> Optional[LoaderRecord]:
        """The loader whose latest batch holds ``tensor`` (with :attr:`contents`), None if none."""
        entry = self._latest.get(id(tensor))
        return entry[1] if entry is not None and entry[0]() is tensor else None


def _tensors_in(batch: Any, depth: int = 0) -> list[Any]:
    """The tensors of a batch (a tensor, or lists, tuples and dicts of them, three levels deep at most)."""
    if hasattr(batch, "shape") and hasattr(batch, "device"):
        return [batch]
    if depth < 3:
        if isinstance(batch, Mapping):
            batch = list(batch.values())
        if isinstance(batch, (list, tuple)):
            return [t for item in batch[:16] for t in _tensors_in(item, depth + 1)]
    return []


def _device_type(batch: Any, depth: int = 0) -> Optional[str]:
    """The device type of the batch's first tensor when it is not the CPU, else None."""
    device = getattr(batch, "device", None)
    if device is not None:
        kind = getattr(device, "type", None)
        return kind if kind not in (None, "cpu") else None
    if depth < 3:
        if isinstance(batch, dict):
            batch = list(batch.values())
        if isinstance(batch, (list, tuple)):
            for item in batch[:4]:
                kind = _device_type(item, depth + 1)
                if kind is not None:
                    return kind
    return None


class LoadersProbe(Probe):
    """DataLoader construction, passes and batches, for the runs that keep a :class:`LoaderLog`."""

    name = "loaders"
    keeps_wrappers = True

    def __init__(self) -> None:
        super().__init__()
        #: Loader -> the stack that built it (only loaders built while a run was active).
        self.created: weakref.WeakKeyDictionary[Any, Stack] = weakref.WeakKeyDictionary()
        #: Loader -> the framework that built it from the user's line (the Hugging Face Trainer builds its own).
        self.built_by: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
        #: Iterator -> the loader it iterates.
        self.loader_of: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
        #: Run -> its log, for the runs whose checks asked for one.
        self.logs: weakref.WeakKeyDictionary[Run, LoaderLog] = weakref.WeakKeyDictionary()
        #: Some log reads the batches (see :meth:`log_for`).
        self.batching = False

    def reset(self) -> None:
        super().reset()
        self.created.clear()
        self.built_by.clear()
        self.loader_of.clear()
        for run in finished_runs(self.logs):  # a finished run's log would keep ``batching`` on, too
            del self.logs[run]
        self.batching = any(log.batches for log in self.logs.values())

    def log_for(self, run: Run, batches: bool = False) -> LoaderLog:
        """The run's log, created on first request (checks ask in their ``__init__``).

        ``batches``: the check reads what each batch says (the loaders feeding training steps); only
        then does every batch pay for a look at the log.
        """
        log = self.logs.get(run)
        if log is None:
            log = self.logs[run] = LoaderLog(run, self)
        if batches:
            log.batches = self.batching = True
        return log

    def active_logs(self) -> list[LoaderLog]:
        if not self.logs:
            return []
        out = []
        for run in core.active_runs():
            log = self.logs.get(run)
            if log is not None and run.active:
                out.append(log)
        return out

    def install(self, patcher: Patcher) -> None:
        """Patch the DataLoader machinery for the active runs' logs; undone by ``patcher``."""
        from torch.utils.data import dataloader as dl

        self.reset()
        patcher.callback(self.reset, deferred=True)
        flags = FLAGS
        probe = self

        def wrap_iter(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __iter__(self: Any) -> Any:
                __tracebackhide__ = True
                try:
                    for log in probe.active_logs():
                        log.on_pass(self)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                return original(self)

            return __iter__

        def wrap_iterator_init(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
                __tracebackhide__ = True
                original(self, loader, *args, **kwargs)
                if flags.active:
                    try:
                        probe.loader_of[self] = loader
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)

            return __init__

        def wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
            @wraps(original)
            def __next__(self: Any) -> Any:
                __tracebackhide__ = True
                if not (flags.active and probe.batching):
                    return original(self)
                try:
                    batch = original(self)
                except StopIteration:
                    probe._batch(self, None, done=True)
                    raise
                probe._batch(self, batch, done=False)
                return batch

            return __next__

        patcher.wrap(
            dl.DataLoader,
            "__init__",
            record_creation(self, self.created, lambda: flags.active and bool(probe.logs), self.built_by),
        )
        patcher.wrap(dl.DataLoader, "__iter__", wrap_iter)
        patcher.wrap(dl._BaseDataLoaderIter, "__init__", wrap_iterator_init)
        patcher.wrap(dl._BaseDataLoaderIter, "__next__", wrap_next)

    def _batch(self, iterator: Any, batch: Any, done: bool) -> None:
        try:
            loader = self.loader_of.get(iterator)
            if loader is not None:
                for log in self.active_logs():
                    if log.batches:
                        log.on_batch(loader, batch, done=done)
        except Exception as exc:  # noqa: BLE001
            self.failed(exc)
