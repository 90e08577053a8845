"""Framework adapters: what torchperf must know about a training framework, one module each.

An adapter is a module of this package (an :class:`Adapter`) that never
imports its framework: it hooks in only when the framework is imported
(already, or later while a run watches), through the
:class:`~pytest_torchperf.patching.Patcher` it is given, and everything it
patches is undone with that patcher. It tells:

- ``NAME``: the framework, as reports name it (``"transformers"``);
- ``PACKAGES``: the import packages whose frames are the framework's own code,
  not the user's (their syncs and copies are notes, failing only with
  ``fail_on_framework_syncs=True``); collected in :data:`PACKAGES` for
  :mod:`pytest_torchperf.stacks`;
- ``install(patcher)``: patch the framework's *training call* (``Trainer.fit``,
  ``Trainer.train``, ``Engine.run``) to run the original inside
  :class:`~pytest_torchperf.frameworks._calls.Observed` (the checks get
  ``on_framework_call(call)`` / ``on_framework_call_end(call)`` with a
  :class:`~pytest_torchperf.frameworks._calls.FrameworkCall`), and to mark its
  *step* (``observed.begin_step()`` / ``observed.end_step()``, or
  ``run.step_started()`` / ``run.step_ended()``) for the length of the call; an
  adapter whose framework has no loop of its own (accelerate) leaves the steps
  to :mod:`pytest_torchperf.autosteps`;
- ``hint(frame, op) -> str``: the setting that removes the framework's own sync
  (or copy) made at ``frame`` (a :class:`~pytest_torchperf.stacks.Frame`;
  ``op``: the kind of operation, ``"value"``, ``"branch"``...), or ``""``;
- ``PLUMBING``: the framework's modules that only pass a call on to torch (Lightning's strategies and
  their ``broadcast`` / ``reduce``): an event inside them is their caller's (the callback that asked for
  the broadcast), see :func:`plumbing`;
- ``SETTINGS``: invariant name -> the framework's own setting that fixes what
  that invariant found in an object *the framework built* (the Hugging Face
  Trainer's DataLoader or DDP wrapper: ``TrainingArguments(...)``, not the
  ``DataLoader(...)`` argument the user never writes); see :func:`built_by`
  and :func:`setting`;

and, each ``None`` where the framework does not provide it:

- ``stage``: ``stage(call) -> Stage | None``, where in its loop the call is now
  (``"epoch 2 (train)"``), for the labels of passes and recompiles;
- ``replay``: a :class:`Replay`, when ``max_overhead`` can rebuild and time the
  framework's fits against their vanilla loop;
- ``launchers``: a :class:`Launchers`, when the framework starts rank processes
  with a function launcher whose ranks re-run the call.

Adding a framework is one module here, its name in :data:`ADAPTERS`, its
packages in :data:`PACKAGES`, and its tests. The rest of torchperf reaches an
adapter only through this module's functions, never by importing it.

This package's ``__init__`` imports nothing at import time (:mod:`pytest_torchperf.stacks`
reads :data:`PACKAGES` from it).
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import (
    TYPE_CHECKING,
    Any,
    Callable,
    NamedTuple,
    Optional,
    Protocol,
    cast,
)

if TYPE_CHECKING:
    from ..patching import Patcher
    from ._calls import FrameworkCall, Observed

__all__ = [
    "ADAPTERS",
    "PACKAGES",
    "Adapter",
    "Launchers",
    "Replay",
    "Stage",
    "adapter",
    "built_by",
    "current_call",
    "hint",
    "install",
    "launch_spec",
    "launchers",
    "plumbing",
    "setting",
    "stage",
    "unobserved",
]

#: The adapters installed with every run, by module name.
ADAPTERS = ("lightning", "transformers", "accelerate", "ignite")

#: Import packages whose frames are a training framework's own code: every adapter's ``PACKAGES``, in the
#: order of :data:`ADAPTERS` (written out here so that :mod:`pytest_torchperf.stacks` imports no adapter;
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


class Stage(NamedTuple):
    """Where a framework's loop is now."""

    label: str  # "epoch 2 (train)", "sanity check"
    sanity: bool  # a sanity check (validation before the fit): not the training's own
    training: bool  # the training stage of a fit


