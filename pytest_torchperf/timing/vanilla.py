"""The plain PyTorch loop a LightningModule's own methods describe: :class:`VanillaLoop` and :func:`vanilla_fit`.

Nothing here imports torch at import time.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import itertools
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..clocks import perf_counter
from ..options import UsageError
from .clock import synchronize
from .stats import check_int

#: Batches of the vanilla warm-up epoch (optimizer state, kernels, allocator): not timed.
WARMUP_BATCHES = 3

#: Modules whose classes are the framework's, not the user's (for "is this hook overridden").
_FRAMEWORK_MODULES = ("pytorch_lightning", "lightning", "torch")


class NotMirrored(Exception):
    """The vanilla loop cannot do what this module or configuration asks for (the message says what)."""



def _defined_by_user(obj: Any, name: str) -> bool:
    """Whether ``type(obj).name`` comes from a class outside torch and Lightning."""
    for klass in type(obj).__mro__:
        if name in vars(klass):
            module = getattr(klass, "__module__", "") or ""
            return module.split(".")[0] not in _FRAMEWORK_MODULES
    return False


def _module_device(module: Any) -> Any:
    import torch

    for tensor in itertools.chain(module.parameters(), module.buffers()):
        return tensor.device
    return torch.device("cpu")


def _to_device(obj: Any, device: Any, non_blocking: bool) -> Any:
    """Move every tensor of a batch to ``device`` (what Lightning's ``batch_to_device`` does)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=non_blocking)
    if isinstance(obj, Mapping):
        items = [(k, _to_device(v, device, non_blocking)) for k, v in obj.items()]
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:
            return dict(items)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_to_device(v, device, non_blocking) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device, non_blocking) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        out = copy.copy(obj)
        for f in dataclasses.fields(obj):
            if f.init:
                object.__setattr__(out, f.name, _to_device(getattr(obj, f.name), device, non_blocking))
        return out
    to = getattr(obj, "to", None)
    if callable(to) and not isinstance(obj, (str, bytes, torch.nn.Module)):
        return to(device, non_blocking=non_blocking) if non_blocking else to(device)
    return obj


def _loss_of(output: Any) -> Any:
    import torch

    if output is None or isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping):
        if "loss" not in output:
            raise NotMirrored(
                f"training_step returned a dict without a 'loss' key (keys: {sorted(map(str, output))}); "
                "Lightning needs one too"
            )
        return output["loss"]
    raise NotMirrored(
        f"training_step returned {type(output).__name__}; the vanilla loop understands a loss tensor, "
        "a dict with 'loss', or None"
    )


def _single_loader(train_dataloaders: Any) -> Any:
    try:
        from torch.utils.data import DataLoader
    except ImportError:  # pragma: no cover
        DataLoader = ()  # type: ignore[assignment,misc]
    if isinstance(train_dataloaders, Mapping):
        values = list(train_dataloaders.values())
    elif isinstance(train_dataloaders, (list, tuple)):
        values = list(train_dataloaders)
    else:
        values = None
    if values is not None and values and all(isinstance(v, DataLoader) for v in values):
        if len(values) == 1:
            return values[0]
        raise NotMirrored(
            f"the fit trains on {len(values)} dataloaders at once (Lightning's CombinedLoader); "
            "the vanilla loop mirrors a single training dataloader"
        )
    if train_dataloaders is None or not hasattr(train_dataloaders, "__iter__"):
        raise NotMirrored(f"train_dataloaders must be an iterable of batches, got {train_dataloaders!r}")
    return train_dataloaders


def _autocast_dtype(precision: Any) -> tuple[Optional[str], bool]:
    """``(autocast dtype name or None, use a GradScaler)`` for a Lightning precision setting."""
    p = str(precision).lower()
    if p in ("32", "32-true"):
        return None, False
    if p in ("bf16-mixed", "bf16"):
        return "bfloat16", False
    if p in ("16-mixed", "16"):
        return "float16", True
    raise NotMirrored(
        f"precision={precision!r} is not mirrored by the vanilla loop (it mirrors 32-true, 16-mixed and bf16-mixed)"
    )


@dataclass
class _Scheduler:
    scheduler: Any
    interval: str
    frequency: int


