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
from typing import Any, Iterator, Optional

from . import stacks
from .options import Options, parse_options
from .patching import Patcher
from .report import InvariantViolation, Report

__all__ = ["Run", "watch", "active_runs"]

_ACTIVE: list["Run"] = []
_patcher: Optional[Patcher] = None


def active_runs() -> list["Run"]:
    """The runs currently watching, outermost first (probes dispatch to all of them)."""
    return _ACTIVE


def _install() -> Patcher:
    from .checks import install_probes

    stacks.classify.reset()
    patcher = Patcher()
    try:
        install_probes(patcher)
    except BaseException:
        patcher.undo()
        raise
    return patcher


def _activate(run: "Run") -> None:
    global _patcher
    if not _ACTIVE:
        _patcher = _install()
    _ACTIVE.append(run)


def _deactivate(run: "Run") -> None:
    global _patcher
    if run in _ACTIVE:
        _ACTIVE.remove(run)
    if not _ACTIVE and _patcher is not None:
        patcher, _patcher = _patcher, None
        patcher.undo()


class Run:
    """One watched block: its options, its step counter, its checks and, at the end, its report."""

    def __init__(self, options: Options) -> None:
        from .checks import make_checks

        self.options = options
        self.report: Optional[Report] = None
        #: Training steps seen: ``training_step`` calls of observed fits plus ``run.step()`` blocks.
        self.steps = 0
        self._step_depth = 0
        self._batch_depth = 0
        self._active = False
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

    def _step_ended(self) -> None:
        self._step_depth = max(self._step_depth - 1, 0)

    def _batch_started(self) -> None:
        self._batch_depth = 1

    def _batch_ended(self) -> None:
        self._batch_depth = 0

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

    @contextlib.contextmanager
    def step(self) -> Iterator["Run"]:
        """Mark one training step of a plain PyTorch loop."""
        if not self._active:
            raise RuntimeError("run.step() used outside its `with torchperf.watch()` block")
        self._step_started()
        self._batch_started()
        try:
            yield self
        finally:
            self._batch_ended()
            self._step_ended()

    # -- lifecycle ---------------------------------------------------------------
    def _start(self) -> None:
        _activate(self)
        self._active = True

    def _stop(self) -> None:
        self._active = False
        _deactivate(self)

    def finish(self) -> Report:
        """Evaluate every check and store the :class:`Report` on ``run.report``."""
        report = Report(steps=self.steps)
        for name, check in self.checks.items():
            report.checks[name] = check.result()
        self.report = report
        return report

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self.report else "idle")
        return f"<torchperf Run {state} steps={self.steps} checks={list(self.checks)}>"


@contextlib.contextmanager
def watch(**kwargs: Any) -> Iterator[Run]:
    """Watch the block, then check its invariants.

    Takes the same keyword arguments as ``@pytest.mark.torchperf``. On a clean
    exit a broken invariant raises :class:`InvariantViolation`; an exception
    raised by the block itself propagates untouched. ``run.report`` holds the
    verdicts either way.
    """
    options = parse_options(kwargs, where="torchperf.watch()")
    with _watching(options) as run:
        yield run
    if not run.report.passed:  # type: ignore[union-attr]
        raise InvariantViolation(run.report)  # type: ignore[arg-type]


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
