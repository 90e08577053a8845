"""The bottom of torchperf: the runs that are watching, the switches probes read, and event dispatch.

Every other module builds on this one and it imports none of them but the
report types. A :class:`Run` is one watched block; while it is *active* the
probes (:mod:`pytest_torchperf.probes`) forward what they see to its checks
through :meth:`Run.handlers` / :func:`handlers`. A check is any object with a
``result()`` method (see :class:`Check`); it receives an event by defining a
method of the event's name (:data:`EVENTS` lists the built-in ones).

Hot paths read two module-level switches, :data:`FLAGS` ``.active`` (some run
is watching) and ``.in_scope`` (some run's step checks apply right now), one
attribute load each. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Iterator
from typing import Any, Callable, Optional

from .report import NOT_CHECKED, CheckResult, Report

if sys.version_info >= (3, 11):
    from operator import call as _call_read  # the step polls' reads, called from C
else:  # pragma: no cover - Python 3.9 and 3.10

    def _call_read(read: Callable[[], object]) -> object:
        return read()

__all__ = [
    "EVENTS",
    "Events",
    "FLAGS",
    "Check",
    "Run",
    "active_runs",
    "handlers",
    "notify",
    "probe_failed",
    "runs_in_scope",
    "suspended",
]

class Events:
    """The events the built-in probes send: each a method whose signature is what a check's handler of that
    name receives (checked when an invariant is registered) and whose docstring says when it is sent.
    """

    def on_framework_call(self, call: Any) -> None:
        """a framework's training call begins (Lightning's Trainer.fit/validate/test/predict, the Hugging Face
        Trainer.train, Ignite's Engine.run): a frameworks._calls.FrameworkCall (framework, kind, trainer, model,
        package, args, kwargs)"""

    def on_framework_call_end(self, call: Any) -> None:
        """that call returned or raised"""

    def on_step_start(self) -> None:
        """a training step begins (a LightningModule.training_step, or `with run.step():`)"""

    def on_step_end(self) -> None:
        """that training step ended"""

    def on_optimizer_step(self, optimizer: Any) -> None:
        """an optimizer stepped (after its step)"""

    def on_sync(self, event: Any) -> None:
        """an operation that synchronises the host with the device, inside the scope"""

    def on_move(self, event: Any) -> None:
        """a host-built tensor (or, on an accelerator, any host tensor) moved to a device"""

    def on_backward_sample(self, roots: Any) -> None:
        """a sampled backward pass is about to run from these graph nodes (probe graphs)"""

    def on_dataloader_pass(self, loader: Any) -> None:
        """a pass (an epoch) over a DataLoader begins (probe iterators)"""

    def on_worker_pool(self, kind: Any, loader: Any, stack: Any, how: Any) -> None:
        """a worker pool started, an iterator dropped, a pool shut down"""

    def on_empty_cache(self, stack: Any) -> None:
        """torch.cuda.empty_cache() was called (probe cuda_cache)"""

    def on_autocast(self, device: Any, dtype: Any) -> None:
        """an enabled torch.autocast region was entered (probe autocast)"""

    def on_zero_grad(self, owner: Any, stack: Any) -> None:
        """zero_grad(set_to_none=False) was called (probe grads)"""

    def on_grad_zeroed(self, shape: Any, stack: Any) -> None:
        """a parameter's gradient was zeroed in place (probe grads)"""

    def on_compile(self) -> None:
        """torch.compile started compiling a frame (probe recompiles)"""

    def on_recompile(self, code: Any, reasons: Any, stack: Any) -> None:
        """dynamo recompiled a function, with the guards that failed"""

    def on_recompile_limit(self, name: Any) -> None:
        """dynamo hit its recompile limit (the name of the limit)"""

    def on_data_parallel_forward(self, module: Any, stack: Any) -> None:
        """a torch.nn.DataParallel forward pass (stack: a callable)"""

    def on_ddp_forward(self, ddp: Any) -> None:
        """a DistributedDataParallel forward pass (probe ddp)"""

    def on_ddp_armed(self, reducer: Any) -> None:
        """DDP's reducer was prepared for a backward: one all-reduce round armed"""

    def on_dynamo_reset(self) -> None:
        """torch._dynamo.reset() emptied dynamo's caches (probe recompiles)"""

    def on_graph_break(self, event: Any) -> None:
        """dynamo took a graph break while compiling (probe graph_breaks: a GraphBreak)"""

    def on_compiled_code_run(self, codes: Any, breaks: Any) -> None:
        """a compiled function was called in a step, the first time in the run: the code objects dynamo holds
        compiled code for, and the GraphBreaks in it (probe graph_breaks)"""

    def on_run_end(self) -> None:
        """the run stops, its probes still installed (read probe state here, not in result())"""

    def on_batch_start(self) -> None:
        """a Lightning train batch begins (only for runs with `wants_batches`, see Run)"""

    def on_batch_end(self) -> None:
        """that train batch ended"""

    def on_collective(self, kind: Any, nbytes: Any, frame: Any) -> None:
        """a torch.distributed collective was called (probe collectives)"""

    def on_ddp_buffers(self, ddp: Any) -> None:
        """DDP is about to broadcast its module buffers before a forward (probe collectives)"""

    def on_fsdp_forward(self, group: Any) -> None:
        """an FSDP2 parameter group ran its pre-forward (probe fsdp)"""

    def on_fsdp_reduce(self, group: Any, reduces: Any) -> None:
        """an FSDP2 parameter group's post-backward (reduces: it reduce-scatters)"""

    def on_data_parallel_used(self, module: Any, function: Any, stack: Any) -> None:
        """a torch.nn.DataParallel (subclass) driven through another method than DataParallel.forward
        (mmcv's train_step): its .module read there (stack: a callable)"""

    def on_data_parallel_created(self, module: Any) -> None:
        """a torch.nn.DataParallel (subclass) was built while watched"""


