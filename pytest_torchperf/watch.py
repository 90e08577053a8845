"""``watch()``: observe a block of training code and check its invariants.

``with watch() as run:`` builds a :class:`~pytest_torchperf.core.Run` with one
check per invariant its arguments enable (:mod:`pytest_torchperf.registry`),
installs the probes those invariants need (each through its own
:class:`~pytest_torchperf.patching.Patcher`, only while at least one run needs
it), and on a clean exit checks each invariant; a broken one raises
:class:`InvariantViolation` carrying the :class:`Report`. Runs nest: a
marker's run and a fixture's run inside it each see what happened while they
were active. Nothing here imports torch until a run starts.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from typing import Any, Iterator, Optional

from . import core, dynamo_frames, lightning, registry, stacks
from .core import Run
from .options import Options, parse_options
from .patching import Patcher, lift_all, relay_all
from .probes import relocate_warnings
from .report import settle

__all__ = ["EXTENSIONS", "Run", "finish", "start", "stop", "watch", "watching"]

#: Installed probes by name, in install order, each with its own patcher.
_installed: dict[str, Patcher] = {}
#: Probe name -> the names of the probes it needs (for taking out a failed probe's dependents).
_needs: dict[str, tuple[str, ...]] = {}
#: The patcher of the Lightning observer and of the torch caches kept out of the probes' way.
_base: list[Patcher] = []
#: Patchers of probes taken out mid-run: their deferred undo actions run when the last run stops.
_removed: list[Patcher] = []

#: Objects told about every run (multi-process support, :mod:`pytest_torchperf.ranks`, registers one):
#: ``install(patcher)`` with the base patches, ``finished(run, exc)`` once its report is made (it may
#: replace ``run.report``), ``judges(run) -> bool`` (False: another process judges it, ``watch()`` won't raise).
EXTENSIONS: list[Any] = []


def start(run: Run) -> None:
    """Make ``run`` active, installing the probes its invariants need that are not in yet."""
    if not _base:
        stacks.classify.reset()
        base = Patcher()
        _base.append(base)
        try:
            _keep_torch_caches(base)
            relocate_warnings(base)
            lightning.install(base)
            for extension in EXTENSIONS:
                extension.install(base)
        except BaseException:
            _base.clear()
            base.undo()
            raise
    run.enlist()  # a probe failing while it is installed is recorded on this run
    missing = [probe for probe in registry.probes_for(run.options.enabled_checks) if probe.name not in _installed]
    if missing and not _installed:
        _fill_caches(import_torch=True)  # before the first probe replaces anything
    for probe in missing:
        patcher = Patcher()
        try:
            probe.install(patcher)
        except Exception as exc:  # noqa: BLE001 - a probe that cannot install is reported, not raised
            patcher.undo()
            run.internal_errors.setdefault(probe.name, f"{type(exc).__name__}: {exc}")
            continue
        _installed[probe.name] = patcher
        _needs[probe.name] = tuple(probe.needs)
    run.checks = registry.make_checks(run)  # after the probes: a check may ask its probe for something
    dynamo_frames.skip_own_frames()  # compiled code runs the same watched (torchperf's modules are all loaded now)
    run.start()


def stop(run: Run) -> None:
    run.stop()
    if core.active_runs():
        return
    errors: list[BaseException] = []
    for name in reversed(list(_installed)):
        errors.extend(_installed.pop(name).undo())
    while _removed:
        errors.extend(_removed.pop().undo())
    _needs.clear()
    if _base:
        errors.extend(_base.pop().undo())
    for exc in errors:
        run.internal_errors.setdefault("undo", f"{type(exc).__name__}: {exc}")


def _remove_probe(name: str) -> None:
    """Take out a probe whose own code failed, and every installed probe that needs it."""
    doomed = {name}
    changed = True
    while changed:
        changed = False
        for other, needs in _needs.items():
            if other not in doomed and doomed.intersection(needs):
                doomed.add(other)
                changed = True
    for other in reversed(list(_installed)):
        if other in doomed:
            # Attributes go back now; hooks torch may be iterating at this very moment stay
            # registered, disabled, until the last run stops.
            registry.probe(other).disabled = True
            patcher = _installed.pop(other)
            patcher.undo(keep_deferred=True)
            _removed.append(patcher)
            _needs.pop(other, None)
    for run in core.active_runs():
        for other in doomed - {name}:
            run.internal_errors.setdefault(other, f"taken out with probe {name}, which it needs")


core._probe_remover[:] = [_remove_probe]


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
    patcher.on_import("torch._dynamo.eval_frame", lambda module: dynamo_frames.skip_own_frames())


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


def _lifted(fn: Any) -> None:
    """Run ``fn`` with every probe's patches lifted (torch exactly as it is unwatched), then restore them."""
    lift_all()
    try:
        fn()
    finally:
        relay_all()


def finish(run: Run, exc: Optional[BaseException] = None) -> None:
    """Evaluate a stopped run into ``run.report`` (``exc``: what ended its block, if it raised)."""
    run.finish()
    for extension in EXTENSIONS:
        extension.finished(run, exc)


@contextlib.contextmanager
def watching(options: Options) -> Iterator[Run]:
    """Run the block under watch and evaluate it; never raises a verdict itself."""
    run = Run(options)
    start(run)
    try:
        yield run
    except BaseException as exc:
        # The block's own exception is what the user must see: stop watching,
        # keep what can be concluded, and let it propagate.
        stop(run)
        with contextlib.suppress(Exception):
            finish(run, exc)
        raise
    stop(run)
    finish(run)


@contextlib.contextmanager
def watch(**kwargs: Any) -> Iterator[Run]:
    """Watch the block, then check its invariants.

    Takes the same keyword arguments as ``@pytest.mark.torchperf``. On a clean
    exit a broken invariant raises :class:`InvariantViolation`, and an
    inconclusive one does what ``overhead_inconclusive`` says (see
    :func:`~pytest_torchperf.report.settle`); an exception raised by the block
    itself propagates untouched. ``run.report`` holds the verdicts either way.
    """
    options = parse_options(kwargs, where="torchperf.watch()")
    with watching(options) as run:
        yield run
    if all(e.judges(run) for e in EXTENSIONS):  # another process (a rank's launcher) may judge it
        settle(run.report)  # type: ignore[arg-type]


def installed_probes() -> tuple[str, ...]:
    """The probes installed now, in install order (for tests and debugging)."""
    return tuple(_installed)
