"""The engine: the one owner of what torchperf holds while runs watch.

An :class:`Engine` owns the runs that are watching (the list the probes'
hot paths read as :func:`pytest_torchperf.core.active_runs`), its probe
instances (one of each probe class, made when first asked for: :meth:`Engine.probe`;
no module holds one), the probes installed for them, each with its own
:class:`~pytest_torchperf.patching.Patcher`,
the base patcher (the Lightning observer, torch's caches, the warnings hook,
the extensions' patches), the patchers of probes taken out mid-run, and the
extensions told about every run (multi-process support is one, loaded by
name when the first run starts).

:meth:`Engine.start` is a transaction, like a torch mode's ``__enter__``:
everything it installs is pushed on an :class:`contextlib.ExitStack` and the
run joins the active runs last; if anything raises on the way (a third-party
check's constructor, an invariant naming a probe that does not exist, an
interrupt while a probe installs), every patch it made is undone and the run
is not registered, so torch is exactly as it was. :meth:`Engine.stop`
always leaves torch as it was once the last run stops, whatever raised on the
way. A probe whose own ``install`` raises an ``Exception`` is not a failed
start: its own patches are undone and the invariants that need it report
"not checked" with the error (probes never raise into the user's code).

The hot-path switches stay in :data:`pytest_torchperf.core.FLAGS`.
Nothing here imports torch until a run starts.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import weakref
from typing import Any, Callable, Optional, Protocol

from . import _rejoin_modules, autosteps, core, dynamo_frames, frameworks, registry, stacks
from .core import Run
from .patching import Patcher, lift_all, relay_all
from .probes import relocate_warnings

__all__ = ["ENGINE", "BUILTIN_EXTENSIONS", "Engine", "Extension"]

#: Extensions loaded by name when the first run starts (``module`` with an ``EXTENSION`` attribute).
BUILTIN_EXTENSIONS = ("pytest_torchperf.ranks",)


class Extension(Protocol):
    """What the engine tells about every run (multi-process support, :mod:`pytest_torchperf.ranks`, is one)."""

    def install(self, patcher: Patcher) -> None:
        """Patch what the extension needs, with the base patches (undone when the last run stops)."""

    def finished(self, run: Run, exc: Optional[BaseException]) -> None:
        """``run``'s report is made (the extension may replace ``run.report``); ``exc`` ended its block."""

    def judges(self, run: Run) -> bool:
        """False: another process judges ``run`` (``watch()`` then does not raise its verdict)."""


