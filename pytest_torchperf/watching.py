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
from collections.abc import Iterator
from typing import Any, Optional

from .core import Run
from .engine import ENGINE
from .options import Options, parse_options
from .report import settle

__all__ = ["EXTENSIONS", "Run", "finish", "start", "stop", "watch", "watching"]

#: Objects told about every run: the engine's list (see :class:`pytest_torchperf.engine.Extension`):
#: ``install(patcher)`` with the base patches, ``finished(run, exc)`` once its report is made (it may
#: replace ``run.report``), ``judges(run) -> bool`` (False: another process judges it, ``watch()`` won't raise).
EXTENSIONS: list[Any] = ENGINE.extensions


def start(run: Run) -> None:
    """Make ``run`` active, installing the probes its invariants need (all undone if anything raises)."""
    ENGINE.start(run)


def stop(run: Run) -> None:
    """Stop ``run``; the last run to stop leaves torch as it was."""
    ENGINE.stop(run)


def finish(run: Run, exc: Optional[BaseException] = None) -> None:
    """Evaluate a stopped run into ``run.report`` (``exc``: what ended its block, if it raised)."""
    ENGINE.finish(run, exc)


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
    if ENGINE.judges(run):  # another process (a rank's launcher) may judge it
        settle(run.report)  # type: ignore[arg-type]


def installed_probes() -> tuple[str, ...]:
    """The probes installed now, in install order (for tests and debugging)."""
    return ENGINE.installed_probes()
