"""``watch()``: observe a block of training code and check its invariants.

``with watch() as run:`` installs the probes (only while at least one run is
active), routes what they see to every active run, and on a clean exit checks
each invariant; a broken one raises :class:`InvariantViolation` carrying the
:class:`Report`. Runs nest: a marker's run and a fixture's run inside it each
see what happened while they were active. Nothing here imports torch until a
run starts.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

from . import stacks
from .options import Options, parse_options
from .patching import Patcher
from .report import Report, settle

__all__ = ["Run", "watch", "active_runs", "FLAGS"]

_ACTIVE: list["Run"] = []
_patcher: Optional[Patcher] = None


def active_runs() -> list["Run"]:
    """The runs currently watching, outermost first (probes dispatch to all of them)."""
    return _ACTIVE


class _Flags:
    """Global switches read on the probes' hot paths (one attribute load each).

    Kept current by every scope transition of every run; a probe that only
    matters inside a step returns at once while ``in_scope`` is False.
    """

    #: Some run is watching.
    active = False
    #: Some active run's step checks apply right now (see :attr:`Run.in_scope`).
    in_scope = False
    #: Called with the new ``in_scope`` value whenever it changes (probes add and remove their own).
    listeners: "list[Callable[[bool], None]]" = []


FLAGS = _Flags


@contextlib.contextmanager
def suspended() -> Iterator[list["Run"]]:
    """Hide the active runs from the probes inside the block; yields the runs hidden.

    For torchperf's own work while a run is still active (the ``max_overhead``
    replay of a run nested in another): the probes stay installed, but no run
    records what they see.
    """
    hidden = list(_ACTIVE)
    _ACTIVE.clear()
    _refresh_flags()
    try:
        yield hidden
    finally:
        _ACTIVE[:] = hidden
        _refresh_flags()


def _refresh_flags() -> None:
    FLAGS.active = any(run._active for run in _ACTIVE)
    _refresh_scope()


def _refresh_scope() -> None:
    """Recompute ``FLAGS.in_scope`` (``Run.in_scope`` inlined: this runs at every step's end)."""
    now = False
    for run in _ACTIVE:
        if run._active and (
            run._step_depth or run.options.scope == "test" or (run._batch_depth and run.options.scope == "batch")
        ):
            now = True
            break
    if now is not FLAGS.in_scope:
        _set_in_scope(now)


def _set_in_scope(now: bool) -> None:
    FLAGS.in_scope = now
    if FLAGS.listeners:
        for listener in list(FLAGS.listeners):
            listener(now)


#: Probes installed for the active runs (by module name), undone with ``_patcher``.
_installed: set[str] = set()


def _activate(run: "Run") -> None:
    """Make ``run`` active, installing the probes its invariants need that are not in yet."""
    from .checks import install_probes

    global _patcher
    if _patcher is None:
        stacks.classify.reset()
        _patcher = Patcher()
        _installed.clear()
    try:
        install_probes(_patcher, run.options.enabled_checks, _installed)
    except BaseException:
        if not _ACTIVE:
            patcher, _patcher = _patcher, None
            _installed.clear()
            patcher.undo()
        raise
    _ACTIVE.append(run)


def _deactivate(run: "Run") -> None:
    global _patcher
    if run in _ACTIVE:
        _ACTIVE.remove(run)
    if not _ACTIVE and _patcher is not None:
        patcher, _patcher = _patcher, None
        _installed.clear()
        patcher.undo()


class Run:
    """One watched block: its options, its step counter, its checks and, at the end, its report."""

    def __init__(self, options: Options) -> None:
        from .checks import make_checks

        self.options = options
        self.report: Optional[Report] = None
        #: Training steps seen: ``training_step`` calls of observed fits plus ``run.step()`` blocks.
        self.steps = 0
        #: Batches seen: Lightning train batches (when a run asks for the batch scope) plus ``run.step()`` blocks.
        self.batches = 0
        self._step_depth = 0
        self._batch_depth = 0
        self._active = False
        #: What ``step()`` returns: stateless, so one serves every step (and nested steps).
        self._step_block = _Step(self)
        self.checks = make_checks(self)

    # -- scope -----------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self._active

    @property
    def in_scope(self) -> bool:
        """Whether step checks apply right now, per ``options.scope``."""
        if not self._active:
            return False
        scope = self.options.scope
        if scope == "test":
            return True
        if scope == "batch":
            return self._batch_depth > 0 or self._step_depth > 0
        return self._step_depth > 0

    def _step_started(self) -> None:
        if self._step_depth == 0:
            self.steps += 1
        self._step_depth += 1
        _refresh_scope()

    def _step_ended(self) -> None:
        self._step_depth = max(self._step_depth - 1, 0)
        _refresh_scope()

    def _batch_started(self) -> None:
        if self._batch_depth == 0:
            self.batches += 1
        self._batch_depth = 1
        _refresh_scope()

    def _batch_ended(self) -> None:
        self._batch_depth = 0
        _refresh_scope()

    def _notify(self, hook_name: str, *args: Any) -> None:
        for check in self.checks.values():
            hook = getattr(check, hook_name, None)
            if hook is not None:
                hook(*args)

    def _trainer_call_started(self, kind: str, trainer: Any, model: Any) -> None:
        """A Lightning ``Trainer.<kind>`` call begins (checks see ``on_trainer_call``)."""
        self._notify("on_trainer_call", kind, trainer, model)

    def _trainer_call_ended(self, kind: str, trainer: Any, model: Any) -> None:
        """The call returned or raised (checks see ``on_trainer_call_end``)."""
        self._notify("on_trainer_call_end", kind, trainer, model)

    def step(self) -> "_Step":
        """Mark one training step of a plain PyTorch loop: ``with run.step(): ...``."""
        return self._step_block

    # -- lifecycle ---------------------------------------------------------------
    def _start(self) -> None:
        _activate(self)
        self._active = True
        _refresh_flags()

    def _stop(self) -> None:
        self._active = False
        _refresh_flags()  # before the probes are undone: scope listeners restore what they changed
        _deactivate(self)

    def finish(self) -> Report:
        """Evaluate every check and store the :class:`Report` on ``run.report``."""
        report = Report(steps=self.steps, on_inconclusive=self.options.overhead_inconclusive)
        for name, check in self.checks.items():
            report.checks[name] = check.result()
        self.report = report
        return report

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self.report else "idle")
        return f"<torchperf Run {state} steps={self.steps} checks={list(self.checks)}>"


