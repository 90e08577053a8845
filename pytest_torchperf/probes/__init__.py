"""Probes: what torchperf patches in torch and Lightning to see what a training run does.

A probe is installed while at least one active run checks an invariant that
needs it (:attr:`pytest_torchperf.registry.Invariant.probes`), through a
:class:`~pytest_torchperf.patching.Patcher` that puts every attribute back
when the last such run ends. It forwards what it sees to the checks of the
active runs (:mod:`pytest_torchperf.core`), and holds its own state on its
:class:`Probe` object, emptied when it is installed and when it is removed.

A probe is a guest in the user's process:

- it never raises into user code: a wrapper does its bookkeeping inside
  ``try``, calls the user's operation exactly once outside it, and hands its
  own errors to :meth:`Probe.failed`, which takes the probe out and makes the
  invariants that need it "not checked" with the error;
- it never changes what torch or the user's objects do: patches are on classes
  and modules (never on the user's instances), and CPython's type slots of a
  patched class are kept as they were (:mod:`pytest_torchperf.patching`);
- it says what it cannot see (:attr:`Probe.unavailable`) so that no invariant
  passes on observations it never made.

Built-in probes are the modules of this package, each defining one :class:`Probe`
subclass whose :attr:`~Probe.name` is the module's name. No module holds an
instance: the engine (:class:`pytest_torchperf.engine.Engine`) makes one of each
probe it is asked for (:meth:`~pytest_torchperf.engine.Engine.probe`), keeps it
for its lifetime, and hands it the instances of the probes it needs
(:attr:`Probe.needed`); a check gets the probes it reads from its run
(``run.probe("syncs")``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core
from ..patching import wraps

if TYPE_CHECKING:
    from ..patching import Patcher

__all__ = [
    "ModuleProbe", "Probe", "accelerator_available", "cuda_available", "finished_runs", "guard",
    "is_compiling_function", "relocate_warnings",
]


class Probe:
    """Base class of a probe. Subclasses set :attr:`name` and define :meth:`install` and :meth:`reset`.

    A probe class is instantiated without arguments by the engine that installs it, once per engine; its
    state lives on that instance.
    """

    #: The name invariants use to ask for it (``"syncs"``).
    name: str = ""
    #: Names of the probes that must be installed before this one.
    needs: tuple[str, ...] = ()
    #: The instances of :attr:`needs`, by name: set by the engine that made this probe (its own instances of
    #: them), before the probe is first installed. A probe reads them here, never from a module.
    needed: Mapping[str, Probe] = {}
    #: Events this probe sends beyond :data:`pytest_torchperf.core.EVENTS` (name -> what a handler receives):
    #: the checks of the invariants that use the probe may define them.
    events: Mapping[str, Any] = {}
    #: :meth:`install` builds the same wrappers every time: closures over the probe and over state it keeps
    #: in place (read when called), nothing install reads once. The engine then keeps them for the next watch
    #: (:meth:`~pytest_torchperf.patching.Patcher.reusing`, scoped by the probe): a wrapper is built again
    #: only when what it wraps is no longer there.
    keeps_wrappers: bool = False

    def __init__(self) -> None:
        #: What this probe could not attach to in this process (feature -> why); reset with the probe.
        self.unavailable: dict[str, str] = {}
        #: Taken out after a failure: its hooks still registered until the run ends do nothing.
        self.disabled = False

    def install(self, patcher: Patcher) -> None:  # pragma: no cover - abstract
        """Patch what the probe watches through ``patcher`` (undone by ``patcher.undo()``)."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything seen: called before :meth:`install` and when the probe is removed."""
        self.unavailable = {}
        self.disabled = False

    def forked(self) -> None:
        """This process was forked while the probe was installed: the engine calls this in the child, before
        anything else runs there, so that the probe's copy of its state serves the child's own runs (a
        probe that remembers its thread, or a call in flight, sets them for the child here)."""

    def failed(self, exc: BaseException) -> None:
        """This probe's own code raised: record it and take the probe out (never raises)."""
        core.probe_failed(self.name, exc)

    def __repr__(self) -> str:
        return f"<torchperf probe {self.name}>"


def finished_runs(table: Iterable[core.Run]) -> list[core.Run]:
    """The runs of a probe's table (a weak dict or set keyed by run) that are no longer watching: to forget at a
    reset. A test's report keeps its run for the session, so a finished run left in such a table made every
    later watch go through it (quadratic in the watched tests); its check holds what it needs of its own."""
    active = core.active_runs()
    return [run for run in table if run not in active]


