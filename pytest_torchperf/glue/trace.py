"""``--torchperf-trace``: a ``torch.profiler`` Chrome trace of a failing test's first steps, findings marked.

pytest-free. The trace is *recorded* while the watched test runs, not taken
from a second run: a re-run could behave differently (a model fixture already
trained, files already written, a Lightning loader already warm) and would
run the test's side effects twice. Recording costs something on every watched
test while the option is on, so it is bounded: the profiler runs from the
start of the test body through the end of the :data:`STEPS`-th optimizer step
(a ``ProfilerStep#N`` range per step, the first one holding everything before
the first optimizer step: Trainer setup, the sanity check, worker start-up),
then stops; the rest of the test runs unprofiled. With no optimizer step
(a validation loop) the whole body is recorded. The trace is written only
when the test fails on a finding, and discarded otherwise.

Steps are counted with torch's global optimizer step hook, so plain loops and
Lightning fits alike are cut at the same place. Python frames are recorded
(``with_stack``), which is what lets each finding be marked where it
happened: a ``user_annotation`` range named ``torchperf <invariant>: ...``
over every recorded call of the function the finding points at, and one
instant event per finding at the start of the trace (searchable by name in
Perfetto). The file is ``<dir>/<test id>.pt.trace.json``: open it in
https://ui.perfetto.dev, ``chrome://tracing`` or TensorBoard's profiler plugin.

A test that runs ``torch.profiler`` itself (or Lightning's
``profiler="pytorch"``) cannot be traced: only one profiler can run at a time.
When the test starts one, the trace stops and gives way (its profiler runs as
it would have); when one is already running, no trace starts. Either way the
report says why there is no trace; the test itself is never affected.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..constants import TRACE_STEPS

if TYPE_CHECKING:
    from .baseline import Observation

__all__ = ["STEPS", "StepTrace", "trace_filename"]

#: Optimizer steps recorded per test.
STEPS = TRACE_STEPS
#: At most this many ranges are marked per finding.
MAX_MARKS = 50

#: The traces started, while they live.
_LIVE: weakref.WeakSet[StepTrace] = weakref.WeakSet()
_PY_EVENT = re.compile(r"^(?P<path>.*)\((?P<line>\d+)\): (?P<function>.+)$")


def trace_filename(nodeid: str) -> str:
    """A file name for a test id: readable, unique, safe on every file system."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", nodeid).strip("_")
    digest = hashlib.sha1(nodeid.encode("utf-8")).hexdigest()[:8]
    return f"{safe[:120]}-{digest}.pt.trace.json"


def recording() -> bool:
    """Whether a trace of torchperf's own is recording now (``no_debug_modes`` does not count its profiler)."""
    return any(t._prof is not None and not t._done and t.error is None for t in _LIVE)


