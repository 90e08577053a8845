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

Round r pairs L_r with the adjacent V_r (V first in odd rounds, L first in
even ones). A Lightning epoch is timed from the end of one
``on_train_epoch_start`` boundary to the start of the next, so every per-epoch
cost Lightning has is inside it; vanilla epochs run outside that window.
Both sides are timed by :class:`~pytest_torchperf.timing.Stopwatch` (CUDA
synchronised, less the thread's waits for a CPU). Rounds stop as
:class:`~pytest_torchperf.timing.Rounds` decides; the verdict is the median
paired ratio against ``1 + max_overhead``.

The replay differs from the user's fit only where timing needs it, and the
report says so: no validation and no sanity check (``limit_val_batches=0``,
``num_sanity_val_steps=0``: the vanilla loop has no validation either), no
checkpointing (``enable_checkpointing=False``; ModelCheckpoint and
EarlyStopping removed), no model summary, files under a temporary directory,
and torchperf's profiler. Where the extra time went comes from Lightning's own
profiler actions (``[Callback]X.on_train_batch_end``, ...) recorded during the
untimed warm-up epoch.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import logging
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Optional

from .. import lightning
from ..watch import suspended
from ..timing import (
    WARMUP_BATCHES,
    LoadMeter,
    NotMirrored,
    ParityResult,
    Rounds,
    Stopwatch,
    VanillaLoop,
    frozen_heap,
    timing_lock,
    torch_threads,
)
from ..timing.stats import fmt_seconds as _seconds
from ..timing.vanilla import _autocast_dtype, _module_device
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import USER, Frame, Stack, capture, classify, display_path

if TYPE_CHECKING:
    from ..watch import Run

NAME = "max_overhead"
NAMES = ("Lightning fit", "vanilla loop")

#: Profiler actions whose work the vanilla loop does too (or that contain such work): not "extra" time.
_MIRRORED_ACTIONS = {
    "training_step",
    "backward",
    "optimizer_step",
    "optimizer_zero_grad",
    "zero_grad",
    "batch_to_device",
    "transfer_batch_to_device",
    "train_dataloader_next",
    "configure_optimizers",
    "run_training_batch",
    "run_training_epoch",
    # pytorch-lightning 1.x names
    "training_step_and_backward",
    "model_forward",
    "get_train_batch",
    "fetch_next_train_batch",
    "training_batch_to_device",
}
#: Trainer arguments the replay drops (their defaults apply): limits and schedules of the user's fit.
_DROPPED_TRAINER_ARGS = (
    "max_steps",
    "min_steps",
    "min_epochs",
    "max_time",
    "val_check_interval",
    "check_val_every_n_epoch",
    "resume_from_checkpoint",
    "checkpoint_callback",
    "weights_summary",
    "profiler",
)
_LIGHTNING_LOGGERS = ("pytorch_lightning", "lightning.pytorch", "lightning_fabric", "lightning.fabric", "lightning")
_ACTION_RE = re.compile(r"^\[(?P<kind>[^\]]+)\](?P<owner>.*)\.(?P<hook>[A-Za-z_][A-Za-z0-9_]*)$")


@dataclass
class _Fit:
    """One observed ``Trainer.fit``: what its replay needs, and its verdict."""

    index: int
    module_name: str
    stack: Stack
    trainer: Any
    package: str
    call_args: tuple = ()
    call_kwargs: dict = field(default_factory=dict)
    init: Optional[tuple[tuple, dict]] = None
    snapshot: Any = None
    #: The Trainer's callbacks as they were when fit was called (copies), or None to reuse the instances.
    callbacks: Optional[list[Any]] = None
    refusals: list[str] = field(default_factory=list)
    ended: bool = False
    finished: bool = False
    batches_cap: Optional[int] = None
    mirror: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return f"Trainer.fit({self.module_name})"

    def release(self) -> None:
        self.trainer = None
        self.snapshot = None
        self.callbacks = None
        self.call_args = ()
        self.call_kwargs = {}
        self.init = None


class OverheadCheck:
    """Per-run state and verdict of ``max_overhead``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.fits: list[_Fit] = []

    # -- events -------------------------------------------------------------------
    def on_trainer_call(self, kind: str, trainer: Any, model: Any) -> None:
        if kind != "fit" or model is None:
            return
        call = lightning.current_call()
        fit = _Fit(
            index=len(self.fits) + 1,
            module_name=type(model).__name__,
            stack=capture(),
            trainer=trainer,
            package=call.package if call is not None else "pytorch_lightning",
            call_args=call.args if call is not None else (model,),
            call_kwargs=dict(call.kwargs) if call is not None else {},
            init=lightning.trainer_init_args(trainer),
        )
        if fit.init is None:
            fit.refusals.append(
                "the Trainer was built before torchperf started watching (in a fixture or at module level?), "
                "so it cannot be rebuilt for the timing replay; build it inside the watched test body or "
                "`torchperf.watch()` block"
            )
        elif "__init__" in vars(type(trainer)) and type(trainer).__module__ not in lightning._TRAINER_MODULES:
            fit.refusals.append(
                f"the Trainer is a {type(trainer).__name__} with its own __init__; the timing replay can only "
                "rebuild it from Trainer's own arguments"
            )
        try:
            fit.snapshot = _snapshot(model, trainer)
        except Exception as exc:  # noqa: BLE001 - any failure to copy is a reason to refuse, not to crash
            fit.refusals.append(
                f"the module could not be deep-copied before the fit ({type(exc).__name__}: {exc}), "
                "so neither loop can start from its initial weights"
            )
        if fit.init is not None:
            fit.callbacks = _copy_callbacks(fit.init, trainer, model)
        self.fits.append(fit)

    def on_trainer_call_end(self, kind: str, trainer: Any, model: Any) -> None:
        if kind != "fit":
            return
        fit = next((f for f in reversed(self.fits) if f.trainer is trainer and not f.ended), None)
        if fit is None:
            return
        fit.ended = True
        status = getattr(getattr(trainer, "state", None), "status", None)
        fit.finished = str(getattr(status, "value", status)) == "finished"
        fit.refusals.extend(_config_refusals(trainer, model))
        fit.mirror = _mirrored_config(trainer)
        max_steps = getattr(trainer, "max_steps", None)
        per_epoch = getattr(trainer, "num_training_batches", None)
        if isinstance(max_steps, int) and max_steps > 0 and isinstance(per_epoch, int) and max_steps < per_epoch:
            fit.batches_cap = max_steps  # the user's fit never ran a full epoch: time epochs of its length

    # -- verdict --------------------------------------------------------------------
    def result(self) -> CheckResult:
        try:
            return self._result()
        finally:
            for fit in self.fits:
                fit.release()

    def _result(self) -> CheckResult:
        if sys.exc_info()[1] is not None:
            # Called while the watched block's own exception propagates: that is the test's failure.
            return CheckResult(NAME, NOT_CHECKED, "not timed: the watched block raised", figures={"fits": []})
        if not self.fits:
            finding = Finding(
                "max_overhead compares a Lightning Trainer.fit with its vanilla loop, and no fit ran while watching",
                hint="call trainer.fit(...) inside the test body (or the `torchperf.watch()` block); "
                "to compare loops of your own, use torchperf.parity(candidate, baseline, max_overhead=...)",
            )
            return CheckResult(NAME, FAILED, "no Trainer.fit to compare", 1, [finding], {"fits": []})
        outcomes = [self._check_fit(fit) for fit in self.fits]
        figures: dict[str, Any] = {"fits": [o.figures for o in outcomes]}
        exceeded = [o for o in outcomes if o.status == "exceeded"]
        refused = [o for o in outcomes if o.status == "refused"]
        timed = [o for o in outcomes if o.parity is not None]
        if timed:
            worst = max(timed, key=lambda o: o.parity.overhead)  # type: ignore[union-attr]
            figures.update(
                {
                    "overhead": worst.parity.overhead,  # type: ignore[union-attr]
                    "interval": list(worst.parity.interval),  # type: ignore[union-attr]
                    "max_overhead": self.run.options.max_overhead,
                }
            )
        many = len(outcomes) > 1
        findings = [f for o in outcomes for f in o.findings]
        if exceeded or refused:
            first = (exceeded or refused)[0]
            summary = first.summary + (f" ({first.fit.label} #{first.fit.index} of {len(outcomes)})" if many else "")
            return CheckResult(NAME, FAILED, summary, len(exceeded) + len(refused), findings, figures)
        summary = worst.summary if timed else "no fit was timed"  # type: ignore[possibly-undefined]
        if many:
            summary += f" (worst of {len(outcomes)} fits)"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)

    def _check_fit(self, fit: _Fit) -> "_Outcome":
        site = Site(f"{fit.label} called", fit.stack)
        base = {"fit": fit.index, "module": fit.module_name, "site": site.frame.location() if site.frame else None}
        if not fit.finished:
            fit.refusals.insert(0, "the fit did not finish (it raised or was interrupted), so there is nothing to replay")
        if fit.refusals:
            return _refusal(fit, site, fit.refusals, base)
        options = self.run.options
        started = time.perf_counter()
        try:
            replay = _replay(fit, options.max_overhead, options.overhead_rounds)
        except NotMirrored as exc:
            return _refusal(fit, site, [str(exc)], base)
        except Exception as exc:  # noqa: BLE001 - the replay runs the user's code: report, don't crash
            frames = _traceback_stack(exc)
            sites = [site] + ([Site(f"{type(exc).__name__} raised here", frames)] if frames else [])
            reason = f"the timing replay of the fit raised {type(exc).__name__}: {exc}"
            return _refusal(fit, site, [reason], base, sites=sites)
        seconds = time.perf_counter() - started
        parity = replay.parity
        hooks = _attribution(replay)
        figures = dict(base)
        figures.update(parity.to_dict())
        figures.update(
            {
                "status": "failed" if parity.exceeded else "passed",
                "batches_per_epoch": replay.batches,
                "hooks": [h.to_dict() for h in hooks],
                "check_seconds": seconds,
            }
        )
        summary = parity.summary()
        if not parity.exceeded:
            return _Outcome(fit, "passed", summary, [], figures, parity)
        facts = parity.facts() + [
            f"the timed fit replays yours from the same initial weights, with {', '.join(replay.excluded)} off "
            "(the vanilla loop has none of them)",
        ]
        title = (
            f"{fit.label}: a Lightning epoch took {_seconds(parity.candidate.median)} against "
            f"{_seconds(parity.baseline.median)} for the vanilla loop derived from {fit.module_name}: "
            f"{parity.overhead:+.1%}, more than max_overhead={parity.max_overhead:.0%}"
        )
        findings = [Finding(title, facts, [site])]
        findings.append(_where_finding(replay, hooks))
        return _Outcome(fit, "exceeded", summary, findings, figures, parity)


@dataclass
class _Outcome:
    fit: _Fit
    status: str  # "passed", "exceeded", "refused"
    summary: str
    findings: list[Finding]
    figures: dict[str, Any]
    parity: Optional[ParityResult] = None


def _refusal(fit: _Fit, site: Site, reasons: list[str], base: dict[str, Any], sites: Optional[list[Site]] = None) -> _Outcome:
    title = f"{fit.label} cannot be compared with a vanilla loop, so max_overhead was not measured"
    facts = [f"- {r}" for r in reasons]
    hint = (
        "time a configuration the vanilla loop mirrors in this test (one device, one optimizer, automatic "
        "optimization), or compare two loops of your own with torchperf.parity(candidate, baseline, max_overhead=...)"
    )
    figures = dict(base)
    figures.update({"status": "cannot compare", "reasons": list(reasons)})
    summary = f"cannot compare: {reasons[0]}"
    return _Outcome(fit, "refused", summary, [Finding(title, facts, sites or [site], hint)], figures)


# ----------------------------------------------------------------------------- before / after the fit


def _snapshot(model: Any, trainer: Any) -> Any:
    """A deep copy of the module as it is now, with no reference to any Trainer."""
    memo: dict[int, Any] = {}
    for t in (trainer, getattr(model, "_trainer", None), vars(model).get("trainer")):
        if t is not None:
            memo[id(t)] = None
    return copy.deepcopy(model, memo)


def _copy_callbacks(init: tuple[tuple, dict], trainer: Any, model: Any) -> Optional[list[Any]]:
    """Copies of the callbacks the Trainer was given, as they are before the fit; None if they cannot be copied.

    The replay must not change the user's callbacks, nor start from the state
    the fit leaves them in. Copied before the fit: pytorch-lightning 1.x gives
    each callback the module's bound ``log`` methods during a fit, and those
    are dropped here too, so a copy never drags the module (or a Trainer) along.
    """
    try:
        callbacks = _bind(type(trainer).__init__, *init).get("callbacks") or []
    except TypeError:
        return None
    if not isinstance(callbacks, (list, tuple)):
        callbacks = [callbacks]
    memo: dict[int, Any] = {id(trainer): None, id(model): None}
    copies = []
    try:
        for cb in callbacks:
            clean = copy.copy(cb)
            for name, value in list(vars(clean).items()):
                if inspect.ismethod(value) and value.__self__ is model:
                    delattr(clean, name)
            copies.append(copy.deepcopy(clean, memo))
    except Exception:  # noqa: BLE001 - an uncopyable callback: the replay reuses the instances
        return None
    return copies


def _config_refusals(trainer: Any, model: Any) -> list[str]:
    """What this fit does that the vanilla loop does not mirror."""
    reasons = []
    world = getattr(trainer, "world_size", 1) or 1
    devices = getattr(trainer, "num_devices", None) or len(getattr(trainer, "device_ids", None) or [0])
    if world > 1 or devices > 1:
        strategy = type(getattr(trainer, "strategy", None)).__name__
        reasons.append(
            f"the fit runs on {max(world, devices)} devices/processes ({strategy}); the vanilla loop runs on one device"
        )
    if getattr(trainer, "fast_dev_run", False):
        reasons.append("fast_dev_run runs a smoke test of a batch or two: there are no epochs to time")
    if (getattr(trainer, "overfit_batches", 0) or 0) > 0:
        reasons.append("overfit_batches replaces the training data; the vanilla loop would not see the same batches")
    if (getattr(trainer, "reload_dataloaders_every_n_epochs", 0) or 0) > 0:
        reasons.append("reload_dataloaders_every_n_epochs rebuilds the dataloaders between epochs; not mirrored")
    if getattr(model, "automatic_optimization", True) is False:
        reasons.append(
            "the module uses manual optimization (automatic_optimization = False): its training_step drives "
            "the optimizers through the Trainer, which a vanilla loop cannot stand in for"
        )
    optimizers = getattr(trainer, "optimizers", None) or []
    if len(optimizers) > 1:
        reasons.append(f"the fit has {len(optimizers)} optimizers; the vanilla loop mirrors one")
    for cb in getattr(trainer, "callbacks", None) or []:
        # pytorch-lightning 1.x always adds one; only a schedule that changes is not mirrored.
        schedule = getattr(cb, "scheduling", None)
        if type(cb).__name__ == "GradientAccumulationScheduler" and len(set(dict(schedule or {}).values())) > 1:
            reasons.append(
                f"gradient accumulation changes during the fit (GradientAccumulationScheduler {dict(schedule or {})}); "
                "not mirrored"
            )
    if "apex" in str(getattr(trainer, "amp_backend", "")).lower():
        reasons.append("NVIDIA apex AMP is not mirrored")
    try:
        _autocast_dtype(getattr(trainer, "precision", "32-true"))
    except NotMirrored as exc:
        reasons.append(str(exc))
    return reasons


def _mirrored_config(trainer: Any) -> dict[str, Any]:
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    return {
        "precision": getattr(trainer, "precision", "32-true"),
        "accumulate_grad_batches": accumulate if isinstance(accumulate, int) and accumulate >= 1 else 1,
        "gradient_clip_val": getattr(trainer, "gradient_clip_val", None) or None,
        "gradient_clip_algorithm": str(getattr(algorithm, "value", algorithm) or "norm"),
    }


def _traceback_stack(exc: BaseException) -> Stack:
    return tuple(Frame(fs.filename, fs.lineno or 0, fs.name) for fs in traceback.extract_tb(exc.__traceback__))


# ----------------------------------------------------------------------------- the replay


@dataclass
class _Replay:
    parity: ParityResult
    batches: int
    actions: dict[str, list[float]]
    profiled_batches: int
    trainer: Any
    module: Any
    excluded: list[str]


def _train_loaders(trainer: Any) -> Any:
    """The training dataloader(s) the fit iterates, as the user gave them."""
    loaders = trainer.train_dataloader
    loaders = getattr(loaders, "loaders", loaders)  # pytorch-lightning 1.x: a CombinedLoader around them

    def unwrap(loader: Any) -> Any:  # pytorch-lightning 1.x: each of several loaders in a CycleIterator
        return loader.loader if type(loader).__name__ == "CycleIterator" else loader

    if isinstance(loaders, dict):
        return {k: unwrap(v) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(unwrap(v) for v in loaders)
    return unwrap(loaders)


class _Interleaver:
    """Runs vanilla epochs at the replay's epoch boundaries and times both sides (see the module docstring)."""

    def __init__(self, fit: _Fit, rounds: Rounds, profiler: Any) -> None:
        self.fit = fit
        self.rounds = rounds
        self.profiler = profiler
        self.loop: Optional[VanillaLoop] = None
        self.device: Any = None
        self.epoch = -1  # the Lightning epoch running now
        self.window = Stopwatch()  # the Lightning epoch's window
        self.batches = 0  # batches of the Lightning epoch running now
        self.l_times: list[tuple[float, Optional[float]]] = []  # (wall s, s waiting for a CPU)
        self.l_batches: list[int] = []
        self.v_times: dict[int, tuple[float, Optional[float]]] = {}
        self.profiled_batches = 0
        self.threads: set[int] = set()
        self.stopped = False

    def _vanilla_epoch(self, batches: int) -> tuple[float, Optional[float]]:
        assert self.loop is not None
        watch = Stopwatch(self.device)
        watch.start()
        self.loop.run_epoch(batches)
        return watch.stop()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        device = getattr(pl_module, "device", None)
        self.device = device if device is not None else _module_device(pl_module)
        self.window = Stopwatch(self.device)
        module = copy.deepcopy(self.fit.snapshot).to(self.device)
        self.loop = VanillaLoop(module, _train_loaders(trainer), trainer=trainer, **self.fit.mirror)

    def on_train_epoch_start(self, trainer: Any) -> None:
        if self.stopped:
            return
        if self.epoch >= 0:
            self.l_times.append(self.window.stop())
            self.l_batches.append(self.batches)
        threads = torch_threads()
        if threads is not None:
            self.threads.add(threads)
        starting = self.epoch + 1
        if starting == 0:
            self.profiler.enabled = True
        else:
            ended = starting - 1
            n = self.batches
            if n == 0:
                raise RuntimeError("a Lightning epoch of the timing replay ran no batches")
            loop = self.loop
            assert loop is not None
            if ended == 0:
                self.profiler.enabled = False
                self.profiled_batches = n
            else:
                if ended % 2 == 0:  # an L-first round: its vanilla epoch follows
                    self.v_times[ended] = self._vanilla_epoch(n)
                (l_wall, l_wait), (v_wall, v_wait) = self.l_times[ended], self.v_times[ended]
                self.rounds.add(l_wall, v_wall, l_wait, v_wait)
                if self.rounds.done():
                    trainer.should_stop = True
                    self.stopped = True
                    return
            if starting == 1:
                loop.run_epoch(min(n, max(WARMUP_BATCHES, loop.accumulate)))
            if starting % 2 == 1:  # a V-first round
                self.v_times[starting] = self._vanilla_epoch(n)
        self.epoch = starting
        self.batches = 0
        self.window.start()


_classes: dict[tuple[str, str], Any] = {}


def _timer_callback(package: str) -> Any:
    key = (package, "callback")
    if key not in _classes:
        base = importlib.import_module(f"{package}.callbacks").Callback

        class TorchperfEpochTimer(base):  # type: ignore[misc, valid-type]
            """Placed first in the replay's callbacks: epoch boundaries, batch counts, vanilla epochs."""

            def __init__(self, interleaver: _Interleaver) -> None:
                self.interleaver = interleaver

            def on_train_start(self, trainer: Any, pl_module: Any) -> None:
                self.interleaver.on_train_start(trainer, pl_module)

            def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
                self.interleaver.on_train_epoch_start(trainer)

            def on_train_batch_start(self, trainer: Any, pl_module: Any, *args: Any, **kwargs: Any) -> None:
                self.interleaver.batches += 1

        _classes[key] = TorchperfEpochTimer
    return _classes[key]


def _profiler(package: str) -> Any:
    key = (package, "profiler")
    if key not in _classes:
        base = None
        for module_name, attr in ((f"{package}.profilers", "Profiler"), (f"{package}.profiler", "BaseProfiler")):
            try:
                base = getattr(importlib.import_module(module_name), attr)
                break
            except (ImportError, AttributeError):
                continue
        if base is None:  # pragma: no cover - every supported Lightning has one of them
            return None

        class TorchperfProfiler(base):  # type: ignore[misc, valid-type]
            """Inclusive seconds and calls per Lightning action, only while ``enabled``."""

            def __init__(self) -> None:
                super().__init__()
                self._enabled = False
                self._open: list[tuple[str, float]] = []
                self.totals: dict[str, list[float]] = {}

            @property
            def enabled(self) -> bool:
                return self._enabled

            @enabled.setter
            def enabled(self, value: bool) -> None:
                self._enabled = value
                self._open.clear()

            def start(self, action_name: str) -> None:
                if self._enabled:
                    self._open.append((action_name, time.perf_counter()))

            def stop(self, action_name: str) -> None:
                if not self._enabled:
                    return
                now = time.perf_counter()
                for i in range(len(self._open) - 1, -1, -1):
                    if self._open[i][0] == action_name:
                        started = self._open[i][1]
                        del self._open[i:]
                        total = self.totals.setdefault(action_name, [0.0, 0])
                        total[0] += now - started
                        total[1] += 1
                        return

            def summary(self) -> str:
                return ""

        _classes[key] = TorchperfProfiler
    return _classes[key]()


def _bind(fn: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by parameter name (``self`` dropped, ``**kwargs`` flattened)."""
    sig = inspect.signature(fn)
    bound = sig.bind_partial(None, *args, **kwargs).arguments
    named = dict(bound)
    first = next(iter(sig.parameters))
    named.pop(first, None)
    for p in sig.parameters.values():
        if p.kind == p.VAR_KEYWORD and p.name in named:
            named.update(named.pop(p.name))
    return named


def _replay_trainer_kwargs(
    fit: _Fit, timer: Any, profiler: Any, root: str, rounds: int, notes: list[str]
) -> tuple[dict[str, Any], list[str]]:
    assert fit.init is not None
    trainer_cls = type(fit.trainer)
    params = inspect.signature(trainer_cls.__init__).parameters
    named = _bind(trainer_cls.__init__, *fit.init)
    for key in _DROPPED_TRAINER_ARGS:
        named.pop(key, None)
    callbacks_module = importlib.import_module(f"{fit.package}.callbacks")
    excluded_types = tuple(
        c for c in (getattr(callbacks_module, "ModelCheckpoint", None), getattr(callbacks_module, "EarlyStopping", None)) if c
    )
    user_callbacks = fit.callbacks
    if user_callbacks is None:
        user_callbacks = named.get("callbacks") or []
        if not isinstance(user_callbacks, (list, tuple)):
            user_callbacks = [user_callbacks]
        if user_callbacks:
            notes.append("your callbacks could not be copied; the replay reuses the instances of your fit")
    dropped = sorted({type(cb).__name__ for cb in user_callbacks if isinstance(cb, excluded_types)})
    kept = [cb for cb in user_callbacks if not isinstance(cb, excluded_types)]
    if dropped:
        notes.append(f"callbacks left out of the replay: {', '.join(dropped)}")
    excluded = ["validation", "sanity check", "checkpointing", "model summary"]
    updates: dict[str, Any] = {
        "max_epochs": rounds + 2,
        "limit_val_batches": 0,
        "num_sanity_val_steps": 0,
        "enable_checkpointing": False,
        "enable_model_summary": False,
        "default_root_dir": root,
        "callbacks": [timer] + list(kept),
    }
    if not named.get("barebones"):
        updates["profiler"] = profiler
    logger = named.get("logger", True)
    if logger is not None and logger is not True and logger is not False:
        csv = importlib.import_module(f"{fit.package}.loggers").CSVLogger
        updates["logger"] = csv(save_dir=root, name="torchperf")
        notes.append("your logger is replaced by a CSVLogger writing to a temporary directory")
    if fit.batches_cap is not None:
        updates["limit_train_batches"] = fit.batches_cap
        notes.append(f"epochs are {fit.batches_cap} batches long, like your fit (max_steps={fit.batches_cap})")
    for key, value in updates.items():
        if key in params:
            named[key] = value
    return named, excluded


def _replay_fit_kwargs(fit: _Fit, module: Any, notes: list[str]) -> dict[str, Any]:
    named = _bind(type(fit.trainer).fit, fit.call_args, fit.call_kwargs)
    named["model"] = module
    for key in ("ckpt_path", "weights_only"):
        if named.pop(key, None) is not None and key == "ckpt_path":
            notes.append("ckpt_path is not restored: both loops start from the weights the module had when fit was called")
    return named


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No output, warnings or Lightning info logs from the replay (the user's fit already showed them)."""
    levels = []
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        levels.append((logger, logger.level))
        logger.setLevel(logging.ERROR)
    try:
        with open(os.devnull, "w") as devnull, contextlib.redirect_stdout(devnull), contextlib.redirect_stderr(
            devnull
        ), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for logger, level in levels:
            logger.setLevel(level)


@contextlib.contextmanager
def _isolated_rng() -> Iterator[None]:
    """The replay draws random numbers; the test after it sees the generators as they were."""
    import torch

    state = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()
    np = sys.modules.get("numpy")
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(state)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np is not None:
            np.random.set_state(np_state)


def _replay(fit: _Fit, max_overhead: Optional[float], rounds: int) -> _Replay:
    notes: list[str] = []
    controller = Rounds(max_overhead, rounds)
    profiler = _profiler(fit.package)
    interleaver = _Interleaver(fit, controller, profiler)
    timer = _timer_callback(fit.package)(interleaver)
    root = tempfile.mkdtemp(prefix="torchperf-replay-")
    try:
        kwargs, excluded = _replay_trainer_kwargs(fit, timer, profiler, root, rounds, notes)
        if "profiler" not in kwargs:
            notes.append("barebones=True: Lightning cannot be profiled, so the hooks are not broken down")
        module = copy.deepcopy(fit.snapshot)
        fit_kwargs = _replay_fit_kwargs(fit, module, notes)
        with suspended() as outer, timing_lock() as lock:
            if outer:
                notes.append("another torchperf run was watching during the timing: its probes were installed")
            with frozen_heap(), LoadMeter() as load, _isolated_rng(), _quiet(), lightning.unobserved():
                started = time.perf_counter()
                trainer = type(fit.trainer)(**kwargs)
                trainer.fit(**fit_kwargs)
                elapsed = time.perf_counter() - started
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if len(controller) < 2:
        raise RuntimeError(
            f"the timing replay stopped after {len(interleaver.l_times)} epochs, before two rounds were timed "
            "(does a callback or hook stop training early?)"
        )
    if not interleaver.stopped:
        notes.append(f"the replay ended by itself after {len(controller)} rounds")
        controller.stop_reason = f"the fit ended after {len(controller)} rounds"
    if len(interleaver.threads) > 1:
        notes.append(f"torch's thread count changed during the replay: {sorted(interleaver.threads)}")
    if interleaver.loop is not None:
        notes.extend(interleaver.loop.notes)
    parity = ParityResult.from_rounds(
        controller,
        NAMES,
        1,
        threads=min(interleaver.threads) if interleaver.threads else None,
        device=str(interleaver.device) if interleaver.device is not None else None,
        load=load.figures,
        lock=lock.path,
        lock_wait_s=lock.waited_s,
        elapsed_s=elapsed,
        notes=notes,
    )
    batches = interleaver.l_batches[-1] if interleaver.l_batches else 0
    return _Replay(
        parity,
        batches,
        dict(getattr(profiler, "totals", {}) or {}),
        interleaver.profiled_batches,
        trainer,
        module,
        excluded,
    )


# ----------------------------------------------------------------------------- where the time went


@dataclass
class _Hook:
    name: str
    seconds_per_batch: float
    calls: int
    locations: list[tuple[str, str, bool]]  # (label, "path:line", user code)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "seconds_per_batch": self.seconds_per_batch,
            "calls": self.calls,
            "locations": [{"label": lab, "site": loc, "user_code": user} for lab, loc, user in self.locations],
        }


def _method_site(obj: Any, hook: str) -> Optional[tuple[str, bool]]:
    for klass in type(obj).__mro__:
        fn = vars(klass).get(hook)
        if fn is None:
            continue
        fn = inspect.unwrap(getattr(fn, "__func__", fn))
        code = getattr(fn, "__code__", None)
        if code is None:
            return None
        return f"{display_path(code.co_filename)}:{code.co_firstlineno}", classify(code.co_filename) == USER
    return None


def _implementers(kind: Optional[str], owner: str, hook: str, trainer: Any, module: Any) -> list[tuple[str, Any]]:
    callbacks = [cb for cb in getattr(trainer, "callbacks", None) or [] if type(cb).__name__ != "TorchperfEpochTimer"]
    if kind == "Callback":
        return [
            (f"{type(cb).__name__}.{hook} (callback)", cb)
            for cb in callbacks
            if getattr(cb, "state_key", type(cb).__qualname__) == owner
        ]
    if kind == "LightningModule":
        return [(f"{type(module).__name__}.{hook} (LightningModule hook)", module)]
    if kind == "LightningDataModule":
        dm = getattr(trainer, "datamodule", None)
        return [(f"{type(dm).__name__}.{hook} (datamodule hook)", dm)] if dm is not None else []
    if kind == "Strategy":
        strategy = getattr(trainer, "strategy", None)
        return [(f"{type(strategy).__name__}.{hook} (strategy)", strategy)] if strategy is not None else []
    if kind is None and hook.startswith("on_"):  # pytorch-lightning 1.x profiles a hook by name for all of them
        found = []
        for obj, what in [(module, "LightningModule hook")] + [(cb, "callback") for cb in callbacks]:
            site = _method_site(obj, hook)
            if site is not None and (site[1] or what == "callback" and not _is_base_hook(obj, hook)):
                found.append((f"{type(obj).__name__}.{hook} ({what})", obj))
        return found
    return []


def _is_base_hook(obj: Any, hook: str) -> bool:
    for klass in type(obj).__mro__:
        if hook in vars(klass):
            return klass.__name__ == "Callback"
    return True


def _attribution(replay: _Replay) -> list[_Hook]:
    """The profiled actions with no counterpart in the vanilla loop, most time per batch first."""
    n = replay.profiled_batches
    if not n or not replay.actions:
        return []
    hooks = []
    for name, (seconds, calls) in replay.actions.items():
        m = _ACTION_RE.match(name)
        kind, owner, hook = (m.group("kind"), m.group("owner"), m.group("hook")) if m else (None, "", name)
        if hook in _MIRRORED_ACTIONS or hook.startswith("optimizer_step") or owner.startswith("TorchperfEpochTimer"):
            continue
        if kind == "_TrainingEpochLoop" or (kind is None and not hook.startswith("on_")):
            continue  # the loop's own machinery: part of "the rest"
        locations = []
        for label, obj in _implementers(kind, owner, hook, replay.trainer, replay.module):
            site = _method_site(obj, hook)
            if site is not None:
                locations.append((label, site[0], site[1]))
        display = locations[0][0] if len(locations) == 1 else (name if m else f"{hook} (hook)")
        hooks.append(_Hook(display, seconds / n, int(calls), locations))
    hooks.sort(key=lambda h: h.seconds_per_batch, reverse=True)
    return hooks


def _where_finding(replay: _Replay, hooks: list[_Hook]) -> Finding:
    parity = replay.parity
    batches = max(replay.batches, 1)
    extra = (parity.candidate.median - parity.baseline.median) / batches
    shown = [h for h in hooks[:6] if h.seconds_per_batch >= max(extra * 0.02, 2e-6)]
    title = (
        f"where the extra {_seconds(max(extra, 0.0))} per batch went ({replay.batches} batches per epoch; "
        "Lightning's profiler over one untimed epoch of the replay)"
    )
    if not hooks:
        return Finding(title, ["no per-hook figures: Lightning could not be profiled in this replay"])
    facts = []
    for h in shown:
        line = f"{_seconds(h.seconds_per_batch):>9} per batch  {h.name}"
        if h.calls and h.calls != replay.profiled_batches:
            line += f" ({h.calls} calls per epoch)"
        facts.append(line)
        for label, loc, user in h.locations:
            whose = "your code" if user else "library code"
            facts.append(f"{'':>21}{label if len(h.locations) > 1 else 'at'} {loc} [{whose}]")
    hooked = sum(h.seconds_per_batch for h in shown)
    line = f"together {_seconds(hooked)} per batch, against {_seconds(max(extra, 0.0))} extra per batch timed"
    if extra - hooked > 0.1 * extra:
        line += (
            f"; the other {_seconds(extra - hooked)} is Lightning's own loop "
            "(batch fetching, logging, optimizer and closure wrapping)"
        )
    facts.append(line)
    user_hooks = [h for h in shown if any(user for _, _, user in h.locations)]
    if user_hooks and user_hooks[0].seconds_per_batch >= 0.25 * extra:
        top = user_hooks[0]
        hint = (
            f"{top.name.split(' (')[0]} runs in the fit and has no counterpart in the vanilla loop: make it cheaper "
            "or run it every N batches; if the work is wanted, raise max_overhead"
        )
    else:
        hint = (
            "most of the extra time is Lightning's own per-batch work: it weighs more the shorter the step is; "
            "larger batches amortise it, or raise max_overhead to what this model needs"
        )
    return Finding(title, facts, [], hint)
