"""The timing replay of an observed ``Trainer.fit``: what it needs, captured at the fit, and the replay itself.

At ``Trainer.fit`` the check keeps an :class:`ObservedFit`: a deep copy of the
module (its initial weights), copies of the callbacks, how the Trainer was
built and how ``fit`` was called. :func:`run_replay` then fits once more with a
Trainer built from the same arguments and, at that fit's epoch boundaries,
runs epochs of the vanilla loop on a second copy of the module
(:class:`_Interleaver`, see the package docstring for the schedule).
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import logging
import math
import os
import random
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .. import frameworks
from ..clocks import perf_counter
from ..core import suspended
from ..stacks import Stack
from ..timing import (
    CUDA_EVENT_TIME,
    WARMUP_BATCHES,
    LoadMeter,
    NotMirrored,
    ParityResult,
    Rounds,
    VanillaLoop,
    clock_unit,
    frozen_heap,
    timing_lock,
    timing_threads,
    torch_threads,
)
from ..timing.clock import EpochWatch, Reading, torch_threads_pinned
from ..timing.vanilla import _autocast_dtype, _module_device

NAMES = ("Lightning fit", "vanilla loop")

#: Batches of the replay's untimed first Lightning epoch (rounded up to whole accumulation windows): the
#: first steps of a new Trainer (the DataLoader's first iterator, the optimizer's state, the loggers' and
#: the logged metrics' set-up: all in the first step; the code itself is warm from the user's fit) and
#: a few steady ones for the per-batch profile, which starts at the second batch so that no one-time
#: cost is charged to a hook. A longer epoch stops there (``on_train_batch_start`` returns -1,
#: Lightning's own way to end an epoch early). A whole first epoch cost a 2-epoch test's check about
#: 0.4 fits of its time; 8 batches still cost a whole epoch of an 8-batch test.
LIGHTNING_WARMUP_BATCHES = 4
#: The fewest batches a timed epoch cut short trains (:func:`timed_batches`).
TIMED_MIN_BATCHES = 4

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


@dataclass
class ObservedFit:
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
    #: The batches of an epoch of the fit, where known beforehand (not for an iterable dataset without a length).
    epoch_batches: Optional[int] = None
    #: The device the fit trained on (None: not known).
    device: Any = None
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



def snapshot(model: Any, trainer: Any) -> Any:
    """A deep copy of the module as it is now, with no reference to any Trainer."""
    memo: dict[int, Any] = {}
    for t in (trainer, getattr(model, "_trainer", None), vars(model).get("trainer")):
        if t is not None:
            memo[id(t)] = None
    return copy.deepcopy(model, memo)


def copy_callbacks(init: tuple[tuple, dict], trainer: Any, model: Any) -> Optional[list[Any]]:
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


def config_refusals(trainer: Any, model: Any) -> list[str]:
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


def root_device(trainer: Any) -> Any:
    """The device a Trainer trains on (``strategy.root_device``; pytorch-lightning 1.5: its accelerator's)."""
    for owner in (getattr(trainer, "strategy", None), getattr(trainer, "accelerator", None)):
        device = getattr(owner, "root_device", None)
        if device is not None:
            return device
    return None


def timed_batches(fit: ObservedFit) -> Optional[int]:
    """The batches each timed epoch trains where epochs are cut short; None where they are whole.

    About half the epoch, in whole accumulation windows, at least :data:`TIMED_MIN_BATCHES` and two windows (the
    per-batch rate is read over all but the last one). Whole where that is not fewer, where the epoch's length is
    unknown, and on a GPU (a reading mid-epoch would drain its queue).
    """
    n = fit.epoch_batches
    if n is None or clock_unit(fit.device) == CUDA_EVENT_TIME:
        return None
    k = fit.mirror.get("accumulate_grad_batches", 1)
    timed = -(-max(-(-n // 2), TIMED_MIN_BATCHES, 2 * k) // k) * k
    return timed if timed < n else None


def mirrored_config(trainer: Any) -> dict[str, Any]:
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    return {
        "precision": getattr(trainer, "precision", "32-true"),
        "accumulate_grad_batches": accumulate if isinstance(accumulate, int) and accumulate >= 1 else 1,
        "gradient_clip_val": getattr(trainer, "gradient_clip_val", None) or None,
        "gradient_clip_algorithm": str(getattr(algorithm, "value", algorithm) or "norm"),
    }




@dataclass
class Replay:
    parity: ParityResult
    #: A whole epoch's batches (the epochs the rounds compare), and the batches each timed epoch trained.
    batches: int
    timed_batches: int
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

    def __init__(self, fit: ObservedFit, rounds: Rounds, profiler: Any, pin: Callable[[int], None]) -> None:
        self.fit = fit
        self.rounds = rounds
        self.profiler = profiler
        self.pin = pin
        #: torch's thread count when the replay began (the user's fit's), and what both sides were timed with.
        self.user_threads = torch_threads()
        self.timing_threads: Optional[int] = None
        self.loop: Optional[VanillaLoop] = None
        self.device: Any = None
        self.epoch = -1  # the Lightning epoch running now
        #: The clocks of the Lightning epochs' windows and of the vanilla epochs (set at the replay's start).
        self.window = EpochWatch(None)
        self.vanilla_watch = EpochWatch(None)
        self.batches = 0  # batches of the Lightning epoch running now
        self.l_times: dict[int, Reading] = {}  # per timed epoch: (wall s, s waiting for a CPU)
        self.l_batches: list[int] = []
        self.v_times: dict[int, Reading] = {}
        self.profiled_batches = 0
        self.threads: set[int] = set()
        self.stopped = False
        #: Batches the warm-up epoch trains before it ends (set at the replay's start).
        self.warmup_batches = LIGHTNING_WARMUP_BATCHES
        #: A timed epoch's batches (the replay's ``trainer.num_training_batches``) where known beforehand and no
        #: fewer than the warm-up's: the warm-up then ends after :attr:`warmup_batches`, profiled from its second
        #: batch, and the first round's vanilla epoch runs before its Lightning one. None for an iterable dataset
        #: without a length (every epoch whole, the warm-up's too).
        self.epoch_batches: Optional[int] = None
        #: The replay's module, while its ``on_train_batch_start`` is wrapped to end the warm-up epoch.
        self._limited: Any = None

    def _limit_warmup(self, pl_module: Any) -> None:
        """End the warm-up epoch after :attr:`warmup_batches` (the module is the replay's own copy)."""
        own = pl_module.on_train_batch_start
        interleaver = self

        def on_train_batch_start(*args: Any, **kwargs: Any) -> Any:
            response = own(*args, **kwargs)
            if interleaver.epoch == 0 and interleaver.batches > interleaver.warmup_batches:
                interleaver.batches -= 1  # fetched (the timer counted it), not trained
                return -1
            return response

        pl_module.on_train_batch_start = on_train_batch_start
        self._limited = pl_module

    def end_warmup_limit(self) -> None:
        """The module's own ``on_train_batch_start`` again (idempotent)."""
        module, self._limited = self._limited, None
        if module is not None:
            module.__dict__.pop("on_train_batch_start", None)

    def on_train_batch_start(self) -> None:
        self.batches += 1
        if self.epoch > 0:
            self.window.batch_start(self.batches - 1)
        elif self.epoch == 0 and self.batches == 2 and self.epoch_batches is not None:
            self.profiler.enabled = True  # a warm-up cut short: its first batch (one-time costs) unprofiled

    def _vanilla_epoch(self, batches: int) -> Reading:
        assert self.loop is not None
        self.vanilla_watch.start()
        self.loop.run_epoch(batches, self.vanilla_watch.batch_start)
        return self.vanilla_watch.stop()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        device = getattr(pl_module, "device", None)
        self.device = device if device is not None else _module_device(pl_module)
        self.timing_threads = timing_threads(self.device)
        if self.timing_threads is not None:
            self.pin(self.timing_threads)
        module = copy.deepcopy(self.fit.snapshot).to(self.device)
        self.loop = VanillaLoop(module, _train_loaders(trainer), trainer=trainer, **self.fit.mirror)
        k = self.loop.accumulate
        self.warmup_batches = -(-max(LIGHTNING_WARMUP_BATCHES, k) // k) * k
        total = getattr(trainer, "num_training_batches", None)
        timed, whole = timed_batches(self.fit), self.fit.epoch_batches
        left = apart = 0
        if timed is not None and total == timed and whole is not None:
            # Epochs cut short (limit_train_batches): each side's time counts as the whole epoch's, extrapolated at
            # its own rate over whole accumulation windows, batches 1 to timed - k.
            left, apart = whole - timed, timed - k
        self.window, self.vanilla_watch = EpochWatch(self.device, left, apart), EpochWatch(self.device, left, apart)
        if isinstance(total, (int, float)) and math.isfinite(total) and int(total) >= self.warmup_batches:
            self.epoch_batches = int(total)
            self._limit_warmup(pl_module)

    def on_train_epoch_start(self, trainer: Any) -> None:
        if self.stopped:
            return
        if self.epoch >= 1:  # a timed epoch ended (the warm-up, epoch 0, is not timed)
            if self.window.left and self.batches != self.epoch_batches:
                raise RuntimeError(
                    f"a timed Lightning epoch of the replay trained {self.batches} batches, not the "
                    f"{self.epoch_batches} it was cut to (does a callback or hook end epochs early?)"
                )
            self.l_times[self.epoch] = self.window.stop()
            self.l_batches.append(self.batches)
        threads = torch_threads()
        if threads is not None:
            self.threads.add(threads)
        starting = self.epoch + 1
        if starting == 0:
            # A warm-up of known length profiles from its second batch on (on_train_batch_start); a whole one
            # (an epoch of unknown length, or shorter than the warm-up) is profiled whole.
            self.profiler.enabled = self.epoch_batches is None
        else:
            ended = starting - 1
            n = self.batches
            if n == 0:
                raise RuntimeError("a Lightning epoch of the timing replay ran no batches")
            loop = self.loop
            assert loop is not None
            if ended == 0:
                self.profiler.enabled = False
                self.profiled_batches = n - 1 if self.epoch_batches is not None else n
                if self.epoch_batches is not None:
                    self.end_warmup_limit()
                    if n == self.warmup_batches:
                        n = self.epoch_batches  # the warm-up ended early: the first round's epochs are timed ones
            else:
                if ended % 2 == 0:  # an L-first round: its vanilla epoch follows
                    self.v_times[ended] = self._vanilla_epoch(n)
                (l_wall, l_wait), (v_wall, v_wait) = self.l_times[ended], self.v_times[ended]
                self.rounds.add(l_wall, v_wall, l_wait, v_wait, candidate_first=ended % 2 == 0)
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
        if starting >= 1:
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
                self.interleaver.on_train_batch_start()

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
                    self._open.append((action_name, perf_counter()))

            def stop(self, action_name: str) -> None:
                if not self._enabled:
                    return
                now = perf_counter()
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
    fit: ObservedFit, timer: Any, profiler: Any, root: str, rounds: int, notes: list[str]
) -> tuple[dict[str, Any], list[str]]:
    assert fit.init is not None
    trainer_cls = type(fit.trainer)
    params = inspect.signature(trainer_cls.__init__).parameters
    named = _bind(trainer_cls.__init__, *fit.init)
    for key in _DROPPED_TRAINER_ARGS:
        named.pop(key, None)
    callbacks_module = importlib.import_module(f"{fit.package}.callbacks")
    excluded_types = tuple(
        c
        for c in (getattr(callbacks_module, "ModelCheckpoint", None), getattr(callbacks_module, "EarlyStopping", None))
        if c
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
    timed = timed_batches(fit)
    if timed is not None:
        updates["limit_train_batches"] = timed  # Lightning ends the epoch there as it ends a whole one
    for key, value in updates.items():
        if key in params:
            named[key] = value
    return named, excluded


def _replay_fit_kwargs(fit: ObservedFit, module: Any, notes: list[str]) -> dict[str, Any]:
    named = _bind(type(fit.trainer).fit, fit.call_args, fit.call_kwargs)
    named["model"] = module
    for key in ("ckpt_path", "weights_only"):
        if named.pop(key, None) is not None and key == "ckpt_path":
            notes.append(
                "ckpt_path is not restored: both loops start from the weights the module had when fit was called"
            )
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


def run_replay(fit: ObservedFit, max_overhead: Optional[float], rounds: int) -> Replay:
    notes: list[str] = []
    controller = Rounds(max_overhead, rounds)
    profiler = _profiler(fit.package)
    root = tempfile.mkdtemp(prefix="torchperf-replay-")
    with contextlib.ExitStack() as stack:
        pin = stack.enter_context(torch_threads_pinned())
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        interleaver = _Interleaver(fit, controller, profiler, pin)
        stack.callback(interleaver.end_warmup_limit)
        timer = _timer_callback(fit.package)(interleaver)
        kwargs, excluded = _replay_trainer_kwargs(fit, timer, profiler, root, rounds, notes)
        if "profiler" not in kwargs:
            notes.append("barebones=True: Lightning cannot be profiled, so the hooks are not broken down")
        module = copy.deepcopy(fit.snapshot)
        fit_kwargs = _replay_fit_kwargs(fit, module, notes)
        with suspended() as outer, timing_lock() as lock:
            if outer:
                notes.append("another torchperf run was watching during the timing: its probes were installed")
            with frozen_heap(), LoadMeter() as load, _isolated_rng(), _quiet(), frameworks.unobserved():
                started = perf_counter()
                trainer = type(fit.trainer)(**kwargs)
                trainer.fit(**fit_kwargs)
                elapsed = perf_counter() - started
    if len(controller) < 2:
        raise RuntimeError(
            f"the timing replay stopped after {interleaver.epoch + 1} epochs, before two rounds were timed "
            "(does a callback or hook stop training early?)"
        )
    if not interleaver.stopped:
        notes.append(f"the replay ended by itself after {len(controller)} rounds")
        controller.stop_reason = f"the fit ended after {len(controller)} rounds"
    if len(interleaver.threads) > 1:
        notes.append(f"torch's thread count changed during the replay: {sorted(interleaver.threads)}")
    pinned, before = interleaver.timing_threads, interleaver.user_threads
    if pinned is not None and before is not None and before != pinned:
        notes.append(
            f"your fit ran with {before} torch threads; both loops were timed with {pinned}: several threads "
            "spin-wait for each other whenever another process holds a core, which inflates every clock of "
            "this process, and one thread gives the same figure on any machine"
        )
    if interleaver.loop is not None:
        notes.extend(interleaver.loop.notes)
    timed = interleaver.l_batches[-1] if interleaver.l_batches else 0
    watch = interleaver.window
    if watch.left:
        notes.append(
            f"each timed epoch trained {timed} of its {timed + watch.left} batches and counts as the whole "
            f"epoch: its time plus the other {watch.left} batches at the per-batch rate of its own batches 1 to "
            f"{watch.apart} (both loops alike), so that per-epoch costs (the epoch's hooks, a new DataLoader "
            "iterator, worker start-up) count once per epoch, as in your fit"
        )
    parity = ParityResult.from_rounds(
        controller,
        NAMES,
        1,
        unit=interleaver.window.unit,
        advice=f"overhead_rounds={rounds}",
        threads=min(interleaver.threads) if interleaver.threads else None,
        device=str(interleaver.device) if interleaver.device is not None else None,
        load=load.figures,
        lock=lock.path,
        lock_wait_s=lock.waited_s,
        elapsed_s=elapsed,
        notes=notes,
    )
    return Replay(
        parity=parity,
        batches=timed + watch.left,
        timed_batches=timed,
        actions=dict(getattr(profiler, "totals", {}) or {}),
        profiled_batches=interleaver.profiled_batches,
        trainer=trainer,
        module=module,
        excluded=excluded,
    )
