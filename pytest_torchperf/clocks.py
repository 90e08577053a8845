"""The clock functions the plugin reads, bound once, when the package is imported.

A test may patch ``time.perf_counter`` or ``time.monotonic`` (``mock.patch(
"time.perf_counter", side_effect=[...])``, Lightning's ThroughputMonitor tests
do): reading ``time.perf_counter`` at call time inside a watch would consume
the test's values and change what the test sees. Every module of the plugin
reads its clocks from here instead. The package imports this module first,
so the functions are bound before any test runs.
"""

from __future__ import annotations

import time

__all__ = ["monotonic", "perf_counter", "process_time", "sleep", "thread_time", "wall_time"]

perf_counter = time.perf_counter
monotonic = time.monotonic
process_time = time.process_time
thread_time = time.thread_time
#: ``time.time``.
wall_time = time.time
sleep = time.sleep