class StepTrace:
    """Records the first :data:`STEPS` optimizer steps of a test body; never raises into the test."""

    def __init__(self, steps: int = STEPS) -> None:
        self.steps = steps
        self.recorded_steps = 0
        self.error: Optional[str] = None
        self._prof: Any = None
        self._hook: Any = None
        self._unguard: Optional[Callable[[], None]] = None
        self._done = False

    # -- recording -----------------------------------------------------------------------------------
    def _schedule(self, step: int) -> Any:
        from torch.profiler import ProfilerAction

        if step < self.steps - 1:
            return ProfilerAction.RECORD
        if step == self.steps - 1:
            return ProfilerAction.RECORD_AND_SAVE
        return ProfilerAction.NONE

    def _ready(self, prof: Any) -> None:
        self._done = True

    def start(self) -> None:
        try:
            import torch
            from torch.profiler import ProfilerActivity, profile

            if _profiler_running(torch):  # another profiler is running: never fight it
                self.error = "a profiler was already running"
                return
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            from torch.optim.optimizer import register_optimizer_step_post_hook

            prof = profile(activities=activities, schedule=self._schedule, on_trace_ready=self._ready, with_stack=True)
            prof.start()
            self._prof = prof
            _LIVE.add(self)
            self._hook = register_optimizer_step_post_hook(self._on_optimizer_step)
            self._guard(torch)
        except Exception as exc:  # a trace is a help, never a reason for the test to fail
            self.error = f"the profiler could not start: {exc!r}"
            self.stop()
            self._prof = None

    def _on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        # Never removes itself: torch is iterating over the global hooks now (another one may come after this
        # one, and a removal would break that iteration); stop() removes it.
        prof = self._prof
        if prof is None or self._done:
            return
        try:
            self.recorded_steps += 1
            prof.step()
        except Exception as exc:
            self.error = f"the profiler failed: {exc!r}"
            self._done = True

    def _guard(self, torch: Any) -> None:
        """Give way to a profiler the test starts itself: torch runs one at a time, and exporting a trace
        whose session another profiler ended crashes the process."""
        cls = torch.autograd.profiler.profile
        original = getattr(cls, "_prepare_trace", None)
        if original is None:
            return
        trace = self

        def _prepare_trace(profiler: Any, *args: Any, **kwargs: Any) -> Any:
            ours = trace._prof
            if ours is not None and profiler is not getattr(ours, "profiler", None):
                trace._abandon("the test started a profiler of its own")
            return original(profiler, *args, **kwargs)

        cls._prepare_trace = _prepare_trace

        def restore() -> None:
            if cls.__dict__.get("_prepare_trace") is _prepare_trace:
                cls._prepare_trace = original

        self._unguard = restore

    def _abandon(self, reason: str) -> None:
        self.error = reason
        self._remove_hook()
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                prof.stop()
            except Exception:
                pass

    def _remove_hook(self) -> None:
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()

    def stop(self) -> None:
        self._remove_hook()
        unguard, self._unguard = self._unguard, None
        if unguard is not None:
            unguard()
        prof = self._prof
        if prof is None:
            return
        try:
            prof.stop()
        except Exception as exc:
            self.error = f"the profiler failed to stop: {exc!r}"
            self._prof = None

    @property
    def recorded(self) -> bool:
        return self._prof is not None and self.error is None

    # -- writing -------------------------------------------------------------------------------------
    def save(self, directory: str, nodeid: str, observations: Sequence[Observation]) -> Optional[str]:
        """Write the trace with ``observations`` marked; returns its path (None, with ``error`` set, if it cannot)."""
        if not self.recorded:
            return None
        path = os.path.join(directory, trace_filename(nodeid))
        try:
            os.makedirs(directory, exist_ok=True)
            fd, raw = tempfile.mkstemp(suffix=".json", dir=directory)
            os.close(fd)
            try:
                self._prof.export_chrome_trace(raw)
                with open(raw, encoding="utf-8") as fh:
                    doc = json.load(fh)
            finally:
                os.unlink(raw)
            mark(doc, nodeid, observations)
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w", encoding="utf-8") as fh:
                json.dump(doc, fh)
            os.replace(tmp, path)
        except Exception as exc:
            self.error = f"the trace could not be written: {exc!r}"
            return None
        finally:
            self.discard()
        return path

    def discard(self) -> None:
        self._remove_hook()
        self._prof = None


def _profiler_running(torch: Any) -> bool:
    enabled = getattr(torch.autograd, "_profiler_enabled", None)
    if enabled is not None and enabled():
        return True
    return bool(getattr(torch.autograd.profiler, "_is_profiler_enabled", False))


def _matches(event_path: str, function: str, obs_file: str, obs_function: str) -> bool:
    if function != obs_function or not obs_file:
        return False
    a = event_path.replace("\\", "/").split("/")
    b = obs_file.replace("\\", "/").split("/")
    n = min(len(a), len(b))
    return a[-n:] == b[-n:]


def mark(doc: dict[str, Any], nodeid: str, observations: Sequence[Observation]) -> int:
    """Add a ``user_annotation`` per finding to a Chrome trace document; returns the ranges added."""
    events: list[dict[str, Any]] = doc.setdefault("traceEvents", [])
    python_calls = []
    first: Optional[dict[str, Any]] = None
    for event in events:
        if event.get("ph") != "X":
            continue
        if first is None or event.get("ts", 0) < first.get("ts", 0):
            first = event
        if event.get("cat") == "python_function":
            m = _PY_EVENT.match(str(event.get("name", "")))
            if m:
                python_calls.append((m.group("path"), m.group("function"), event))
    added = []
    for obs in observations:
        name = f"torchperf {obs.invariant}: {obs.label or obs.title} at {obs.where}"
        args = {"test": nodeid, "finding": obs.title, "site": obs.where, "source": obs.source, "count": obs.count}
        if obs.per_step is not None:
            args["per_step"] = obs.per_step
        targets = [(obs.file, obs.function)]
        if obs.user_frame is not None:
            targets.append((obs.user_frame[0], obs.user_frame[2]))
        for target_file, target_function in targets:
            hits = [e for p, f, e in python_calls if _matches(p, f, target_file, target_function)][:MAX_MARKS]
            for e in hits:
                added.append(
                    {
                        "ph": "X", "cat": "user_annotation", "name": name, "pid": e.get("pid"), "tid": e.get("tid"),
                        "ts": e.get("ts"), "dur": e.get("dur", 0), "args": args,
                    }
                )
            if hits:
                break
        if first is not None:
            added.append(
                {
                    "ph": "i", "s": "g", "cat": "user_annotation", "name": name, "pid": first.get("pid"),
                    "tid": first.get("tid"), "ts": first.get("ts"), "args": args,
                }
            )
    events.extend(added)
    doc["torchperf"] = {"test": nodeid, "findings": [o.to_entry() for o in observations]}
    return sum(1 for e in added if e["ph"] == "X")
