"""The invariants. One module per invariant: its probe (what it patches) and its verdict.

A check is a small object created per run with ``result() -> CheckResult``;
a probe is a module-level ``install(patcher)`` that patches torch or Lightning
once while any run is active and forwards what it sees to the active runs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable, Iterable, Protocol

from ..report import CheckResult

if TYPE_CHECKING:
    from ..patching import Patcher
    from ..watch import Run

__all__ = ["Check", "make_checks", "install_probes"]


class Check(Protocol):
    name: str

    def result(self) -> CheckResult: ...


def make_checks(run: "Run") -> dict[str, Check]:
    """The check objects for ``run``, one per invariant its options enable."""
    from .iterators import IteratorResetCheck
    from .overhead import OverheadCheck
    from .placement import DevicePlacementCheck
    from .syncs import HostSyncCheck
    from .cuda_cache import EmptyCacheCheck
    from .data_parallel import DataParallelCheck
    from .grads import GradsCheck
    from .precision import PrecisionCheck
    from .recompiles import RecompileCheck
    from .workers import MinWorkersCheck, PinMemoryCheck

    factories: dict[str, Callable[[], Check]] = {
        "no_iterator_reset": lambda: IteratorResetCheck(run),
        "no_host_sync": lambda: HostSyncCheck(run),
        "on_device": lambda: DevicePlacementCheck(run),
        "max_overhead": lambda: OverheadCheck(run),
        "min_workers": lambda: MinWorkersCheck(run),
        "pin_memory": lambda: PinMemoryCheck(run),
        "no_empty_cache": lambda: EmptyCacheCheck(run),
        "no_data_parallel": lambda: DataParallelCheck(run),
        "grads_set_to_none": lambda: GradsCheck(run),
        "no_recompiles": lambda: RecompileCheck(run),
        "mixed_precision": lambda: PrecisionCheck(run),
    }
    return {name: factories[name]() for name in run.options.enabled_checks}


#: Probe modules in install order, each with the invariants that need it. A probe is
#: installed when the first active run checks one of them, and stays until the last
#: run ends; a default run therefore pays nothing for the probes of invariants it
#: does not check.
PROBES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("iterators", ("no_iterator_reset",)),
    # The registry of host-born tensors: before the step checks that read it.
    ("_tensors", ("no_host_sync", "on_device")),
    ("syncs", ("no_host_sync",)),
    ("placement", ("on_device",)),
    ("_loaders", ("min_workers", "pin_memory", "no_recompiles")),
    ("_optimizers", ("min_workers", "pin_memory", "mixed_precision", "grads_set_to_none")),
    ("cuda_cache", ("no_empty_cache",)),
    ("data_parallel", ("no_data_parallel",)),
    ("grads", ("grads_set_to_none",)),
    ("precision", ("mixed_precision",)),
    ("recompiles", ("no_recompiles",)),
)


def install_probes(patcher: "Patcher", checks: Iterable[str], installed: set[str]) -> None:
    """Install, once each, Lightning's observer and the probes ``checks`` need; record them in ``installed``."""
    from .. import lightning

    if "lightning" not in installed:
        lightning.install(patcher)  # steps, batches and Trainer calls: every run needs them
        installed.add("lightning")
    wanted = set(checks)
    for module, needed_by in PROBES:
        if module not in installed and wanted.intersection(needed_by):
            importlib.import_module(f"{__name__}.{module}").install(patcher)
            installed.add(module)
