"""What the two step checks share: where a tensor was born, where an event happened, what is allowed.

``no_host_sync`` and ``on_device`` both need to know which tensors live on the
host *by construction*: a tensor made by a factory call (``torch.randn``,
``torch.tensor``, ``torch.zeros``...) without ``device=`` stays in host memory
even on a GPU run. ``.item()`` on it is not a device sync (``no_host_sync``
must not count it), and moving it to the device every step is exactly the bug
``on_device`` reports. On a CPU-only machine every tensor is on the CPU, so
this is the only way to tell "a host tensor" from "a tensor that would live on
the accelerator".

The probe (installed once while any run is active, undone with it):

- wraps the factory functions of the ``torch`` namespace and records each
  host-born result in a registry keyed by ``id`` with a weak reference (an
  entry disappears with its tensor; the registry is emptied when the probe is
  undone). Factories called by torch itself (``nn.Linear`` building its
  weights) are recorded as host tensors but never blamed on anyone;
- follows a host-born tensor through views (``t._base``), dtype conversions
  (``.float()``, ``.long()``, ``.to(dtype)``...) and device moves (``.to(device)``,
  ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``dst.copy_(t)``). A move tells
  the listeners (``on_device``) and, when the move returns the very same
  tensor (always, on a CPU-only machine), the tensor stops counting as a host
  tensor: from then on it stands for the device copy. This is what keeps a
  buffer moved with its module, or a batch moved to the device, a device tensor.
  A move made by torch's own code (``module.to()``) or ``register_buffer`` marks
  the tensor as travelling with its module: never blamed;
- on a machine with an accelerator, remembers the tensors DataLoaders yield
  (and their conversions), so a real host-to-device copy of anything else can
  be told from a batch;
- marks an optimizer's ``step`` counters as host tensors when it steps (torch
  keeps them on the host on purpose unless ``capturable``/``fused``);
- moves a warning torch raises inside one of these wrappers to the caller's
  line (see :func:`_relocate_warnings`).

Known blind spots, by design (catching them would mean intercepting every torch
call, 1.3-1.9x on a small step): tensors derived by arithmetic (``torch.rand(n) < p``),
``torch.stack``/``torch.cat`` of host tensors, factories imported by name before
the run (``from torch import randn``), and the legacy ``torch.FloatTensor(...)``
constructors.

It also holds the helpers both checks use to locate an event (the innermost
frame outside torch, keyed by code object and line, the full stack captured
only the first time a key is seen) and the allow-lists of sites and functions.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import weakref
from dataclasses import dataclass, field
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Callable, Iterable, Optional

from .. import stacks
from ..report import NOT_CHECKED, PASSED, CheckResult
from ..stacks import PYTEST, STDLIB, TORCH, TORCHPERF, Frame, Stack
from ..watch import FLAGS, active_runs

if TYPE_CHECKING:
    from ..patching import Patcher
    from ..watch import Run

__all__ = [
    "AllowList",
    "Birth",
    "Located",
    "Move",
    "birth_of",
    "compiling",
    "frequency",
    "from_loader",
    "install",
    "is_host_tensor",
    "locate",
    "mark_host",
    "move_listeners",
    "owner_label",
    "stack_cache",
    "unit_of",
    "units_total",
]

# -- frames ------------------------------------------------------------------------

_SKIP_FOR_CALLER = frozenset((TORCHPERF, STDLIB, PYTEST))
_SKIP_FOR_SITE = frozenset((TORCHPERF, TORCH, STDLIB, PYTEST))
#: Torch functions that only wrap another one (decorators, dispatch helpers): never named as "via".
_WRAPPER_NAMES = frozenset(("decorate_context", "wrapper", "wrapped", "inner", "fn", "_fn", "forward", "__call__"))


#: Code torch generates at run time (``torch.fx`` graphs run by torch.compile's eager backend): torch's own.
_GENERATED = "<eval_with_key>"


def kind_of(code: CodeType) -> str:
    """The frame kind of ``code`` (see :mod:`pytest_torchperf.stacks`); cached per file name."""
    filename = code.co_filename
    if filename.startswith(_GENERATED):
        return TORCH
    return stacks.classify(filename)


@dataclass(frozen=True)
class Located:
    """Where an event happened, found by walking ``f_back`` from the frame that triggered it."""

    #: The innermost frame outside torch, the standard library, pytest and torchperf (None: none).
    frame: Optional[FrameType]
    #: That frame's kind: user, framework or library.
    kind: str
    #: The kind of the innermost frame outside the standard library, pytest and torchperf:
    #: ``torch`` when torch's own Python code made the call on the site's behalf.
    caller_kind: str
    #: The torch function the site called into, when the event happened inside it.
    via: Optional[str]

    @property
    def key(self) -> Optional[tuple[CodeType, int]]:
        if self.frame is None:
            return None
        return (self.frame.f_code, self.frame.f_lineno)


def locate(frame: Optional[FrameType]) -> Located:
    """Locate the event whose innermost Python frame is ``frame`` (cheap: a few ``f_back`` hops)."""
    caller_kind: Optional[str] = None
    via: Optional[str] = None
    f = frame
    while f is not None:
        code = f.f_code
        kind = kind_of(code)
        if kind in _SKIP_FOR_SITE:
            if kind == TORCH:
                if caller_kind is None:
                    caller_kind = TORCH
                name = code.co_name
                if not name.startswith("_") and name not in _WRAPPER_NAMES:
                    via = name  # keeps the outermost: the torch function the site called
            f = f.f_back
            continue
        return Located(f, kind, caller_kind or kind, via if caller_kind == TORCH else None)
    return Located(None, TORCH, caller_kind or TORCH, via)


def caller(frame: Optional[FrameType]) -> Optional[FrameType]:
    """The innermost frame outside the standard library, pytest and torchperf: who made the call."""
    f = frame
    while f is not None and kind_of(f.f_code) in _SKIP_FOR_CALLER:
        f = f.f_back
    return f


def stack_of(frame: Optional[FrameType]) -> Stack:
    """The stack from ``frame`` outwards as :class:`~pytest_torchperf.stacks.Frame`, outermost first."""
    frames = []
    f = frame
    while f is not None:
        frames.append(Frame(f.f_code.co_filename, f.f_lineno, f.f_code.co_name))
        f = f.f_back
    frames.reverse()
    return tuple(frames)


class StackCache:
    """One captured stack per event key: the first time a site is seen, and never again."""

    def __init__(self) -> None:
        self._stacks: dict[Any, Stack] = {}

    def get(self, key: Any, frame: Optional[FrameType]) -> Stack:
        stack = self._stacks.get(key)
        if stack is None:
            stack = self._stacks[key] = stack_of(frame)
        return stack

    def clear(self) -> None:
        self._stacks.clear()


stack_cache = StackCache()


def describe_frame(frame: FrameType) -> Frame:
    return Frame(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


def unit_of(run: "Run") -> Optional[int]:
    """The step (or, for scope 'batch', the batch) an event of ``run`` belongs to; None between steps."""
    if run._step_depth == 0 and run._batch_depth == 0:
        return None
    return run.batches if run.options.scope == "batch" else run.steps


def units_total(run: "Run") -> int:
    return run.batches if run.options.scope == "batch" else run.steps


def in_scope_runs() -> list["Run"]:
    return [run for run in active_runs() if run.in_scope]


def frequency(per_unit: dict[int, int], outside: int, total: int) -> str:
    """``"3 per step over 12 steps"``, ``"5 times in 2 of 12 steps"``, ``"2 times outside steps"``..."""
    parts = []
    if per_unit:
        seen = len(per_unit)
        counts = set(per_unit.values())
        total = max(total, seen)
        steps = "step" if total == 1 else "steps"
        if len(counts) == 1:
            each = counts.pop()
            if seen == total:
                parts.append(f"{each} per step over {total} {steps}")
            else:
                parts.append(f"{each} per step in {seen} of {total} {steps}")
        else:
            count = sum(per_unit.values())
            lo, hi = min(per_unit.values()), max(per_unit.values())
            where = f"over {total} {steps}" if seen == total else f"in {seen} of {total} {steps}"
            parts.append(f"{count} times {where} ({lo} to {hi} per step)")
    if outside:
        times = "time" if outside == 1 else "times"
        parts.append(f"{outside} {times} outside training steps")
    return ", ".join(parts) or "never"


def over_budget(per_units: Iterable[dict[int, int]], outside: int, budget: Optional[int]) -> tuple[int, bool]:
    """``(worst, over)``: the most events in one step (summed over sites) and whether a budget is broken.

    Without a budget every event breaks it; with one, a step may make up to
    ``budget`` events, and events outside any step always break it.
    """
    per_step: dict[int, int] = {}
    for per_unit in per_units:
        for unit, count in per_unit.items():
            per_step[unit] = per_step.get(unit, 0) + count
    worst = max(per_step.values(), default=0)
    if budget is None:
        return worst, bool(per_step) or outside > 0
    return worst, worst > budget or outside > 0


def clean_result(
    name: str, run: "Run", total: int, seen: bool, passed: str, extras: list[str], findings: list, figures: dict
) -> CheckResult:
    """The verdict of a step check with nothing to fail: passed, or not checked when no step was seen.

    ``passed`` is the summary's head (``"no sync in your code over 12 steps"``),
    ``extras`` the notes that follow it (``"24 in lightning_fabric (noted)"``).
    """
    if total == 0 and run.options.scope != "test" and not seen:
        summary = (
            "no training step observed: mark steps with `with run.step():`, fit a LightningModule, "
            "or use scope='test'"
        )
        return CheckResult(name, NOT_CHECKED, summary, 0, findings, figures)
    return CheckResult(name, PASSED, passed + "".join(f"; {e}" for e in extras), 0, findings, figures)


def owner_label(frame: Frame) -> str:
    """``pytorch_lightning`` for a framework frame: the top package its file lives in."""
    path = stacks.display_path(frame.filename)
    top = path.replace("\\", "/").split("/", 1)[0]
    return top[:-3] if top.endswith(".py") else top


# -- allow-lists -----------------------------------------------------------------------


class AllowList:
    """Entries of ``allowed_syncs`` / ``allowed_copies``: sites, files and function names.

    - ``"path/file.py:LINE"``: that line; the path matches the end of the file's
      path on a directory boundary (``"train.py:12"``, ``"pkg/train.py:12"`` or absolute).
    - ``"path/file.py"``: any line of that file.
    - ``"name"`` / ``"Class.name"``: any event with that function anywhere in its
      call stack (so an entry can cover a helper and everything it calls).
    """

    def __init__(self, entries: tuple[str, ...]) -> None:
        self.entries = entries
        self._sites: list[tuple[str, Optional[int], str]] = []
        self._functions: list[tuple[tuple[str, ...], str]] = []
        for entry in entries:
            if entry.endswith(".py") or ".py:" in entry:
                path, _, line = entry.rpartition(":") if ".py:" in entry else (entry, "", "")
                self._sites.append((os.path.normpath(path), int(line) if line else None, entry))
            else:
                self._functions.append((tuple(entry.split(".")), entry))
        self._file_cache: dict[tuple[str, int], Optional[str]] = {}

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def needs_stack(self) -> bool:
        """Whether a match depends on the whole call stack (function entries), not just the site."""
        return bool(self._functions)

    def match_site(self, filename: str, lineno: int) -> Optional[str]:
        key = (filename, lineno)
        if key in self._file_cache:
            return self._file_cache[key]
        found = None
        if self._sites:
            path = os.path.normpath(os.path.realpath(filename))
            for suffix, line, entry in self._sites:
                if line is not None and line != lineno:
                    continue
                if path == suffix or path.endswith(os.sep + suffix.lstrip(os.sep)) or path == os.path.realpath(suffix):
                    found = entry
                    break
        self._file_cache[key] = found
        return found

    def match_frames(self, frame: Optional[FrameType]) -> Optional[str]:
        """The first function entry naming a frame from ``frame`` outwards."""
        if not self._functions:
            return None
        f = frame
        while f is not None:
            code = f.f_code
            for parts, entry in self._functions:
                if code.co_name != parts[-1]:
                    continue
                if len(parts) == 1 or _qualname_matches(f, parts):
                    return entry
            f = f.f_back
        return None

    @property
    def function_names(self) -> set[str]:
        """The bare function names the function entries end with."""
        return {parts[-1] for parts, _ in self._functions}

    def match_names(self, names: frozenset[str]) -> Optional[str]:
        """The first function entry among ``names`` (qualified-name suffixes from :func:`function_names`)."""
        for _, entry in self._functions:
            if entry in names:
                return entry
        return None

    def match(self, located: Located, frame: Optional[FrameType]) -> Optional[str]:
        site = located.frame
        if site is not None and self._sites:
            entry = self.match_site(site.f_code.co_filename, site.f_lineno)
            if entry:
                return entry
        return self.match_frames(frame)


#: Function names some run's allow-list names (``allowed_copies``): a birth inside one of them
#: remembers it, so an entry can name the function that built a tensor moved elsewhere.
birth_functions: set[str] = set()


def function_names(frame: Optional[FrameType]) -> frozenset[str]:
    """Every function of the stack whose name is in :data:`birth_functions`, as qualified-name suffixes."""
    names: set[str] = set()
    f = frame
    while f is not None:
        code = f.f_code
        if code.co_name in birth_functions:
            qualname = getattr(code, "co_qualname", None)
            if qualname is None:  # Python < 3.11: the method's class from ``self``/``cls``
                owner = f.f_locals.get("self", f.f_locals.get("cls"))
                classes = []
                if owner is not None:
                    cls = owner if isinstance(owner, type) else type(owner)
                    classes = [c.__name__ for c in cls.__mro__]
                names.add(code.co_name)
                names.update(f"{c}.{code.co_name}" for c in classes)
            else:
                parts = qualname.replace(".<locals>", "").split(".")
                names.update(".".join(parts[i:]) for i in range(len(parts)))
        f = f.f_back
    return frozenset(names)


def _qualname_matches(frame: FrameType, parts: tuple[str, ...]) -> bool:
    qualname = getattr(frame.f_code, "co_qualname", None)  # Python 3.11+
    if qualname is not None:
        return ("." + qualname.replace(".<locals>", "")).endswith("." + ".".join(parts))
    # Python < 3.11: a method's class from its ``self`` (or ``cls``) argument.
    if len(parts) != 2:
        return False
    owner = frame.f_locals.get("self", frame.f_locals.get("cls"))
    if owner is None:
        return False
    cls = owner if isinstance(owner, type) else type(owner)
    return any(c.__name__ == parts[0] for c in cls.__mro__)


# -- host-born tensors ----------------------------------------------------------------


@dataclass(eq=False)
class Birth:
    """How a host tensor came to be: the factory, who called it, where, in which runs' steps."""

    #: The factory: ``"randn"``, ``"tensor"``...
    factory: str
    #: The frame kind that called the factory: user, framework, library or torch (torch's own code).
    caller_kind: str
    #: Where (the innermost frame outside torch), None for torch's own tensors.
    site: Optional[Frame]
    #: The stack of the first birth at that site.
    stack: Stack
    #: ``device="cpu"`` written out, or ``pin_memory=True``: placed on the host on purpose.
    explicit: bool
    #: ``(run, unit)`` for each run whose step checks applied at birth (unit None: between steps).
    in_scope: tuple[tuple["Run", Optional[int]], ...]
    #: The factory call's ``shape``/``dtype`` for the hint.
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: Moved to a device in place (the move returned the tensor itself): no longer a host tensor.
    moved: bool = False
    #: Registered as a buffer, or moved by torch's own code (``module.to()``): it travels with its module.
    with_module: bool = False
    #: Dtype conversions and views on the way from the factory to the move (``float``, ``view``...).
    path: tuple[str, ...] = field(default_factory=tuple)
    #: Functions on the stack at birth that an allow-list names (see :func:`function_names`).
    functions: frozenset[str] = frozenset()

    def in_scope_of(self, run: "Run") -> bool:
        return any(r is run for r, _ in self.in_scope)

    def derived(self, step: str) -> "Birth":
        return Birth(
            self.factory, self.caller_kind, self.site, self.stack, self.explicit, self.in_scope,
            self.shape, self.dtype, False, False, self.path + (step,), self.functions,
        )


