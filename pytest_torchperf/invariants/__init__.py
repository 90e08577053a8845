"""The built-in invariants, one module each: its declaration (``INVARIANT``) and its check.

The registry (:mod:`pytest_torchperf.registry`) loads them by name; what each
one listens to is in :mod:`pytest_torchperf.probes`.
"""