def _described(method: Callable[..., Any]) -> str:
    """``"(a, b): what it means"``: an event as the reference page and error messages show it."""
    params = list(inspect.signature(method).parameters)[1:]
    return f"({', '.join(params)}): {' '.join((method.__doc__ or '').split())}"


#: The events the built-in probes send, and what a check's method of that name receives (from :class:`Events`).
EVENTS: dict[str, str] = {
    name: _described(method) for name, method in vars(Events).items() if name.startswith("on_")
}


class _Flags:
    """Global switches read on the probes' hot paths (one attribute load each).

    Kept current by every scope transition of every run; a probe that only
    matters inside a step returns at once while ``in_scope`` is False.

    One instance with slots, not class attributes: setting an attribute of a
    class (twice a step) invalidates CPython's type caches, so every read of it
    on the hot paths lost its specialised attribute load.
    """

    __slots__ = ("active", "in_scope", "listeners")

    def __init__(self) -> None:
        #: Some run is watching.
        self.active = False
        #: Some active run's step checks apply right now (see :attr:`Run.in_scope`).
        self.in_scope = False
        #: Called with the new ``in_scope`` value whenever it changes (probes add and remove their own).
        self.listeners: list[Callable[[bool], None]] = []


FLAGS = _Flags()

_ACTIVE: list[Run] = []


def active_runs() -> list[Run]:
    """The runs currently watching, outermost first (probes dispatch to all of them). Do not modify."""
    return _ACTIVE


def runs_in_scope() -> list[Run]:
    """The active runs whose step checks apply right now."""
    return [run for run in _ACTIVE if run.in_scope]


def handlers(event: str, in_scope: bool = False) -> list[Callable[..., Any]]:
    """Every active run's check methods named ``event`` (only runs in scope, with ``in_scope``)."""
    out: list[Callable[..., Any]] = []
    for run in runs_in_scope() if in_scope else _ACTIVE:
        if run._active:
            out.extend(run.handlers(event))
    return out


