"""What a worker pool started again costs, for ``no_iterator_reset``'s report: seconds, and a share of the run.

Each pass over a loader is timed by the ``batches`` probe
(:mod:`pytest_torchperf.probes.batches`) from the call to ``iter(loader)`` to
its first batch; a pass that starts a pool has the pool's start inside that
time (forking the workers, their ``worker_init_fn``, their copy of the dataset,
their first batch). The time a rebuilt pool lost is its pass's time to the
first batch less that of a pass that reused its pool (the median, when the
loader has one), else the whole of it (which then includes the first batch's
own loading, a small part when the pool's start is what is slow).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from time import perf_counter as _perf_counter
from typing import Any, Optional

from ..durations import format_seconds as fmt
from ..probes.batches import BatchesProbe, Pass
from ..text import plural

__all__ = ["RunClock", "first_batch_line", "first_batches", "pool_cost"]


class RunClock:
    """When the run and its Trainer calls began and ended (the denominator of "31% of the fit")."""

    def __init__(self) -> None:
        self.started = _perf_counter()
        self.ended: Optional[float] = None
        self.calls: list[list[Any]] = []  # [kind, start, end or None]

    def call(self, kind: str) -> None:
        self.calls.append([kind, _perf_counter(), None])

    def call_end(self) -> None:
        for call in reversed(self.calls):
            if call[2] is None:
                call[2] = _perf_counter()
                return

    def end(self) -> None:
        self.ended = _perf_counter()

    def whole(self) -> tuple[float, str]:
        """``(seconds, "of the fit")``: the Trainer calls' time when there were some, else the run's."""
        now = self.ended if self.ended is not None else _perf_counter()
        done = [c for c in self.calls if c[2] is not None]
        if done:
            total = sum(c[2] - c[1] for c in done)
            kinds = {c[0] for c in done}
            if kinds == {"fit"}:
                return total, "of the fit" if len(done) == 1 else f"of the {len(done)} fits"
            return total, "of the Trainer calls"
        return now - self.started, "of the watched run"


def first_batches(batches: BatchesProbe, loader: Any, since: float) -> list[Pass]:
    return [p for p in batches.passes_of(loader, since) if p.first is not None]


def pool_cost(
    passes: Sequence[Pass], extra: Sequence[Optional[Pass]], pools: int, clock: RunClock
) -> tuple[Optional[str], dict[str, Any]]:
    """The report's line (``4 worker pools started; 3 rebuilt, 2.9 s each (31% of the fit)``) and its figures.

    ``passes``: the timed passes of the loader (or of the loaders rebuilt from one line), read in ``on_run_end``;
    ``extra``: the passes in which the extra pools started (None: not timed); ``pools``: pools started in all.
    """
    reused = [p.first for p in passes if not p.new_pool and p.first is not None and not p.sanity]
    baseline = statistics.median(reused) if reused else None
    timed = [p for p in extra if p is not None and p.first is not None]
    lost = [max(p.first - (baseline or 0.0), 0.0) for p in timed]  # type: ignore[operator]
    whole, of = clock.whole()
    figures: dict[str, Any] = {
        "first_batch_s": [round(p.first, 4) for p in passes[:32] if p.first is not None],
        "first_batch_s_reused_pool": round(baseline, 4) if baseline is not None else None,
        "rebuilt_pool_s": round(statistics.median(lost), 4) if lost else None,
        "lost_s": round(sum(lost), 4) if lost else None,
        "lost_share": round(sum(lost) / whole, 4) if lost and whole > 0 else None,
    }
    if not lost:
        return None, figures
    share = f" ({sum(lost) / whole:.0%} {of})" if whole > 0 else ""
    rebuilt = len(extra)
    untimed = f" ({rebuilt - len(timed)} not timed)" if len(timed) < rebuilt else ""
    line = (
        f"{plural(pools, 'worker pool')} started; {rebuilt} rebuilt{untimed}, {fmt(statistics.median(lost))} each"
        f"{share}: {fmt(sum(lost))} lost"
    )
    if baseline is not None:
        line += f" (a pass that reused its pool reached its first batch in {fmt(baseline)})"
    else:
        line += " (each from the start of its pass to its first batch, that batch's own loading included)"
    return line, figures


def first_batch_line(passes: Sequence[Pass]) -> Optional[str]:
    """``time to the first batch: 0.31 s (epoch 0 (train)), 0.02 s (epoch 1 (train))``, at most 8 passes."""
    if not passes:
        return None
    shown = [f"{fmt(p.first or 0.0)} ({p.label})" for p in passes[:8]]
    more = f" and {len(passes) - 8} more" if len(passes) > 8 else ""
    return "time from the start of each pass to its first batch: " + ", ".join(shown) + more