def _parse_optimizers(conf: Any) -> tuple[list[Any], list[_Scheduler], list[str]]:
    """Lightning's readings of ``configure_optimizers()``: optimizers, schedulers, notes."""
    import torch

    def is_optimizer(x: Any) -> bool:
        return isinstance(x, torch.optim.Optimizer) or all(hasattr(x, a) for a in ("step", "zero_grad", "param_groups"))

    notes: list[str] = []

    def scheduler(entry: Any) -> Optional[_Scheduler]:
        if entry is None:
            return None
        if isinstance(entry, Mapping):
            if "scheduler" not in entry:
                raise NotMirrored("an lr_scheduler dict from configure_optimizers() has no 'scheduler' key")
            sched = entry["scheduler"]
            interval = entry.get("interval", "epoch")
            frequency = entry.get("frequency", 1)
        else:
            sched, interval, frequency = entry, "epoch", 1
        if interval not in ("epoch", "step"):
            raise NotMirrored(f"lr scheduler interval {interval!r} is not 'epoch' or 'step'")
        plateau = getattr(torch.optim.lr_scheduler, "ReduceLROnPlateau", None)
        if plateau is not None and isinstance(sched, plateau):
            notes.append(
                "ReduceLROnPlateau is not stepped by the vanilla loop (it needs a monitored metric); "
                "its cost per epoch is negligible"
            )
            return None
        return _Scheduler(sched, interval, int(frequency))

    optimizers: list[Any]
    schedulers: list[Optional[_Scheduler]] = []
    if conf is None:
        optimizers = []
        notes.append("configure_optimizers() returned None: both loops run backward without an optimizer step")
    elif is_optimizer(conf):
        optimizers = [conf]
    elif isinstance(conf, Mapping):
        if "optimizer" not in conf:
            raise NotMirrored("configure_optimizers() returned a dict without an 'optimizer' key")
        optimizers = [conf["optimizer"]]
        schedulers.append(scheduler(conf.get("lr_scheduler")))
    elif isinstance(conf, (list, tuple)):
        items = list(conf)
        if len(items) == 2 and isinstance(items[0], (list, tuple)) and all(is_optimizer(o) for o in items[0]):
            optimizers = list(items[0])
            scheds = items[1] if isinstance(items[1], (list, tuple)) else [items[1]]
            schedulers.extend(scheduler(s) for s in scheds)
        elif items and all(isinstance(d, Mapping) for d in items):
            optimizers = [d.get("optimizer") for d in items]
            schedulers.extend(scheduler(d.get("lr_scheduler")) for d in items)
        elif all(is_optimizer(o) for o in items):
            optimizers = items
        else:
            raise NotMirrored(f"configure_optimizers() returned a {type(conf).__name__} the vanilla loop cannot read")
    else:
        raise NotMirrored(f"configure_optimizers() returned {type(conf).__name__}, which the vanilla loop cannot read")
    if len(optimizers) > 1:
        raise NotMirrored(
            f"configure_optimizers() returned {len(optimizers)} optimizers; the vanilla loop mirrors one "
            "(several optimizers need manual optimization in Lightning 2)"
        )
    return optimizers, [s for s in schedulers if s is not None], notes


def _takes_batch_idx(fn: Callable[..., Any]) -> bool:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params)


@contextlib.contextmanager
def _attached(module: Any, trainer: Any) -> Iterator[None]:
    """``module.trainer = trainer`` for the hooks Lightning calls with the trainer attached."""
    # Not hasattr(module, "trainer"): Lightning 2's property raises RuntimeError while detached.
    if trainer is None or not (
        isinstance(getattr(type(module), "trainer", None), property) or "trainer" in vars(module)
    ):
        yield
        return
    module.trainer = trainer
    try:
        yield
    finally:
        module.trainer = None


_LOG_WITHOUT_TRAINER = r"You are trying to `self\.log\(\)` but the `self\.trainer` reference is not registered"