def notify(event: str, *args: Any, in_scope: bool = False) -> None:
    """Call ``event(*args)`` on the checks of every active run (only runs in scope, with ``in_scope``).

    A check that raises is that check's problem, never the user's: the error
    is kept on its run and the check's verdict becomes "not checked".
    """
    for handler in handlers(event, in_scope):
        try:
            handler(*args)
        except Exception as exc:  # noqa: BLE001 - a check's bug must not break the user's code
            check = getattr(handler, "__self__", None)
            name = getattr(check, "name", "?")
            for run in _ACTIVE:
                if run.checks.get(name) is check:
                    run.check_failed(name, exc)


#: Set by :mod:`pytest_torchperf.watching`: removes a failed probe (and the probes that need it).
_probe_remover: list[Callable[[str], None]] = []


def probe_failed(probe: str, exc: BaseException) -> None:
    """A probe's own code raised: record it on every active run and take the probe out.

    Called by a probe's wrapper instead of letting the exception reach the
    user's code; the user's operation then runs as if nothing watched it. The
    invariants that need the probe report "not checked" with the error.
    Never raises.
    """
    try:
        message = f"{type(exc).__name__}: {exc}"
        for run in _ACTIVE:
            run.internal_errors.setdefault(probe, message)
        for remove in _probe_remover:
            remove(probe)
    except Exception:  # noqa: BLE001 - the last line of defence
        pass


@contextlib.contextmanager
def suspended() -> Iterator[list[Run]]:
    """Hide the active runs from the probes inside the block; yields the runs hidden.

    For torchperf's own work while a run is still active (the ``max_overhead``
    replay of a run nested in another): the probes stay installed, but no run
    records what they see.
    """
    hidden = list(_ACTIVE)
    _ACTIVE.clear()
    _refresh_flags()
    try:
        yield hidden
    finally:
        _ACTIVE[:] = hidden
        _refresh_flags()


def _refresh_flags() -> None:
    FLAGS.active = any(run._active for run in _ACTIVE)
    _refresh_scope()


def _refresh_scope() -> None:
    """Set ``FLAGS.in_scope`` to whether some active run is in scope now (:attr:`Run.in_scope`), telling
    the listeners when it changes. Called after every change of a run's state that the rule reads."""
    now = False
    for run in _ACTIVE:
        if run.in_scope:
            now = True
            break
    if now is not FLAGS.in_scope:
        FLAGS.in_scope = now
        if FLAGS.listeners:
            for listener in list(FLAGS.listeners):
                listener(now)


class Check:
    """Base class of an invariant's per-run state and verdict (built-in and third-party alike).

    One instance per run that checks the invariant, built as ``cls(run)``.
    Define ``result() -> CheckResult``, and a method per event to receive
    (:data:`EVENTS`: ``on_step_end(self)``, ``on_optimizer_step(self, optimizer)``...).
    ``result()`` runs after the run stopped and its probes were removed:
    read what a probe holds in ``on_run_end``, not there.
    """

    #: The invariant's name; set from its declaration when the registry builds the check.
    name: str = ""

    def __init__(self, run: Run) -> None:
        self.run = run

    @property
    def settings(self) -> Any:
        """This invariant's settings, a frozen object (``self.settings.max_syncs_per_step``)."""
        own = self.__dict__.get("_settings")
        if own is None:
            name = self.name or getattr(self.run, "_building", "")
            own = self.__dict__["_settings"] = self.run.options.settings(name)
        return own

    @settings.setter
    def settings(self, value: Any) -> None:  # a check of today's API may keep its own ``settings``
        self.__dict__["_settings"] = value

    def step_polls(self) -> tuple[tuple[Callable[[], object], Callable[[], None]], ...]:
        """State read at the start of every training step: ``(read, hit)`` pairs, asked once, when the run starts.

        The run calls each ``read()`` as a step begins and ``hit()`` when it returned true. For a
        check that samples a switch every step, ``read`` is torch's own C function
        (``torch.is_anomaly_enabled``): a few hundred instructions a step, where an ``on_step_start``
        method is a Python call (with its own reads) every step. An error is the check's: "not checked".
        A read only reads: at a step where another check's read raised, it may be called again.
        """
        return ()

    def result(self) -> CheckResult:  # pragma: no cover - abstract
        raise NotImplementedError


