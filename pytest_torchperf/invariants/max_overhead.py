"""Invariant ``max_overhead``: a Lightning fit's epoch time within N% of the vanilla loop derived from its module.

The check itself (the replay of the observed fit, the vanilla loop, the
statistics and where the extra time went) lives in :mod:`pytest_torchperf.overhead`
and :mod:`pytest_torchperf.timing`; this module declares the invariant.
It needs no probe beyond the Lightning observer every run has: it reads the
observed ``Trainer.fit`` calls and replays them after the test body, unwatched.
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict

from ..arguments import Argument, Choice, Integer, Share
from ..options import OVERHEAD_INCONCLUSIVE, OVERHEAD_MAX_ROUNDS, OVERHEAD_MIN_ROUNDS, OVERHEAD_ROUNDS
from ..registry import Invariant

NAME = "max_overhead"


def _check(run: Any) -> Any:
    """The check of a run that checks ``max_overhead``: a factory, so that the replay and timing modules load
    when a run first asks for it, not with the registry (most watched tests never do)."""
    from ..overhead.check import OverheadCheck

    return OverheadCheck(run)


class Figures(TypedDict, total=False):
    """The figures of a max_overhead verdict (see :mod:`pytest_torchperf.figures`)."""

    fits: list[dict[str, Any]]
    overhead: float
    interval: list[Optional[float]]
    max_overhead: float


INVARIANT = Invariant(
    name=NAME,
    doc="epoch time within this fraction of a vanilla PyTorch loop (e.g. 0.10)",
    check=_check,
    figures=Figures,
    kind=Share(above=0.0, bare_most=10.0, unit="a fraction: 0.10 means 10%, 2.5 means 250%"),
    default=None,
    arguments=(
        Argument(
            "overhead_rounds",
            Integer(minimum=OVERHEAD_MIN_ROUNDS, maximum=OVERHEAD_MAX_ROUNDS, optional=False),
            OVERHEAD_ROUNDS,
            "time at most this many rounds (one fit epoch and one vanilla epoch each, "
            f"after a warm-up); it stops after 2 on a quiet machine, else after {OVERHEAD_MIN_ROUNDS}, once the 95% "
            "interval is clear of the threshold",
            meaning="timed rounds of max_overhead",
        ),
        Argument(
            "overhead_inconclusive",
            Choice(OVERHEAD_INCONCLUSIVE),
            "fail",
            "what an interval that still straddles the threshold after overhead_rounds does: 'fail' the test, "
            "'skip' it, or 'warn' (pass with a warning) (command line: --torchperf-overhead-inconclusive)",
        ),
    ),
)