class VanillaLoop:
    """The plain PyTorch loop a LightningModule's own methods describe, one epoch at a time.

    Per batch: the batch moved to the module's device (``non_blocking`` off
    the CPU, as Lightning does), ``training_step(batch, batch_idx)`` (under
    autocast for mixed precision), its loss (a tensor or ``output["loss"]``;
    None skips the batch), ``zero_grad`` at the first batch of each
    accumulation window, ``backward`` (scaled for 16-mixed, divided by
    ``accumulate_grad_batches``), gradient clipping, ``optimizer.step()``,
    step-interval schedulers; epoch-interval schedulers after each epoch.

    ``configure_model``/``setup("fit")`` (when the module overrides them) and
    ``configure_optimizers`` run once, with ``trainer`` attached if given (as
    Lightning calls them); ``training_step`` runs with no trainer, so
    ``self.log`` is a no-op, as it would be in a hand-written loop.
    Raises :class:`NotMirrored` for what it cannot mirror: manual
    optimization, several optimizers, several dataloaders, truncated BPTT,
    other precisions.
    """

    def __init__(
        self,
        module: Any,
        train_dataloaders: Any,
        *,
        device: Any = None,
        precision: Any = "32-true",
        accumulate_grad_batches: int = 1,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = "norm",
        trainer: Any = None,
    ) -> None:
        import torch

        self._torch = torch
        if not callable(getattr(module, "training_step", None)):
            raise NotMirrored(f"{type(module).__name__} has no training_step(batch, batch_idx)")
        if getattr(module, "automatic_optimization", True) is False:
            raise NotMirrored(
                "the module uses manual optimization (automatic_optimization = False): its training_step "
                "drives the optimizers through the Trainer"
            )
        if (getattr(module, "truncated_bptt_steps", 0) or 0) > 0:
            raise NotMirrored("truncated back-propagation through time (truncated_bptt_steps) is not mirrored")
        if (
            isinstance(accumulate_grad_batches, bool)
            or not isinstance(accumulate_grad_batches, int)
            or accumulate_grad_batches < 1
        ):
            raise NotMirrored(f"accumulate_grad_batches must be an integer >= 1, got {accumulate_grad_batches!r}")
        algorithm = str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm) or "norm").lower()
        if algorithm not in ("norm", "value"):
            raise NotMirrored(f"gradient_clip_algorithm {gradient_clip_algorithm!r} is not 'norm' or 'value'")
        self.module = module
        self.loader = _single_loader(train_dataloaders)
        self.device = torch.device(device) if device is not None else _module_device(module)
        if device is not None:
            module.to(self.device)
        dtype_name, use_scaler = _autocast_dtype(precision)
        self._autocast_dtype = getattr(torch, dtype_name) if dtype_name else None
        self.accumulate = accumulate_grad_batches
        self.clip_val = float(gradient_clip_val) if gradient_clip_val else None
        self.clip_algorithm = algorithm
        self._non_blocking = self.device.type not in ("cpu", "mps")
        with _attached(module, trainer):
            if _defined_by_user(module, "configure_model"):
                module.configure_model()
            if _defined_by_user(module, "setup"):
                module.setup("fit")
            conf = module.configure_optimizers() if callable(getattr(module, "configure_optimizers", None)) else None
        optimizers, self.schedulers, self.notes = _parse_optimizers(conf)
        self.optimizer = optimizers[0] if optimizers else None
        self.scaler = None
        if use_scaler:
            amp = getattr(torch, "amp", None)
            if amp is not None and hasattr(amp, "GradScaler"):
                self.scaler = amp.GradScaler(self.device.type)
            else:  # pragma: no cover - torch < 2.3
                self.scaler = torch.cuda.amp.GradScaler()
        self._pass_batch_idx = _takes_batch_idx(module.training_step)
        self.epochs = 0
        self.steps = 0
        self.batches = 0

    def _autocast(self) -> Any:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return self._torch.autocast(self.device.type, dtype=self._autocast_dtype)

    def _optimizer_step(self, batch_idx: int) -> None:
        opt = self.optimizer
        if opt is None:
            return
        torch = self._torch
        if self.clip_val:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for group in opt.param_groups for p in group["params"]]
            if self.clip_algorithm == "value":
                torch.nn.utils.clip_grad_value_(params, self.clip_val)
            else:
                torch.nn.utils.clip_grad_norm_(params, self.clip_val)
        if self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()
        self.steps += 1
        for s in self.schedulers:
            if s.interval == "step" and (batch_idx + 1) % s.frequency == 0:
                s.scheduler.step()

    def _batch(self, batch: Any, batch_idx: int) -> bool:
        """Train on one batch; True when gradients are waiting for an optimizer step."""
        batch = _to_device(batch, self.device, self._non_blocking)
        with self._autocast():
            if self._pass_batch_idx:
                output = self.module.training_step(batch, batch_idx)
            else:
                output = self.module.training_step(batch)
        loss = _loss_of(output)
        if loss is None:
            return False
        k = self.accumulate
        if batch_idx % k == 0 and self.optimizer is not None:
            self.optimizer.zero_grad()
        if k > 1:
            loss = loss / k
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if (batch_idx + 1) % k == 0:
            self._optimizer_step(batch_idx)
            return False
        return True

    def run_epoch(
        self, max_batches: Optional[int] = None, batch_start: Optional[Callable[[int], None]] = None
    ) -> float:
        """Train one epoch (at most ``max_batches`` batches); return its seconds, CUDA synchronised.

        ``batch_start(batch_idx)`` is called as each batch begins, once it is fetched (a timer's reading).
        """
        torch = self._torch
        self.module.train()
        batches = self.loader if max_batches is None else itertools.islice(self.loader, max_batches)
        synchronize(self.device)
        started = perf_counter()
        with torch.enable_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_LOG_WITHOUT_TRAINER)
            pending = False
            batch_idx = -1
            for batch_idx, batch in enumerate(batches):
                if batch_start is not None:
                    batch_start(batch_idx)
                pending = self._batch(batch, batch_idx)
            if pending:  # the epoch ended inside an accumulation window: Lightning steps on the last batch
                self._optimizer_step(batch_idx)
            self.batches += batch_idx + 1
            self.epochs += 1
            for s in self.schedulers:
                if s.interval == "epoch" and self.epochs % s.frequency == 0:
                    s.scheduler.step()
        synchronize(self.device)
        return perf_counter() - started