def is_compiling_function() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``: True while torch.compile traces.

    TorchDynamo folds it to True, and its fake-tensor and AOT passes set it,
    so a wrapper that checks it first calls straight through and records
    nothing while a graph is being built (its compiled code then never guards
    on torchperf's state).
    """
    import torch

    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:  # pragma: no cover - torch < 2.3
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn or (lambda: False)


class _NoSession:
    """Where torch has no compile-session flag: never in one (its ``is_compiling()`` is the whole check)."""

    _is_compiling_flag = False


def compiling_parts() -> tuple[Callable[[], bool], Any]:
    """``(traced, session)``: the check of :func:`is_compiling_function` in two parts, for the hottest wrappers.

    ``traced()`` is a function TorchDynamo folds to True while it traces (``torch.compiler.
    is_dynamo_compiling``: one Python call eager, against two for ``is_compiling()``), and
    ``session._is_compiling_flag`` is what ``is_compiling()`` reads otherwise (a compile session, an
    export). A wrapper writes ``traced() or session._is_compiling_flag`` first: while dynamo traces it,
    the attribute is never reached, so its graph guards on nothing of torchperf's or of that flag.
    """
    import torch

    compiler = getattr(torch, "compiler", None)
    traced = getattr(compiler, "is_dynamo_compiling", None)
    if traced is None or not hasattr(compiler, "_is_compiling_flag"):  # pragma: no cover - torch < 2.3
        return is_compiling_function(), _NoSession
    return traced, compiler


def cuda_available() -> bool:
    """Whether this machine has a CUDA device (the device pinned memory and autocast checks are for)."""
    import torch

    try:
        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - a broken driver is no device
        return False


def accelerator_available() -> bool:
    """Whether a real host-to-device copy can happen here (CUDA or Apple MPS)."""
    import torch

    if cuda_available():
        return True
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    try:
        return bool(mps is not None and mps.is_available())
    except Exception:  # noqa: BLE001
        return False


def record_creation(
    probe: Probe, created: Any, wanted: Callable[[], bool], builders: Any = None
) -> Callable[[Any], Any]:
    """A ``wrap`` maker for a class's ``__init__``: while ``wanted()``, ``created[instance]`` becomes the
    stack that built it, cut at the user's innermost frame (the line worth showing); with ``builders``,
    ``builders[instance]`` the framework whose code below that line built it (a Trainer building its own
    DataLoader or DDP wrapper: :func:`pytest_torchperf.frameworks.built_by`), when one did."""
    from ..frameworks import built_by
    from ..stacks import capture, until_user_frame

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @wraps(original)  # keeps the signature (Lightning inspects DataLoader's to re-instantiate it)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            __tracebackhide__ = True
            original(self, *args, **kwargs)
            if wanted():
                try:
                    stack = capture(2)
                    created[self] = until_user_frame(stack)
                    framework = built_by(stack) if builders is not None else None
                    if framework is not None:
                        builders[self] = framework
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)

        return __init__

    return wrap


def guard(probe: Probe, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` for a cold path (per epoch, per Trainer call): its errors go to ``probe.failed``, never up."""

    def guarded(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001
            probe.failed(exc)
            return None

    return guarded


class ModuleProbe(Probe):
    """A probe that attaches to one module of torch's (dynamo's) once it is imported, and says if it could.

    ``install`` waits for :attr:`module` (now if it is imported already, else at
    its first import during the run) and then calls ``_attach(patcher, module)``;
    ``attached`` is None until then, and what ``_attach`` sets it to after.
    """

    #: The module to attach to (``"torch._dynamo.convert_frame"``).
    module = ""

    def __init__(self) -> None:
        super().__init__()
        self.attached: Optional[bool] = None

    def reset(self) -> None:
        super().reset()
        self.attached = None

    def install(self, patcher: Patcher) -> None:
        """Attach to :attr:`module` now if it is imported, else as soon as it is; undone by ``patcher``."""
        self.reset()
        patcher.callback(self.reset, deferred=True)
        patcher.on_import(self.module, guard(self, lambda module: self._attach(patcher, module)))

    def _attach(self, patcher: Patcher, module: Any) -> None:
        raise NotImplementedError


def relocate_warnings(patcher: Patcher) -> None:
    """Show a warning torch raises inside one of the wrappers at the caller's line, not the wrapper's.

    A warning raised by C code (``float()`` of a tensor that requires grad,
    ``torch.tensor(a_tensor)``, ``torch.from_numpy`` of a read-only array...) is
    located at the innermost Python frame, which is now a torchperf wrapper.
    The display hook moves it to the first frame outside torchperf, so pytest's
    warnings summary points at the user's line as it would without the watch.
    """
    import sys
    import warnings

    from .. import stacks
    from ..frames import kind_of
    from ..stacks import TORCHPERF

    original = getattr(warnings, "_showwarnmsg", None)
    if original is None:  # pragma: no cover - not CPython's warnings module
        return

    def _showwarnmsg(msg: Any) -> Any:
        try:
            if stacks.classify(msg.filename) == TORCHPERF:
                f: Optional[FrameType] = sys._getframe(1)
                while f is not None and kind_of(f.f_code) == TORCHPERF:
                    f = f.f_back
                if f is not None:
                    msg.filename, msg.lineno, msg.line = f.f_code.co_filename, f.f_lineno, None
        except Exception:  # noqa: BLE001 - show it where it was
            pass
        return original(msg)

    patcher.setattr(warnings, "_showwarnmsg", _showwarnmsg)