#: id(tensor) -> (weak reference, birth). Emptied when the probe is undone.
_births: dict[int, tuple[Any, Birth]] = {}
#: id(tensor) -> weak reference, for the births that are host tensors now (not moved): the hot paths'
#: one-lookup answer to "is this a host tensor?".
_host: dict[int, Any] = {}


def _forget(key: int, ref: Any) -> None:
    entry = _births.get(key)
    if entry is not None and entry[0] is ref:
        del _births[key]
    if _host.get(key) is ref:
        del _host[key]


def _remember(tensor: Any, birth: Birth) -> None:
    key = id(tensor)
    try:
        ref = weakref.ref(tensor, lambda r, key=key: _forget(key, r))
    except TypeError:  # pragma: no cover - a tensor type without weak references
        return
    _births[key] = (ref, birth)
    if birth.moved:
        _host.pop(key, None)
    else:
        _host[key] = ref


def _no_longer_host(tensor: Any, birth: Birth, with_module: bool = False) -> None:
    birth.moved = True
    birth.with_module = birth.with_module or with_module
    _host.pop(id(tensor), None)


def _own_birth(tensor: Any) -> Optional[Birth]:
    entry = _births.get(id(tensor))
    if entry is not None and entry[0]() is tensor:
        return entry[1]
    return None