def _batches_per_epoch(loader: Any, limit: Optional[float]) -> Optional[int]:
    try:
        n: Optional[int] = len(loader)
    except TypeError:
        n = None
    if limit is None:
        return n
    if isinstance(limit, int):
        return limit if n is None else min(n, limit)
    if n is None:
        raise UsageError("vanilla_fit(): a fractional limit_train_batches needs a dataloader with a length")
    return int(n * limit)


def vanilla_fit(
    module: Any,
    train_dataloaders: Any,
    max_epochs: int = 1,
    *,
    max_steps: Optional[int] = None,
    limit_train_batches: Optional[float] = None,
    accumulate_grad_batches: int = 1,
    gradient_clip_val: Optional[float] = None,
    gradient_clip_algorithm: str = "norm",
    precision: Any = "32-true",
    device: Any = None,
) -> list[float]:
    """Train ``module`` with the plain PyTorch loop its own methods describe; return each epoch's seconds.

    The loop a user would write by hand for ``Trainer(max_epochs=...).fit(module,
    train_dataloaders)``: ``configure_optimizers()`` as Lightning reads it,
    then per batch ``training_step`` -> ``zero_grad`` -> ``backward`` ->
    ``step`` (see :class:`VanillaLoop`). The keyword arguments mean what the
    ``Trainer`` arguments of the same names mean. ``module`` is trained in
    place, on its own device unless ``device`` is given. Raises
    :class:`NotMirrored` for what the loop cannot do (manual optimization,
    several optimizers, ...).
    """
    where = "vanilla_fit()"
    check_int(max_epochs, "max_epochs", 1, 10**9, where)
    if max_steps is not None:
        check_int(max_steps, "max_steps", 1, 10**12, where)
    if limit_train_batches is not None:
        ok = (
            isinstance(limit_train_batches, int)
            and not isinstance(limit_train_batches, bool)
            and limit_train_batches >= 0
        ) or (isinstance(limit_train_batches, float) and 0.0 <= limit_train_batches <= 1.0)
        if not ok:
            raise UsageError(
                f"{where}: limit_train_batches must be a batch count (int >= 0) or a fraction (float in [0, 1]), "
                f"got {limit_train_batches!r}"
            )
    loop = VanillaLoop(
        module,
        train_dataloaders,
        device=device,
        precision=precision,
        accumulate_grad_batches=accumulate_grad_batches,
        gradient_clip_val=gradient_clip_val,
        gradient_clip_algorithm=gradient_clip_algorithm,
    )
    per_epoch = _batches_per_epoch(loop.loader, limit_train_batches)
    times = []
    for _ in range(max_epochs):
        n = per_epoch
        if max_steps is not None:
            left = (max_steps - loop.steps) * loop.accumulate
            if left <= 0:
                break
            n = left if n is None else min(n, left)
        if n == 0:
            break
        times.append(loop.run_epoch(n))
    return times