class Replay(Protocol):
    """What ``max_overhead`` needs to rebuild an observed fit and time it (:mod:`pytest_torchperf.overhead`)."""

    def init_args(self, trainer: Any) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The arguments the trainer was built with, if it was built while a run watched."""

    def rebuildable(self, trainer: Any) -> bool:
        """Whether the trainer can be rebuilt from those arguments (a subclass with its own ``__init__`` not)."""

    def unobserved(self) -> contextlib.AbstractContextManager[None]:
        """Calls made inside (torchperf's own replays) are observed by no run."""


class Launchers(Protocol):
    """What the rank launchers (:mod:`pytest_torchperf.ranks`) need to observe a call in the ranks it starts."""

    def is_launch(self, fn: Any) -> bool:
        """``fn``, given to a function launcher, is the framework's own rank entry (it re-runs the call)."""

    def observe(self, kind: str, package: str, args: tuple[Any, ...], runs: list[Any]) -> Optional[Observed]:
        """The call a rank re-runs (``args``: what the launcher passed ``fn``), observed for ``runs``; not entered."""


class Adapter(Protocol):
    """A framework adapter: a module of this package (see the module's documentation)."""

    NAME: str
    PACKAGES: tuple[str, ...]
    PLUMBING: tuple[str, ...]
    SETTINGS: Mapping[str, str]
    stage: Optional[Callable[[FrameworkCall], Optional[Stage]]]
    replay: Optional[Replay]
    launchers: Optional[Launchers]

    def install(self, patcher: Patcher) -> None: ...

    def hint(self, frame: Any, op: str) -> str: ...


def adapter(name: str) -> Adapter:
    """The adapter module ``name`` (imports the adapter, never its framework)."""
    return cast("Adapter", importlib.import_module(f"{__name__}.{name}"))


def _loaded() -> Iterator[Adapter]:
    """The adapters imported so far (installed ones), in the order of :data:`ADAPTERS`."""
    for name in ADAPTERS:
        module = sys.modules.get(f"{__name__}.{name}")
        if module is not None:
            yield cast("Adapter", module)


def install(patcher: Patcher) -> None:
    """Install every adapter of :data:`ADAPTERS` (each hooks in when its framework is imported)."""
    for name in ADAPTERS:
        adapter(name).install(patcher)


def hint(frame: Any, op: str) -> str:
    """What removes a framework's own operation at ``frame``: the first adapter that knows, else ``""``."""
    if frame is None:
        return ""
    for module in _loaded():
        try:
            text = module.hint(frame, op)
        except Exception:  # noqa: BLE001 - a hint is a courtesy
            text = ""
        if text:
            return str(text)
    return ""


def plumbing(module_name: str) -> bool:
    """``module_name`` is a framework module that only passes a call on to torch (an adapter's ``PLUMBING``):
    what happens inside it is its caller's doing."""
    for module in _loaded():
        for name in module.PLUMBING:
            if module_name == name or module_name.startswith(name + "."):
                return True
    return False


def _adapter_of(filename: str) -> Optional[str]:
    """The adapter whose framework's package holds ``filename``."""
    import os

    from ..stacks import package_locations

    path = os.path.realpath(filename)
    for name in ADAPTERS:
        for package in adapter(name).PACKAGES:
            for location in package_locations(package):
                root = os.path.realpath(location)
                if path == root or path.startswith(root.rstrip(os.sep) + os.sep):
                    return name
    return None


def built_by(stack: Sequence[Any]) -> Optional[str]:
    """The framework that built what ``stack`` (outermost frame first) shows, or None: the user built it.

    That is the framework of the first framework frame below the user's innermost line (the Hugging Face
    ``Trainer.train`` that builds its DataLoader and, through accelerate, its DDP wrapper: transformers, the
    outer of the two). A library frame there first (not a framework's) means neither the user nor a framework
    chose the arguments: None. A framework's pass-through wrapper of the constructor itself (Lightning wraps
    ``DataLoader.__init__`` to record the user's arguments: a function named ``wrapper``) leaves the call the
    user's own.
    """
    from ..stacks import FRAMEWORK, LIBRARY, USER

    frames = list(stack)
    last_user = max((i for i, frame in enumerate(frames) if frame.kind == USER), default=-1)
    for frame in frames[last_user + 1:]:
        kind = frame.kind
        if kind == FRAMEWORK and frame.function != "wrapper":
            return _adapter_of(frame.filename)
        if kind == LIBRARY:
            return None
    return None


def setting(framework: Optional[str], invariant: str) -> str:
    """The setting of ``framework`` that fixes what ``invariant`` found in an object it built, or ``""``."""
    if framework not in ADAPTERS:
        return ""
    return str(adapter(framework).SETTINGS.get(invariant, ""))


def current_call(framework: Optional[str] = None) -> Optional[FrameworkCall]:
    """The innermost framework call in flight (of ``framework``, if given), or None."""
    calls = sys.modules.get(f"{__name__}._calls")
    if calls is None:  # no adapter installed yet: no call observed
        return None
    return cast("Optional[FrameworkCall]", calls.current(framework))


def stage() -> Optional[Stage]:
    """Where the loop of the innermost framework call is now, if its adapter tells."""
    call = current_call()
    if call is None:
        return None
    read = adapter(call.framework).stage
    if read is None:
        return None
    try:
        return read(call)
    except Exception:  # noqa: BLE001 - a label is a courtesy
        return None


@contextlib.contextmanager
def unobserved() -> Iterator[None]:
    """Calls made inside are observed by no run, in every framework whose fits ``max_overhead`` replays."""
    with contextlib.ExitStack() as stack:
        for module in _loaded():
            if module.replay is not None:
                stack.enter_context(module.replay.unobserved())
        yield


def launchers(framework: str) -> Optional[Launchers]:
    """The launchers capability of ``framework``'s adapter, or None."""
    if framework not in ADAPTERS:
        return None
    return adapter(framework).launchers


def launch_spec() -> Optional[Sequence[str]]:
    """``(framework, kind, package)`` of the innermost call whose ranks re-run it, for a launch made now."""
    call = current_call()
    if call is None or launchers(call.framework) is None:
        return None
    return (call.framework, call.kind, call.package)