def birth_of(tensor: Any) -> Optional[Birth]:
    """The :class:`Birth` of a host-born tensor (or of the tensor it is a view of), else None."""
    if not _births:
        return None
    birth = _own_birth(tensor)
    if birth is None:
        base = getattr(tensor, "_base", None)
        if base is not None:
            birth = _own_birth(base)
            if birth is not None and not birth.moved:
                birth = birth.derived("view")
    return birth


def is_host_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` lives on the host by construction (a factory without ``device=``, not moved since)."""
    ref = _host.get(id(tensor))
    if ref is not None and ref() is tensor:
        return True
    birth = birth_of(tensor)
    return birth is not None and not birth.moved


def mark_host(tensor: Any, caller_kind: str = TORCH) -> None:
    """Record ``tensor`` as a host tensor that nobody is to blame for (``.cpu()`` results, optimizer steps)."""
    if _own_birth(tensor) is None:
        _remember(tensor, Birth("", caller_kind, None, (), True, ()))


def _mark_moved(tensor: Any, birth: Birth, with_module: bool) -> None:
    """``tensor`` was moved in place (on a CPU-only machine, always): it now stands for the device copy."""
    own = _own_birth(tensor)
    if own is None:  # a view of a host tensor: it gets its own record
        own = birth.derived("view")
        _remember(tensor, own)
    _no_longer_host(tensor, own, with_module)


# -- tensors a DataLoader produced (only tracked where a real copy can happen) ------------

_from_loader: dict[int, Any] = {}


def _remember_loader(tensor: Any) -> None:
    key = id(tensor)
    try:
        ref = weakref.ref(tensor, lambda r, key=key: _from_loader.pop(key, None) if _from_loader.get(key) is r else None)
    except TypeError:  # pragma: no cover
        return
    _from_loader[key] = ref


def _mark_batch(batch: Any, depth: int = 0) -> None:
    """Remember every tensor of a batch (tuples, lists, dicts, a few levels deep)."""
    if isinstance(batch, _Tensor[0]):
        _remember_loader(batch)
    elif depth < 4:
        if isinstance(batch, dict):
            for value in batch.values():
                _mark_batch(value, depth + 1)
        elif isinstance(batch, (list, tuple)):
            for value in batch:
                _mark_batch(value, depth + 1)


def from_loader(tensor: Any) -> bool:
    """Whether ``tensor`` (or the tensor it is a view of) came out of a DataLoader during the run."""
    for t in (tensor, getattr(tensor, "_base", None)):
        if t is not None:
            ref = _from_loader.get(id(t))
            if ref is not None and ref() is t:
                return True
    return False


# -- factories -------------------------------------------------------------------------

#: ``torch.<name>`` functions that build a tensor from nothing or from host data.
FACTORIES = (
    "tensor", "as_tensor", "asarray", "from_numpy",
    "zeros", "ones", "empty", "full", "eye", "empty_strided", "scalar_tensor",
    "arange", "linspace", "logspace",
    "rand", "randn", "randint", "randperm", "normal",
    "tril_indices", "triu_indices",
    "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window",
)
#: Factories whose first argument is data: a tensor there is converted, not built.
_DATA_FACTORIES = frozenset(("tensor", "as_tensor", "asarray"))
#: Tensor methods that convert the dtype and so return a new tensor with the same provenance.
CONVERSIONS = ("float", "double", "half", "bfloat16", "long", "int", "short", "bool")


def _is_cpu_string(device: Any) -> bool:
    return isinstance(device, str) and device.split(":")[0] == "cpu"


def _born(name: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]) -> None:
    tensor_type = _Tensor[0]
    if not isinstance(out, tensor_type) or out.device.type != "cpu":
        return
    device = kwargs.get("device")
    if device is not None and not _is_cpu_string(device):
        # ``device=x.device`` / ``device=self.device``: the training device (the CPU on this machine).
        return
    if name in _DATA_FACTORIES and args and isinstance(args[0], tensor_type):
        return
    if name == "normal" and any(isinstance(a, tensor_type) for a in args):
        return  # normal(mean_tensor, std_tensor): follows its inputs
    explicit = device is not None or bool(kwargs.get("pin_memory"))
    site = caller(frame)
    kind = kind_of(site.f_code) if site is not None else TORCH
    if kind == TORCH:
        birth = Birth(name, TORCH, None, (), explicit, ())
    else:
        scope: tuple[tuple["Run", Optional[int]], ...] = ()
        if FLAGS.in_scope:
            scope = tuple((run, unit_of(run)) for run in in_scope_runs())
        stack = stack_cache.get(("birth", site.f_code, site.f_lineno), site)
        birth = Birth(
            name, kind, describe_frame(site), stack, explicit, scope,
            tuple(out.shape), str(out.dtype).replace("torch.", ""),
        )
        if birth_functions:
            birth.functions = function_names(site)
    _remember(out, birth)


# -- moves -------------------------------------------------------------------------------

#: Called as ``listener(event)`` for every move of a host-born tensor inside a step
#: and, with ``event.birth`` None, for every real host-to-device copy inside a step.
move_listeners: list[Callable[["Move"], None]] = []


@dataclass
class Move:
    """A tensor sent to a device: ``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``copy_``."""

    op: str
    tensor: Any
    #: The host-born tensor's birth (None: a real copy of a tensor of unknown provenance).
    birth: Optional[Birth]
    #: The first move of that tensor (later ones copy the same host tensor again).
    first: bool
    #: The target: a ``torch.device``, a device string, or a tensor whose device is meant.
    target: Any
    frame: Optional[FrameType]
    #: Source on the CPU and result on an accelerator: a real host-to-device copy.
    real_copy: bool = False


def _target_of_to(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device a ``Tensor.to(...)`` call moves to (a device, str, int or tensor), None for dtype only."""
    device = kwargs.get("device")
    if device is not None:
        return device
    tensor_type = _Tensor[0]
    device_type = _Device[0]
    for arg in args:
        if isinstance(arg, (str, device_type, tensor_type)):
            return arg
        if isinstance(arg, int) and not isinstance(arg, bool):
            return arg
    other = kwargs.get("other")
    return other if isinstance(other, tensor_type) else None


def _tell(event: "Move") -> None:
    for listener in list(move_listeners):
        listener(event)


def _on_move(op: str, tensor: Any, target: Any, out: Any, frame: Optional[FrameType], told: bool = False) -> None:
    """After a move: tell the listeners (inside a step) and update the host registry.

    ``told``: the listeners already heard of this move (``.cuda()`` tells them
    before the call, which raises on a machine without CUDA).
    """
    birth = birth_of(tensor)
    first = birth is not None and not birth.moved
    if FLAGS.in_scope and move_listeners and not told:
        real = tensor.device.type == "cpu" and isinstance(out, _Tensor[0]) and out.device.type not in ("cpu", "meta")
        known = birth if birth is not None and not birth.with_module else None
        if known is not None or real:
            _tell(Move(op, tensor, known, first, target, frame, real))
    if birth is not None and first and out is tensor:
        mover = caller(frame)
        _mark_moved(tensor, birth, mover is None or kind_of(mover.f_code) == TORCH)


# -- install -----------------------------------------------------------------------------

_Tensor: list[Any] = [None]
_Device: list[Any] = [None]
_compiling: list[Callable[[], bool]] = [lambda: False]


def compiling() -> bool:
    """Whether TorchDynamo is tracing right now (the probes then get out of its way)."""
    return _compiling[0]()


def _is_compiling_function() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``: True while torch.compile traces (TorchDynamo folds it to True, and
    its fake-tensor and AOT passes set it), so the wrappers call straight through and record nothing."""
    import torch

    fn = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    if fn is None:  # torch < 2.3
        fn = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return fn or (lambda: False)


def install(patcher: "Patcher") -> None:
    """Patch torch's factories, conversions and moves while a run is active; undone by ``patcher``."""
    import torch

    tensor_type = torch.Tensor
    _Tensor[0] = tensor_type
    _Device[0] = torch.device
    is_compiling = _is_compiling_function()
    _compiling[0] = is_compiling
    flags = FLAGS
    getframe = sys._getframe

    def factory(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def make(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(*args, **kwargs)
            if flags.active and not is_compiling():
                _born(name, out, args, kwargs, getframe(1))
            return out

        return functools.wraps(original)(make)

    for name in FACTORIES:
        original = getattr(torch, name, None)
        if original is not None:
            patcher.setattr(torch, name, factory(name, original))

    def derive(name: str, self: Any, out: Any) -> None:
        """``out`` is ``self`` converted (dtype, ``.to(dtype)``): it keeps ``self``'s provenance."""
        birth = birth_of(self)
        if birth is not None and not birth.moved:
            _remember(out, birth.derived(name))
        elif _from_loader and from_loader(self):
            _remember_loader(out)

    def conversion(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def convert(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(self, *args, **kwargs)
            if out is not self and flags.active and not is_compiling() and (_births or _from_loader):
                derive(name, self, out)
            return out

        return functools.wraps(original)(convert)

    for name in CONVERSIONS:
        patcher.wrap(tensor_type, name, lambda original, name=name: conversion(name, original))

    # A real host-to-device copy can only happen where an accelerator is present.
    accelerated = torch.cuda.is_available() or bool(getattr(getattr(torch.backends, "mps", None), "is_available", lambda: False)())

    def after_to(self: Any, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]) -> None:
        birth = birth_of(self)
        if birth is None or (birth.moved and not flags.in_scope):
            if accelerated:
                target = _target_of_to(args, kwargs)
                if target is None:
                    if out is not self and _from_loader and from_loader(self):
                        _remember_loader(out)
                elif flags.in_scope:
                    _on_move("to", self, target, out, frame)
            return
        target = _target_of_to(args, kwargs)
        if target is None:
            if out is not self and not birth.moved:
                _remember(out, birth.derived("to"))
        else:
            _on_move("to", self, target, out, frame)

    births_get = _births.get

    def wrap_to(original: Callable[..., Any]) -> Callable[..., Any]:
        def to(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(self, *args, **kwargs)
            if flags.active and not is_compiling():
                if not accelerated and births_get(id(self)) is None:
                    # Fast path: not a host-born tensor (a batch, a parameter), unless a view of one.
                    base = self._base
                    if base is None or births_get(id(base)) is None:
                        return out
                after_to(self, out, args, kwargs, getframe(1))
            return out

        return functools.wraps(original)(to)

    def wrap_cuda(original: Callable[..., Any]) -> Callable[..., Any]:
        def cuda(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if not flags.active or is_compiling():
                return original(self, *args, **kwargs)
            told = False
            if flags.in_scope and move_listeners:
                birth = birth_of(self)
                if birth is not None and not birth.with_module:
                    # Told before the call: on a machine without CUDA the call raises; the code is still the bug.
                    _tell(Move("cuda", self, birth, not birth.moved, "cuda", getframe(1)))
                    told = True
            out = original(self, *args, **kwargs)
            _on_move("cuda", self, "cuda", out, getframe(1), told)
            return out

        return functools.wraps(original)(cuda)

    def wrap_type_as(original: Callable[..., Any]) -> Callable[..., Any]:
        def type_as(self: Any, other: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(self, other, *args, **kwargs)
            if flags.active and not is_compiling():
                _on_move("type_as", self, other, out, getframe(1))
            return out

        return functools.wraps(original)(type_as)

    def wrap_copy_(original: Callable[..., Any]) -> Callable[..., Any]:
        def copy_(self: Any, src: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if flags.in_scope and move_listeners and not is_compiling() and isinstance(src, tensor_type):
                birth = birth_of(src)
                real = src.device.type == "cpu" and self.device.type not in ("cpu", "meta")
                if birth is not None and not birth.moved and not birth.with_module and not is_host_tensor(self):
                    _tell(Move("copy_", src, birth, True, self, getframe(1), real))
                elif real:
                    _tell(Move("copy_", src, None, False, self, getframe(1), True))
            return original(self, src, *args, **kwargs)

        return functools.wraps(original)(copy_)

    if accelerated:
        # Batches are host tensors copied to the device by design: remember them, so the
        # check of real host-to-device copies leaves them alone.
        from torch.utils.data import dataloader

        def wrap_next(original: Callable[..., Any]) -> Callable[..., Any]:
            def __next__(self: Any) -> Any:
                __tracebackhide__ = True
                batch = original(self)
                if flags.active:
                    _mark_batch(batch)
                return batch

            return functools.wraps(original)(__next__)

        patcher.wrap(dataloader._BaseDataLoaderIter, "__next__", wrap_next)
        patcher.callback(_from_loader.clear)

    def wrap_register_buffer(original: Callable[..., Any]) -> Callable[..., Any]:
        def register_buffer(self: Any, name: str, tensor: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(self, name, tensor, *args, **kwargs)
            if tensor is not None and _births:
                birth = _own_birth(tensor)
                if birth is not None:
                    _no_longer_host(tensor, birth, with_module=True)  # it lives on the module's device
            return out

        return functools.wraps(original)(register_buffer)

    patcher.wrap(torch.nn.Module, "register_buffer", wrap_register_buffer)
    patcher.wrap(tensor_type, "to", wrap_to)
    patcher.wrap(tensor_type, "cuda", wrap_cuda)
    patcher.wrap(tensor_type, "type_as", wrap_type_as)
    patcher.wrap(tensor_type, "copy_", wrap_copy_)

    # Optimizers keep their ``step`` counters on the host on purpose unless capturable
    # or fused ("special device hosting for step"); a state loaded before the run
    # was not seen being born, so mark it when the optimizer steps.
    try:
        optimizer_module = importlib.import_module("torch.optim.optimizer")
    except ImportError:  # pragma: no cover
        optimizer_module = None
    register = getattr(optimizer_module, "register_optimizer_step_pre_hook", None)
    if register is not None:
        scanned: dict[int, tuple[int, int]] = {}

        def optimizer_pre_hook(optimizer: Any, args: Any, kwargs: Any) -> None:
            if not flags.in_scope:
                return
            state = optimizer.state
            seen = (id(state), len(state))
            if scanned.get(id(optimizer)) == seen:
                return  # nothing new since the last scan
            scanned[id(optimizer)] = seen
            for group in optimizer.param_groups:
                if group.get("capturable") or group.get("fused"):
                    continue
                for param in group["params"]:
                    param_state = state.get(param)
                    step = param_state.get("step") if param_state else None
                    if isinstance(step, tensor_type) and step.device.type == "cpu" and _own_birth(step) is None:
                        mark_host(step)

        handle = register(optimizer_pre_hook)
        patcher.callback(handle.remove)
        patcher.callback(scanned.clear)

    patcher.callback(_births.clear)
    patcher.callback(_host.clear)
    patcher.callback(stack_cache.clear)
    patcher.callback(birth_functions.clear)
    _relocate_warnings(patcher)


def _relocate_warnings(patcher: "Patcher") -> None:
    """Show a warning torch raises inside one of the wrappers at the caller's line, not the wrapper's.

    A warning raised by C code (``float()`` of a tensor that requires grad,
    ``torch.tensor(a_tensor)``, ``torch.from_numpy`` of a read-only array...) is
    located at the innermost Python frame, which is now a torchperf wrapper.
    The display hook moves it to the first frame outside torchperf, so pytest's
    warnings summary points at the user's line as it would without the watch.
    """
    import warnings

    original = getattr(warnings, "_showwarnmsg", None)
    if original is None:  # pragma: no cover - not CPython's warnings module
        return

    def _showwarnmsg(msg: Any) -> Any:
        if stacks.classify(msg.filename) == TORCHPERF:
            f = sys._getframe(1)
            while f is not None and kind_of(f.f_code) == TORCHPERF:
                f = f.f_back
            if f is not None:
                msg.filename, msg.lineno, msg.line = f.f_code.co_filename, f.f_lineno, None
        return original(msg)

    patcher.setattr(warnings, "_showwarnmsg", _showwarnmsg)
