"""The ``max_overhead`` check (its declaration is :mod:`pytest_torchperf.invariants.max_overhead`)."""
