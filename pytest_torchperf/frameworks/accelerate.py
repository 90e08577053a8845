"""Adapter for Hugging Face ``accelerate`` (see :mod:`pytest_torchperf.frameworks`).

``accelerate`` has no loop of its own: the user writes it around an
``Accelerator``. Its steps are found by :mod:`pytest_torchperf.autosteps`:
``accelerator.backward(loss)`` runs torch's backward, and an
``AcceleratedOptimizer`` steps the wrapped optimizer only when the gradients
are synchronised (``accelerator.accumulate(model)`` / ``sync_gradients``), so
with gradient accumulation one optimizer step is one step. ``no_sync``
(``accelerator.accumulate`` under DDP) is DDP's own and is seen by
``no_sync_accumulation`` as in any loop. Ranks started with
``accelerate.debug_launcher`` go through ``torch.multiprocessing.start_processes``,
which :mod:`pytest_torchperf.ranks` watches (``notebook_launcher`` uses torch's
``elastic_launch`` with a function, which starts them there too).

Frames in ``accelerate`` are the framework's (notes, not failures).
"""

from __future__ import annotations

from typing import Any

from ..patching import Patcher

__all__ = ["NAME", "PACKAGES", "PLUMBING", "SETTINGS", "hint", "install", "launchers", "replay", "stage"]

NAME = "accelerate"
PACKAGES = ("accelerate",)
#: Modules that only pass a call on to torch (see :func:`~pytest_torchperf.frameworks.plumbing`): none known.
PLUMBING: tuple[str, ...] = ()
#: Settings that fix what an invariant found in an object accelerate built
#: (see :func:`~pytest_torchperf.frameworks.setting`).
SETTINGS = {
    "no_unused_parameters_search": (
        "accelerate wraps the model in DistributedDataParallel with the DistributedDataParallelKwargs you pass: "
        "drop find_unused_parameters=True from Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(...)]) "
        "(its default does not search)"
    ),
}
#: Capabilities this framework does not provide (see :class:`pytest_torchperf.frameworks.Adapter`).
stage = None
replay = None
launchers = None


def hint(frame: Any, op: str) -> str:
    return ""


def install(patcher: Patcher) -> None:
    """Nothing to patch: automatic steps and the torch probes see an accelerate loop."""