class Run:
    """One watched block: its options, its step counter, its checks and, at the end, its report.

    What probes and checks may read: :attr:`steps`, :attr:`batches`,
    :attr:`active`, :attr:`in_scope`, :attr:`in_step`, :attr:`scope`,
    :attr:`unit`, :attr:`units`, :meth:`check` and :meth:`probe`.
    """

    def __init__(self, options: Any) -> None:
        self.options = options
        self.report: Optional[Report] = None
        #: Training steps seen: ``training_step`` calls of observed fits plus ``run.step()`` blocks.
        self.steps = 0
        #: Batches seen: Lightning train batches plus ``run.step()`` blocks.
        self.batches = 0
        #: Invariant name -> its check; filled by whoever builds the run (see ``watch``).
        self.checks: dict[str, Any] = {}
        #: Probe name -> the error that took it out during this run.
        self.internal_errors: dict[str, str] = {}
        #: Invariant name -> the probes it needed (for "not checked" when one of them failed).
        self.probes_of: dict[str, tuple[str, ...]] = {}
        #: Probe name -> the instance the engine installed for this run (set when it starts; :meth:`probe`).
        self.probes: dict[str, Any] = {}
        #: The engine that started the run (:class:`pytest_torchperf.engine.Engine`): ``run.engine.probe(name)``
        #: is its instance of any probe, installed for this run or not. None until the run starts.
        self.engine: Any = None
        self._scope: str = getattr(options, "scope", "training_step")
        self._step_depth = 0
        self._batch_depth = 0
        self._active = False
        self._handlers: dict[str, tuple[Callable[..., Any], ...]] = {}
        #: The checks' ``on_step_start`` / ``on_step_end`` methods (read by every step: set when the run starts).
        self._step_events: tuple[tuple[Callable[..., Any], ...], tuple[Callable[..., Any], ...]] = ((), ())
        #: The checks' :meth:`Check.step_polls`, with each check's name: ``(read, hit, name)``.
        self._polls: tuple[tuple[Callable[[], object], Callable[[], None], str], ...] = ()
        #: Their reads alone, called in one C-level pass (``_poll``).
        self._poll_reads: tuple[Callable[[], object], ...] = ()
        #: What ``step()`` returns: stateless, so one serves every step (and nested steps).
        self._step_block = _Step(self)
        #: Automatic steps (:mod:`pytest_torchperf.autosteps`) while the run is armed for them.
        self._auto: Any = None
        #: A check needs Lightning's batch boundaries whatever the scope (``on_batch_start`` / ``on_batch_end``).
        self.wants_batches = False
        self._batch_events = False

    # -- what probes and checks read ---------------------------------------------------
    @property
    def active(self) -> bool:
        """Between the start and the end of the watched block."""
        return self._active

    @property
    def scope(self) -> str:
        """Where step checks apply: ``training_step``, ``batch`` or ``test``."""
        return self._scope

    @property
    def in_step(self) -> bool:
        """Inside a training step now."""
        return self._step_depth > 0

    @property
    def in_scope(self) -> bool:
        """Whether step checks apply right now: the run is active and inside a step, or its ``scope`` option
        widens that to the whole test, or to every batch. (The one statement of the rule.)"""
        if not self._active:
            return False
        if self._step_depth:
            return True
        return self._scope == "test" or (self._scope == "batch" and self._batch_depth > 0)

    @property
    def unit(self) -> Optional[int]:
        """The step (for scope ``batch``: the batch) an event now belongs to; None between steps."""
        if self._step_depth == 0 and self._batch_depth == 0:
            return None
        return self.batches if self._scope == "batch" else self.steps

    @property
    def units(self) -> int:
        """Steps (for scope ``batch``: batches) seen so far."""
        return self.batches if self._scope == "batch" else self.steps

    @property
    def unit_name(self) -> str:
        return "batch" if self._scope == "batch" else "step"

    def probe(self, name: str) -> Any:
        """The probe ``name`` the engine installed for this run's invariants (a check asks its run for it)."""
        try:
            return self.probes[name]
        except KeyError:
            installed = sorted(self.probes)
            raise KeyError(f"probe {name!r} was not installed for this run; its probes: {installed}") from None

    def check(self, name: str) -> Optional[Any]:
        """This run's check of invariant ``name``, or None when it does not check it."""
        return self.checks.get(name)

    def handlers(self, event: str) -> tuple[Callable[..., Any], ...]:
        """The methods named ``event`` of this run's checks (cached: the checks do not change)."""
        found = self._handlers.get(event)
        if found is None:
            found = tuple(
                getattr(check, event) for check in self.checks.values() if callable(getattr(check, event, None))
            )
            self._handlers[event] = found
        return found

    def notify(self, event: str, *args: Any) -> None:
        """Call ``event(*args)`` on this run's checks that define it."""
        self._call(self.handlers(event), args)

    def _call(self, handlers: tuple[Callable[..., Any], ...], args: tuple[Any, ...] = ()) -> None:
        for handler in handlers:
            try:
                handler(*args)
            except Exception as exc:  # noqa: BLE001 - see notify()
                self.check_failed(getattr(getattr(handler, "__self__", None), "name", "?"), exc)

    def check_failed(self, name: str, exc: BaseException) -> None:
        """A check's own code raised while handling an event: its verdict becomes "not checked"."""
        self.internal_errors.setdefault(f"check {name}", f"{type(exc).__name__}: {exc}")

    # -- steps and batches ----------------------------------------------------------------
    def step(self) -> _Step:
        """Mark one training step of a plain PyTorch loop: ``with run.step(): ...``."""
        return self._step_block

    def step_started(self) -> None:
        depth = self._step_depth
        if not depth:
            self.steps += 1
        self._step_depth = depth + 1
        _refresh_scope()
        if not depth:
            if self._poll_reads:
                self._poll()
            if self._step_events[0]:
                self._call(self._step_events[0])

    def _poll(self) -> None:
        """Every step poll's ``read()`` in one pass, then ``hit()`` where it returned true."""
        try:
            values = tuple(map(_call_read, self._poll_reads))
        except Exception:  # noqa: BLE001 - a read failed: read them one at a time
            self._poll_each()
            return
        if any(values):
            self._hits(values)

    def _hits(self, values: tuple[object, ...]) -> None:
        """``hit()`` of each poll whose read returned true (``values``, in the order of ``_polls``)."""
        for (_read, hit, name), value in zip(self._polls, values):
            if value:
                try:
                    hit()
                except Exception as exc:  # noqa: BLE001 - see notify()
                    self.check_failed(name, exc)

    def _poll_each(self) -> None:
        """The polls one at a time, after a read raised: that check's error recorded, the others polled."""
        for read, hit, name in self._polls:
            try:
                if read():
                    hit()
            except Exception as exc:  # noqa: BLE001 - see notify()
                self.check_failed(name, exc)

    def step_ended(self) -> None:
        depth = self._step_depth - 1
        self._step_depth = depth if depth > 0 else 0
        _refresh_scope()
        if depth == 0 and self._step_events[1]:
            self._call(self._step_events[1])

    def next_step(self) -> None:
        """End the one open step and begin the next at once: an automatic step's boundary.

        With no check listening to a step's start or end, the scope, which would
        leave and come back with nothing in between, is left as it is (its
        listeners follow a state: they would undo and redo it).
        """
        if self._step_depth != 1 or self._step_events[0] or self._step_events[1]:
            self.step_ended()
            self.step_started()
            return
        self.steps += 1
        if self._poll_reads:
            self._poll()

    def batch_started(self) -> None:
        started = self._batch_depth == 0
        if started:
            self.batches += 1
        self._batch_depth = 1
        _refresh_scope()
        if started and self._batch_events:
            self.notify("on_batch_start")

    def batch_ended(self) -> None:
        ended = self._batch_depth > 0
        self._batch_depth = 0
        _refresh_scope()
        if ended and self._batch_events:
            self.notify("on_batch_end")

    # -- lifecycle (driven by ``watch``) ----------------------------------------------------
    def enlist(self) -> None:
        """Join the active runs, not watching yet: errors of probes being installed for it are recorded."""
        if self not in _ACTIVE:
            _ACTIVE.append(self)

    def start(self) -> None:
        self.enlist()
        self._handlers.clear()
        self._step_events = (self.handlers("on_step_start"), self.handlers("on_step_end"))
        polls: list[tuple[Callable[[], object], Callable[[], None], str]] = []
        for name, check in self.checks.items():
            step_polls = getattr(check, "step_polls", None)  # a check need not derive from Check
            if step_polls is None:
                continue
            try:
                polls.extend((read, hit, name) for read, hit in step_polls())
            except Exception as exc:  # noqa: BLE001 - see notify()
                self.check_failed(name, exc)
        self._polls = tuple(polls)
        self._poll_reads = tuple(read for read, _hit, _name in polls)
        self._batch_events = bool(self.handlers("on_batch_start") or self.handlers("on_batch_end"))
        self._active = True
        _refresh_flags()

    def stop(self) -> None:
        """Stop watching; checks see ``on_run_end`` while the probes are still installed."""
        if self._active:
            self.notify("on_run_end")
        self._active = False
        _refresh_flags()  # before the probes are undone: scope listeners restore what they changed
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def finish(self) -> Report:
        """Evaluate every check and store the :class:`Report` on ``run.report``."""
        report = Report(
            steps=self.steps, scope=self.scope, on_inconclusive=getattr(self.options, "overhead_inconclusive", "fail")
        )
        for name, check in self.checks.items():
            report.checks[name] = self._result(name, check)
        report.internal_errors = dict(self.internal_errors)
        self.report = report
        return report

    def _result(self, name: str, check: Any) -> CheckResult:
        broken = [(p, self.internal_errors[p]) for p in self.probes_of.get(name, ()) if p in self.internal_errors]
        own = self.internal_errors.get(f"check {name}")
        if own is not None:
            broken.append((f"check {name}", own))
        if not broken:
            try:
                result: CheckResult = check.result()
                return result
            except Exception as exc:  # noqa: BLE001 - a torchperf bug must not decide the test
                broken.append((f"check {name}", f"{type(exc).__name__}: {exc}"))
        where, message = broken[0]
        what = where if where.startswith("check ") else f"probe {where}"
        summary = f"torchperf internal error in {what}: {message}; the check is not checked"
        return CheckResult(name, NOT_CHECKED, summary)

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self.report else "idle")
        return f"<torchperf Run {state} steps={self.steps} checks={list(self.checks)}>"


class _Step:
    """The context manager of :meth:`Run.step`: a step, inside a batch of its own unless one is open."""

    __slots__ = ("run",)

    def __init__(self, run: Run) -> None:
        self.run = run

    def __enter__(self) -> Run:
        run = self.run
        if not run._active:
            raise RuntimeError("run.step() used outside its `with torchperf.watch()` block")
        if not run._batch_depth:
            run.batches += 1
            run._batch_depth = 1
        run.step_started()
        return run

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        run = self.run
        run._batch_depth = 0  # a step closes its batch: out of a "batch" scope too
        run.step_ended()
