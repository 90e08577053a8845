"""Probe ``iterators``: DataLoader worker pools started, iterators dropped, persistent pools shut down.

Patches, while installed:

- ``_MultiProcessingDataLoaderIter.__init__``: a pool is started (seen even when
  a DataLoader subclass overrides ``_get_iterator``): ``on_worker_pool("pool", ...)``;
- ``DataLoader.__setattr__`` / ``__delattr__``: ``_iterator`` set to None,
  replaced or deleted, with the stack that did it: ``on_worker_pool("drop", ...)``;
- ``_MultiProcessingDataLoaderIter._shutdown_workers``: a persistent pool is shut
  down: ``on_worker_pool("shutdown", ...)``;
- ``DataLoader.__iter__``: an epoch (a pass over the loader) begins: ``on_dataloader_pass(loader)``.

Events go to the checks of every active run (not only inside steps: epochs
begin between them).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Callable

from .. import core
from ..stacks import capture
from . import Probe

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = ["DROP", "POOL", "SHUTDOWN", "IteratorsProbe"]

POOL = "pool"
DROP = "drop"
SHUTDOWN = "shutdown"


class IteratorsProbe(Probe):
    """The DataLoader iterator and worker-pool probe (see the module's docstring)."""

    name = "iterators"
    keeps_wrappers = True

    def __init__(self) -> None:
        super().__init__()
        #: A pool (iterator) -> a weak reference to its DataLoader. Weak both ways: the loader holds its
        #: persistent iterator, so a strong value would keep the pair alive here until the probe resets, and
        #: the garbage collector would then free them in one cycle, closing the workers' queues before the
        #: iterator's ``__del__`` can tell the workers to stop (each worker then waits out its 5 s join).
        self.loader_of_pool: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()

    def reset(self) -> None:
        super().reset()
        self.loader_of_pool.clear()

    def _send(self, kind: str, loader: Any, how: str = "") -> None:
        if core.handlers("on_worker_pool"):
            core.notify("on_worker_pool", kind, loader, capture(3), how)

    def install(self, patcher: Patcher) -> None:
        """Patch the DataLoader machinery for the active runs; undone by ``patcher``."""
        from torch.utils.data import dataloader as dl

        self.reset()
        patcher.callback(self.reset, deferred=True)
        probe = self
        loader_cls = dl.DataLoader
        pool_cls = dl._MultiProcessingDataLoaderIter

        def iter_(original: Callable[..., Any]) -> Callable[..., Any]:
            def __iter__(self: Any) -> Any:
                __tracebackhide__ = True
                core.notify("on_dataloader_pass", self)
                return original(self)

            return __iter__

        def pool_init(original: Callable[..., Any]) -> Callable[..., Any]:
            def __init__(self: Any, loader: Any, *args: Any, **kwargs: Any) -> None:
                __tracebackhide__ = True
                original(self, loader, *args, **kwargs)
                try:
                    if core.handlers("on_worker_pool"):
                        probe.loader_of_pool[self] = weakref.ref(loader)
                        probe._send(POOL, loader)
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)

            return __init__

        def setattr_(original: Callable[..., Any]) -> Callable[..., Any]:
            def __setattr__(self: Any, attr: str, value: Any) -> None:
                if attr == "_iterator":
                    try:
                        old = self.__dict__.get("_iterator")
                        if old is not None and value is not old:
                            probe._send(DROP, self, "set to None" if value is None else "replaced")
                    except Exception as exc:  # noqa: BLE001
                        probe.failed(exc)
                original(self, attr, value)

            return __setattr__

        own_delattr = vars(loader_cls).get("__delattr__")

        def __delattr__(self: Any, attr: str) -> None:
            if attr == "_iterator":
                try:
                    if self.__dict__.get("_iterator") is not None:
                        probe._send(DROP, self, "deleted")
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
            if own_delattr is not None:
                own_delattr(self, attr)
            else:
                super(loader_cls, self).__delattr__(attr)  # type: ignore[misc]

        def shutdown(original: Callable[..., Any]) -> Callable[..., Any]:
            def _shutdown_workers(self: Any) -> None:
                try:
                    if getattr(self, "_persistent_workers", False) and not getattr(self, "_shutdown", True):
                        ref = probe.loader_of_pool.get(self)
                        loader = ref() if ref is not None else None
                        if loader is not None:
                            probe._send(SHUTDOWN, loader)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)
                original(self)

            return _shutdown_workers

        patcher.wrap(loader_cls, "__iter__", iter_)
        patcher.wrap(loader_cls, "__setattr__", setattr_)
        patcher.setattr(loader_cls, "__delattr__", __delattr__)
        patcher.wrap(pool_cls, "__init__", pool_init)
        patcher.wrap(pool_cls, "_shutdown_workers", shutdown)
