"""Where the extra time went: Lightning's profiled actions with no counterpart in the vanilla loop.

The replay's profiler records inclusive seconds and calls per Lightning action
(``[Callback]X.on_train_batch_end``, ...) over its untimed warm-up epoch;
:func:`attribution` keeps the actions the vanilla loop has no counterpart for,
finds the methods behind them (your code or a library's), and
:func:`where_finding` turns them into the report's "where the extra time went".
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Optional

from ..report import Finding
from ..stacks import USER, classify, display_path
from ..timing.stats import fmt_seconds as _seconds

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
_ACTION_RE = re.compile(r"^\[(?P<kind>[^\]]+)\](?P<owner>.*)\.(?P<hook>[A-Za-z_][A-Za-z0-9_]*)$")


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
        return [(_module_hook_label(module, hook), module)]
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


def _module_hook_label(module: Any, hook: str) -> str:
    """``TinyRegressor.training_epoch_end (LightningModule hook)`` for a hook your class defines; the class that
    does define it otherwise (``LightningModule.configure_gradient_clipping``: Lightning's own, not yours)."""
    mine = type(module).__name__
    for klass in type(module).__mro__:
        if hook in vars(klass):
            if klass is type(module):
                return f"{mine}.{hook} (LightningModule hook)"
            site = _method_site(module, hook)
            if site is not None and site[1]:  # defined by a base class of your own
                return f"{klass.__name__}.{hook} (LightningModule hook, inherited by {mine})"
            return f"{klass.__name__}.{hook} (Lightning's own hook: {mine} does not override it)"
    return f"{mine}.{hook} (LightningModule hook)"


def _is_base_hook(obj: Any, hook: str) -> bool:
    for klass in type(obj).__mro__:
        if hook in vars(klass):
            return klass.__name__ == "Callback"
    return True


def attribution(replay: Any) -> list[_Hook]:
    """The profiled actions of ``replay`` (a :class:`~.replay.Replay`) with no counterpart in the vanilla loop, most
    time per batch first.
    """
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
        # An epoch's hook ran once in the profiled epoch, which may have ended early (the replay's warm-up):
        # its time is spread over a whole epoch's batches.
        per = replay.batches if "epoch" in hook and replay.batches > n else n
        hooks.append(_Hook(display, seconds / per, int(calls), locations))
    hooks.sort(key=lambda h: h.seconds_per_batch, reverse=True)
    return hooks


def where_finding(replay: Any, hooks: list[_Hook]) -> Finding:
    parity = replay.parity
    batches = max(replay.batches, 1)
    extra = (parity.candidate.median - parity.baseline.median) / batches
    shown = [h for h in hooks[:6] if h.seconds_per_batch >= max(extra * 0.02, 2e-6)]
    title = (
        f"where the extra {_seconds(max(extra, 0.0))} per batch went ({replay.batches} batches per epoch; "
        f"Lightning's profiler over the replay's untimed first epoch, {replay.profiled_batches} batches)"
    )
    if not hooks:
        return Finding(title, ["no per-hook figures: Lightning could not be profiled in this replay"])
    facts = []
    for h in shown:
        line = f"{_seconds(h.seconds_per_batch):>9} per batch  {h.name}"
        if h.calls and h.calls != replay.profiled_batches:
            line += f" ({h.calls} call{'s' if h.calls != 1 else ''} in {replay.profiled_batches} profiled batches)"
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
