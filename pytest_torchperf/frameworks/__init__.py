"""Framework adapters: what torchperf must know about a training framework, one module each.

An adapter is a module of this package that never imports its framework: it
hooks in only when the framework is imported (already, or later while a run
watches), through the :class:`~pytest_torchperf.patching.Patcher` it is
given, and everything it patches is undone with that patcher. It tells:

- ``NAME``: the framework, as reports name it (``"transformers"``);
- ``PACKAGES``: the import packages whose frames are the framework's own code,
  not the user's (their syncs and copies are notes, failing only with
  ``fail_on_framework_syncs=True``); collected in :data:`PACKAGES` for
  :mod:`pytest_torchperf.stacks`;
- ``install(patcher)``: patch the framework's *training call* (``Trainer.train``,
  ``Engine.run``) to tell the runs that it began and ended
  (:func:`pytest_torchperf.frameworks._calls.observed`: the event
  ``on_framework_call``) and to mark its *step* (``run.step_started()`` /
  ``run.step_ended()``) for the length of the call; optional: an adapter whose
  framework has no loop of its own (accelerate) leaves the steps to
  :mod:`pytest_torchperf.autosteps`;
- ``hint(frame, op) -> str``: the setting that removes the framework's own sync
  (or copy) made at ``frame`` (a :class:`~pytest_torchperf.stacks.Frame`;
  ``op``: the kind of operation, ``"value"``, ``"branch"``...), or ``""``.

Adding a framework is one module here, its name in :data:`ADAPTERS`, its
packages in :data:`PACKAGES`, and its tests. Lightning's adapter
(:mod:`.lightning`) predates this protocol and keeps its own API (its calls
send ``on_trainer_call``; ``max_overhead`` replays its fits).

This package's ``__init__`` imports nothing (:mod:`pytest_torchperf.stacks`
reads :data:`PACKAGES` from it).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["ADAPTERS", "PACKAGES", "adapter", "hint", "install"]

#: The adapters installed with every run, by module name (Lightning's is installed on its own by ``watch``).
ADAPTERS = ("transformers", "accelerate", "ignite")

#: Import packages whose frames are a training framework's own code: every adapter's ``PACKAGES``, Lightning's
#: first (written out here so that :mod:`pytest_torchperf.stacks` imports no adapter;
#: ``tests/test_frameworks.py`` holds it equal to the adapters' own).
PACKAGES = (
    "pytorch_lightning",
    "lightning",
    "lightning_fabric",
    "lightning_utilities",
    "transformers",
    "accelerate",
    "ignite",
)


def adapter(name: str) -> Any:
    """The adapter module ``name`` (imports the adapter, never its framework)."""
    return importlib.import_module(f"{__name__}.{name}")


def install(patcher: Any) -> None:
    """Install every adapter of :data:`ADAPTERS` (each hooks in when its framework is imported)."""
    for name in ADAPTERS:
        adapter(name).install(patcher)


def hint(frame: Any, op: str) -> str:
    """What removes a framework's own operation at ``frame``: the first adapter that knows, else ``""``."""
    if frame is None:
        return ""
    for name in ADAPTERS:
        module = sys.modules.get(f"{__name__}.{name}")
        if module is None:
            continue
        try:
            text = module.hint(frame, op)
        except Exception:  # noqa: BLE001 - a hint is a courtesy
            text = ""
        if text:
            return str(text)
    return ""
