"""Values the pytest options and the marker share, in a module that imports nothing (read at start-up)."""

from __future__ import annotations

__all__ = [
    "OVERHEAD_INCONCLUSIVE",
    "OVERHEAD_MAX_ROUNDS",
    "OVERHEAD_MIN_ROUNDS",
    "OVERHEAD_ROUNDS",
    "SCOPES",
    "TRACE_STEPS",
]

#: Where the step checks apply.
SCOPES = ("training_step", "batch", "test")

#: ``overhead_rounds``: default, and the range it accepts (fewer than 4 rounds cannot bound a median).
OVERHEAD_ROUNDS = 10
OVERHEAD_MIN_ROUNDS = 4
OVERHEAD_MAX_ROUNDS = 1000
#: ``overhead_inconclusive``: what a ``max_overhead`` verdict that is neither a pass nor a fail does to the test.
OVERHEAD_INCONCLUSIVE = ("fail", "skip", "warn")
#: ``--torchperf-trace``: optimizer steps recorded per test.
TRACE_STEPS = 4