class Engine:
    """Runs, installed probes, patchers and extensions: one object, one place to read them."""

    def __init__(self) -> None:
        #: The active runs, outermost first: the very list :mod:`core`'s dispatch reads (its hot paths).
        self.runs: list[Run] = core._ACTIVE
        #: Installed probes by name, in install order, each with its own patcher.
        self.installed: dict[str, Patcher] = {}
        #: The probe instances this engine installed, by name (what ``run.probe(name)`` returns).
        self.probes: dict[str, Any] = {}
        #: Every probe instance this engine made (:meth:`probe`), installed or not: one per probe class, kept for
        #: the engine's lifetime (a probe keeps its wrappers across watches, scoped by its instance).
        self.made: dict[str, Any] = {}
        #: Probe name -> the names of the probes it needs (for taking out a failed probe's dependents).
        self.needs: dict[str, tuple[str, ...]] = {}
        #: The patcher of the Lightning observer, torch's caches and the extensions (while some run watches).
        self.base: Optional[Patcher] = None
        #: The patcher of the automatic steps' hooks (:mod:`pytest_torchperf.autosteps`), installed after the probes.
        self.autosteps: Optional[Patcher] = None
        #: Patchers of probes taken out mid-run: their deferred undo actions run when the last run stops.
        self.removed: list[Patcher] = []
        #: Told about every run; :data:`BUILTIN_EXTENSIONS` are added when the first run starts.
        self.extensions: list[Any] = []
        self._builtin_loaded = False
        _at_fork(self)

    # -- extensions ------------------------------------------------------------------------
    def add_extension(self, extension: Any) -> None:
        """Tell ``extension`` about every run from now on (once, however often it is added)."""
        if not any(e is extension or type(e) is type(extension) for e in self.extensions):
            self.extensions.append(extension)

    def _load_builtin_extensions(self) -> None:
        if self._builtin_loaded:
            return
        for module_name in BUILTIN_EXTENSIONS:
            self.add_extension(importlib.import_module(module_name).EXTENSION)
        self._builtin_loaded = True

    # -- a run's lifecycle -------------------------------------------------------------------
    def start(self, run: Run) -> None:
        """Make ``run`` active, installing what it needs; on any failure undo all of it and re-raise."""
        _rejoin_modules()  # before anything below imports one of torchperf's modules
        self._load_builtin_extensions()
        core._probe_remover[:] = [self.remove_probe]  # the failure path of the engine that watches
        with contextlib.ExitStack() as undo:
            if self.base is None:
                undo.callback(self._undo_base, run)
                self._install_base()
            # Resolve every probe before anything is patched for them: an unknown name is a UsageError here.
            needed = [self.probe(p.name) for p in registry.probes_for(run.options.enabled_checks)]
            missing = [p for p in needed if p.name not in self.installed]
            run.enlist()  # a probe failing while it is installed is recorded on this run
            undo.callback(self._leave, run)
            if missing and not self.installed:
                _fill_caches(import_torch=True)  # before the first probe replaces anything
            for probe in missing:
                undo.callback(self._uninstall, probe.name, run)
                self._install_probe(probe, run)
            run.engine = self
            run.probes = {p.name: p for p in needed}  # this engine's instances, installed or failed
            run.checks = registry.make_checks(run)  # after the probes: a check may ask its probe for something
            # After the probes: the automatic steps' backward wrapper is the outermost, so a pass opens its step first.
            if self.autosteps is None:
                undo.callback(self._undo_autosteps, run)
                self.autosteps = Patcher()
                autosteps.install(self.autosteps)
            autosteps.arm(run)
            # Compiled code runs the same watched (torchperf's modules are all loaded by now).
            dynamo_frames.skip_own_frames()
            run.start()  # registered last: nothing can fail after this
            undo.pop_all()

    def stop(self, run: Run) -> None:
        """Stop ``run``; when it was the last, undo every probe and the base patches (always)."""
        try:
            autosteps.close(run)
            run.stop()
        finally:
            self._leave(run)
            if not self.runs:
                self.undo_all(run)

    def undo_all(self, run: Optional[Run] = None) -> None:
        """Undo every patch the engine holds (errors recorded on ``run`` as ``undo``); no run may be active."""
        errors: list[BaseException] = []
        for name in reversed(list(self.installed)):
            errors.extend(self.installed.pop(name).undo())
        self.probes.clear()
        while self.removed:
            errors.extend(self.removed.pop().undo())
        self.needs.clear()
        if self.autosteps is not None:
            steps, self.autosteps = self.autosteps, None
            errors.extend(steps.undo())
        if self.base is not None:
            base, self.base = self.base, None
            errors.extend(base.undo())
        if run is not None:
            for exc in errors:
                run.internal_errors.setdefault("undo", f"{type(exc).__name__}: {exc}")

    def finish(self, run: Run, exc: Optional[BaseException] = None) -> None:
        """Evaluate a stopped run into ``run.report`` and tell the extensions."""
        run.finish()
        if run.report is not None:
            run.report.steps_found = autosteps.found(run)
        for extension in self.extensions:
            extension.finished(run, exc)

    def judges(self, run: Run) -> bool:
        """Whether this process judges ``run`` (no extension says another one does)."""
        return all(e.judges(run) for e in self.extensions)

    # -- the pieces of a start, each undone by its own callback ---------------------------------
    def _install_base(self) -> None:
        stacks.classify.refresh()
        base = self.base = Patcher()
        _keep_torch_caches(base)
        relocate_warnings(base)
        frameworks.install(base)
        for extension in self.extensions:
            extension.install(base)

    def _undo_base(self, run: Run) -> None:
        if not self.runs and self.base is not None:
            base, self.base = self.base, None
            for exc in base.undo():
                run.internal_errors.setdefault("undo", f"{type(exc).__name__}: {exc}")

    def _undo_autosteps(self, run: Run) -> None:
        if not self.runs and self.autosteps is not None:
            steps, self.autosteps = self.autosteps, None
            for exc in steps.undo():
                run.internal_errors.setdefault("undo", f"{type(exc).__name__}: {exc}")

    def _install_probe(self, probe: Any, run: Run) -> None:
        patcher = Patcher(contain=probe.failed)
        try:
            with patcher.reusing(probe if getattr(probe, "keeps_wrappers", False) else None):
                probe.install(patcher)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot install is reported, not raised
            patcher.undo()
            run.internal_errors.setdefault(probe.name, f"{type(exc).__name__}: {exc}")
            return
        except BaseException:
            patcher.undo()
            raise
        self.installed[probe.name] = patcher
        self.probes[probe.name] = probe
        self.needs[probe.name] = tuple(probe.needs)

    def _uninstall(self, name: str, run: Run) -> None:
        patcher = self.installed.pop(name, None)
        self.probes.pop(name, None)
        self.needs.pop(name, None)
        if patcher is not None:
            for exc in patcher.undo():
                run.internal_errors.setdefault("undo", f"{type(exc).__name__}: {exc}")

    def _leave(self, run: Run) -> None:
        if run in self.runs:
            self.runs.remove(run)
        core._refresh_flags()

    # -- a probe that failed mid-run ----------------------------------------------------------
    def remove_probe(self, name: str) -> None:
        """Take out a probe whose own code failed, and every installed probe that needs it."""
        doomed = {name}
        changed = True
        while changed:
            changed = False
            for other, needs in self.needs.items():
                if other not in doomed and doomed.intersection(needs):
                    doomed.add(other)
                    changed = True
        for other in reversed(list(self.installed)):
            if other in doomed:
                # Attributes go back now; hooks torch may be iterating at this very moment stay
                # registered, disabled, until the last run stops.
                self.probes[other].disabled = True
                patcher = self.installed.pop(other)
                patcher.undo(keep_deferred=True)
                self.removed.append(patcher)
                self.needs.pop(other, None)
        for run in self.runs:
            for other in doomed - {name}:
                run.internal_errors.setdefault(other, f"taken out with probe {name}, which it needs")

    # -- processes ------------------------------------------------------------------------------
    def forked(self) -> None:
        """In a forked child (any start method, any launcher): the child's copy of the engine is its own.

        The patches are inherited and stay (they are this process's now, undone when its last run stops);
        each installed probe re-arms its copy of its state for this process (:meth:`Probe.forked`), so the
        child's runs (a rank's, started by :class:`~pytest_torchperf.ranks.child.ChildRuns`) see its events
        exactly as a spawned rank's runs do. Never raises: a probe that cannot re-arm is taken out.
        """
        for name in list(self.installed):
            hook = getattr(self.probes.get(name), "forked", None)
            if hook is None:
                continue
            try:
                hook()
            except Exception as exc:  # noqa: BLE001 - never into the child's code
                core.probe_failed(name, exc)

    def probe(self, name: str) -> Any:
        """This engine's instance of the probe named ``name``, made on first request (installed or not).

        Made once per engine from the registry's class (built-in, or a plug-in's); the instances of the probes
        it needs are this engine's too, given to it as :attr:`~pytest_torchperf.probes.Probe.needed`. A
        plug-in that registered an instance (the older API) gets that instance back, shared by every engine.
        """
        spec = registry.probe_class(name)
        found = self.made.get(name)
        if found is None or (found is not spec and type(found) is not spec):  # first asked, or registered anew
            # A plug-in's own instance (the older API) is used as it is: shared, not this engine's to make.
            found = self.made[name] = spec() if isinstance(spec, type) else spec
            if spec.needs:
                found.needed = {needed: self.probe(needed) for needed in spec.needs}
        return found

    def installed_probes(self) -> tuple[str, ...]:
        """The probes installed now, in install order."""
        return tuple(self.installed)

    def __repr__(self) -> str:
        return f"<torchperf Engine runs={len(self.runs)} probes={list(self.installed)}>"


