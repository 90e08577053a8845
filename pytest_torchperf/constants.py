"""Values the pytest options and the marker share, in a module that imports nothing (read at start-up)."""

from __future__ import annotations

__all__ = [
    "BUILTIN_INVARIANTS",
    "INVARIANTS_ENTRY_POINT_GROUP",
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

#: The built-in invariants (``registry.BUILTIN``), in the order reports list them (their modules' names in
#: ``pytest_torchperf.invariants``).
BUILTIN_INVARIANTS = (
    "no_host_sync",
    "on_device",
    "no_iterator_reset",
    "max_overhead",
    "min_workers",
    "pin_memory",
    "no_empty_cache",
    "no_data_parallel",
    "grads_set_to_none",
    "no_recompiles",
    "mixed_precision",
    "no_graph_retention",
    "max_memory_growth",
    "no_unused_parameters_search",
    "no_sync_accumulation",
    "no_graph_breaks",
    "no_debug_modes",
    "gpu_settings",
    "no_oversubscription",
    "max_ops_per_step",
    "max_collectives_per_step",
    "no_constant_buffer_broadcast",
    "max_data_wait",
    "cuda_graph_ready",
    "copy_hygiene",
)

#: The entry point group other packages declare invariants in (``registry.ENTRY_POINT_GROUP``).
INVARIANTS_ENTRY_POINT_GROUP = "pytest_torchperf.invariants"