class _Step:
    """The context manager of :meth:`Run.step` (a small class: it runs every step, so it is kept cheap)."""

    __slots__ = ("run",)

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self) -> Run:
        run = self.run
        if not run._active:
            raise RuntimeError("run.step() used outside its `with torchperf.watch()` block")
        # _step_started() and _batch_started() inlined, one scope update: this runs every step.
        if run._step_depth == 0:
            run.steps += 1
        run._step_depth += 1
        if run._batch_depth == 0:
            run.batches += 1
        run._batch_depth = 1
        if not FLAGS.in_scope:  # a step puts its run in scope, whatever the scope option
            _set_in_scope(True)
        return run

    def __exit__(self, *exc_info: Any) -> None:
        run = self.run
        run._batch_depth = 0
        depth = run._step_depth - 1
        run._step_depth = depth if depth > 0 else 0
        _refresh_scope()


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
    with _watching(options) as run:
        yield run
    settle(run.report)  # type: ignore[arg-type]


@contextlib.contextmanager
def _watching(options: Options) -> Iterator[Run]:
    """Run the block under watch and evaluate it; never raises a verdict itself."""
    run = Run(options)
    run._start()
    try:
        yield run
    except BaseException:
        # The block's own exception is what the user must see: stop watching,
        # keep what can be concluded, and let it propagate.
        run._stop()
        with contextlib.suppress(Exception):
            run.finish()
        raise
    run._stop()
    run.finish()