def _at_fork(engine: Engine) -> None:
    """Call ``engine.forked()`` in every child this process forks, for as long as the engine lives."""
    register = getattr(os, "register_at_fork", None)
    if register is None:  # pragma: no cover - no fork on this platform
        return
    ref = weakref.ref(engine)

    def after_in_child() -> None:
        live = ref()
        if live is not None:
            try:
                live.forked()
            except Exception:  # noqa: BLE001 - the child's code runs next, whatever happened here
                pass

    register(after_in_child=after_in_child)


def _keep_torch_caches(patcher: Patcher) -> None:
    """Fill torch's lazily built tables of its own functions before any probe replaces them.

    Some parts of torch collect ``torch.zeros``, ``torch.Tensor.item``... into a
    cached table the first time they need it (``torch.device`` as a context
    manager, dynamo's rules for tracing torch functions). Built while a probe's
    wrappers are in place, such a table would hold the wrappers and miss torch's
    own functions for the rest of the process. So the tables are built now; for
    dynamo, first imported later, right after its import, with every probe's
    patches lifted for that moment.
    """
    patcher.on_import("torch._dynamo.trace_rules", lambda module: _lifted(_fill_caches))
    patcher.on_import("torch._dynamo.eval_frame", lambda module: None if dynamo_frames.skip_own_frames() else None)


def _fill_caches(import_torch: bool = False) -> None:
    """Build the tables of :data:`_TORCH_CACHES` (torch's own modules imported when ``import_torch``)."""
    for module_name, names in _TORCH_CACHES:
        module = sys.modules.get(module_name)
        if module is None and import_torch and not module_name.startswith("torch._dynamo"):
            with contextlib.suppress(ImportError):
                module = importlib.import_module(module_name)
        for name in names:
            fn = getattr(module, name, None)
            if callable(fn):
                with contextlib.suppress(Exception):
                    fn()


#: ``(module, functions)`` that cache tables of torch's own functions on their first call.
_TORCH_CACHES = (
    ("torch.utils._device", ("_device_constructors",)),
    ("torch.overrides", ("get_ignored_functions", "get_testing_overrides", "_get_tensor_methods")),
    ("torch._dynamo.trace_rules", ("get_torch_obj_rule_map", "get_tensor_method")),
)


def _lifted(fn: Callable[[], None]) -> None:
    """Run ``fn`` with every probe's patches lifted (torch exactly as it is unwatched), then restore them."""
    lift_all()
    try:
        fn()
    finally:
        relay_all()


#: The process's engine.
ENGINE = Engine()
