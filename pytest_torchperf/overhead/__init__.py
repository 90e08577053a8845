"""Invariant ``max_overhead``: a Lightning fit's epoch time within N% of the vanilla loop derived from its module.

When an observed ``Trainer.fit`` starts, the check deep-copies the module
(its initial weights) and remembers how the Trainer was built and how ``fit``
was called. After the run, in ``result()`` (no torchperf probe is installed
any more), it replays the fit once with a Trainer built from the same
arguments and, at that fit's epoch boundaries, runs epochs of the vanilla
loop (:class:`~pytest_torchperf.timing.VanillaLoop`) on a second copy of the
module. Lightning epochs (L) and vanilla epochs (V) thus alternate in one
process, on the same device, data, thread count and global torch flags::

    L0 (warm-up, profiled) | Vwarm V1 | L1 | L2 | V2 V3 | L3 | L4 | V4 V5 | L5 ...

L0 ends after :data:`~.replay.LIGHTNING_WARMUP_BATCHES` batches where the
epoch's length is known beforehand (the module's ``on_train_batch_start``,
wrapped on the replay's own copy for that epoch, returns -1); Vwarm is a few
batches. Round r pairs L_r with the adjacent V_r (V first in odd rounds, L first in
even ones). A Lightning epoch is timed from the end of one
``on_train_epoch_start`` boundary to the start of the next, so every per-epoch
cost Lightning has is inside it; vanilla epochs run outside that window.

Each timed epoch, L and V alike, trains only its first m of the epoch's n
batches (:func:`~.replay.timed_batches`: about n / 2, in whole accumulation
windows of k batches, at least 4 and two windows) and counts as the whole
epoch (:class:`~pytest_torchperf.timing.clock.EpochWatch`): its own time, in
which each per-epoch cost (the epoch's hooks, a new DataLoader iterator, worker
start-up) falls once as in the user's fit, plus the n - m batches it did not
train at the per-batch rate of that same epoch's batches 1 to m - k. The
replay's Trainer gets ``limit_train_batches=m``, so Lightning ends the epoch
as it ends a whole one, after its last batch (a -1, as for L0, would leave the
fetch and the start of a batch it never trains inside the window: 0.7 and
2.1 ms of CPU, 0.5% and 0.9% of an epoch, in the far and heavy cases of
``benchmarks/bench_overhead_load.py`` on a loaded machine). Epochs are whole
where n is unknown beforehand (an iterable dataset without a length), where m
would not be fewer, and on a GPU (CUDA event time: a reading mid-epoch would
drain the queue). Shorter epochs make a clear case cheaper (about warm-up + L
+ V for two rounds, not warm-up + 2 L + 2 V) and rounds noisier: the spread of
a round's ratio measured 1.3-1.4 times that of whole epochs (0.065 against
0.047 on a tiny model, 0.040 against 0.030 on a heavy step; quiet machine),
which the early look's own spread terms and the later looks' intervals take in.

Both sides are timed by :class:`~pytest_torchperf.timing.Stopwatch`: CUDA
events on a GPU; on a CPU, with one torch thread on both sides, wall time
less the thread's waits for a CPU. Rounds stop as
:class:`~pytest_torchperf.timing.Rounds` decides; the verdict comes from the
95% interval of the overhead (paired ratios balanced over their order):
passed below ``max_overhead``, failed above, inconclusive when it still
straddles it after ``overhead_rounds``.

Modules: :mod:`.check` (the verdict), :mod:`.replay` (what the fit leaves to
replay, and the replay), :mod:`.attribution` (where the extra time went).

The replay differs from the user's fit only where timing needs it, and the
report says so: no validation and no sanity check (``limit_val_batches=0``,
``num_sanity_val_steps=0``: the vanilla loop has no validation either), no
checkpointing (``enable_checkpointing=False``; ModelCheckpoint and
EarlyStopping removed), no model summary, files under a temporary directory,
and torchperf's profiler. Where the extra time went comes from Lightning's own
profiler actions (``[Callback]X.on_train_batch_end``, ...) recorded during the
untimed warm-up epoch, from its second batch on where its length is known (the first carries one-time costs).
"""

from __future__ import annotations

from .check import NAME, OverheadCheck

__all__ = ["NAME", "OverheadCheck"]
