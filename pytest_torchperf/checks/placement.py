"""Invariant ``on_device``: tensors are created on the device, not built on the host and copied every step.

``torch.randn(shape).to(self.device)``, ``torch.tensor([...]).to(x.device)``,
``torch.ones(n).type_as(x)`` (an idiom Lightning's docs once recommended) and
``torch.rand(n).cuda()`` fill a tensor in host memory and copy it to the
device, every step. ``torch.randn(shape, device=x.device)``, ``torch.ones_like(x)``,
``x.new_tensor([...])`` or a buffer registered once in ``__init__`` do not.

The probe is :mod:`._tensors`: it records every tensor a factory builds on the
host and tells this check when one of them is moved (``.to(device)``,
``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``dst.copy_(t)``). Inside a step
(``Run.in_scope``) such a move is a violation when

- the tensor was built by the user's code (the factory's caller is not torch)
  inside the step, without ``device=`` (so, on CPU-only machines too, where
  the move is a no-op: the code is the bug); or
- the very same tensor, built by the user's code outside the step (a plain
  attribute set in ``__init__``), is copied in two or more steps: it should be
  a buffer, moved once with the module.

Not violations: the right idioms above, ``device="cpu"`` or ``pin_memory=True``
written out (a host staging buffer on purpose), tensors torch builds itself
(``nn.Linear``'s weights) and anything moved by torch's own code (``module.to()``
moving parameters and buffers once). Lightning building its logging state on
the host and moving it is listed as a note, not a failure.

On an accelerator a real host-to-device copy of a tensor that did not come out
of a DataLoader (and is not pinned) is reported too, at the line that copied it.
"""

from __future__ import annotations

import ast
import linecache
import textwrap
import weakref
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional

from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import TORCH, USER, Frame, Stack
from ..watch import active_runs
from . import _tensors
from ._tensors import (
    AllowList,
    Birth,
    Move,
    clean_result,
    describe_frame,
    frequency,
    locate,
    over_budget,
    owner_label,
    stack_cache,
    unit_of,
    units_total,
)

if TYPE_CHECKING:
    from ..patching import Patcher
    from ..watch import Run

NAME = "on_device"

BUILT = "built in the step"
CONSTANT = "built once, copied every step"
COPY = "copied from the host"

#: Factories whose values are the same every step: a registered buffer is the better fix.
_CONSTANT_FACTORIES = frozenset(("tensor", "as_tensor", "asarray", "from_numpy", "arange", "linspace", "logspace",
                                 "eye", "zeros", "ones", "full", "tril_indices", "triu_indices",
                                 "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window"))
_NEW_METHODS = {"zeros": "new_zeros", "ones": "new_ones", "empty": "new_empty", "full": "new_full",
                "tensor": "new_tensor", "as_tensor": "new_tensor", "asarray": "new_tensor"}
_LIKE = {"zeros": "zeros_like", "ones": "ones_like", "empty": "empty_like", "full": "full_like",
         "rand": "rand_like", "randn": "randn_like", "randint": "randint_like"}


# -- per-run state and verdict ----------------------------------------------------------------


class _Copy:
    """One pattern (created here, moved there) as one run saw it."""

    def __init__(self, event: Move, mover: Frame, move_stack: Stack, by_user: bool, allowed_by: Optional[str]) -> None:
        self.birth: Optional[Birth] = event.birth
        self.op = event.op
        self.mover = mover
        self.move_stack = move_stack
        self.by_user = by_user
        self.allowed_by = allowed_by
        self.count = 0
        self.per_unit: dict[int, int] = {}
        self.outside = 0
        #: A tensor built inside the step was moved (the first move of it).
        self.built_in_step = False
        #: id(tensor) -> (weak reference, the steps it was copied in): the same tensor copied again and again.
        self._tensors: dict[int, tuple[Any, set[Optional[int]]]] = {}
        #: The most steps one tensor was copied in.
        self.most_steps = 0
        self.hint = _spell(event, mover)
        tensor = event.tensor
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).replace("torch.", "")
        self.real = event.real_copy

    def add(self, event: Move, unit: Optional[int], built_in_step: bool) -> None:
        self.count += 1
        if unit is None:
            self.outside += 1
        else:
            self.per_unit[unit] = self.per_unit.get(unit, 0) + 1
        self.real = self.real or event.real_copy
        self.built_in_step = self.built_in_step or built_in_step
        tensor = event.tensor
        entry = self._tensors.get(id(tensor))
        if entry is None or entry[0]() is not tensor:  # a new tensor (maybe at a dead one's address)
            try:
                entry = self._tensors[id(tensor)] = (weakref.ref(tensor), set())
            except TypeError:  # pragma: no cover
                return
        entry[1].add(unit)
        self.most_steps = max(self.most_steps, len(entry[1]))

    @property
    def repeated(self) -> bool:
        """The very same host tensor was copied in two or more steps (it should be a buffer)."""
        return self.most_steps > 1

    @property
    def kind(self) -> str:
        if self.birth is None:
            return COPY
        return CONSTANT if self.repeated else BUILT

    @property
    def broken(self) -> bool:
        return self.birth is None or self.built_in_step or self.repeated

    @property
    def creation(self) -> Optional[Frame]:
        return self.birth.site if self.birth else None

    def to_dict(self, total: int) -> dict[str, Any]:
        creation = self.creation
        return {
            "kind": self.kind,
            "factory": f"torch.{self.birth.factory}" if self.birth else None,
            "created_at": creation.location() if creation else None,
            "created_source": creation.source if creation else None,
            "moved_by": self.op,
            "moved_at": self.mover.location(),
            "moved_source": self.mover.source,
            "function": self.mover.function,
            "code": "user" if self.by_user else "framework",
            "count": self.count,
            "steps_with_copy": len(self.per_unit),
            "frequency": frequency(self.per_unit, self.outside, total),
            "shape": list(self.shape),
            "dtype": self.dtype,
            "real_copy": self.real,
            "allowed_by": self.allowed_by,
            "hint": self.hint,
        }


class DevicePlacementCheck:
    """Per-run state and verdict of ``on_device``."""

    name = NAME

    def __init__(self, run: "Run") -> None:
        self.run = run
        self.allow = AllowList(run.options.allowed_copies)
        _tensors.birth_functions.update(self.allow.function_names)
        self._copies: dict[Any, _Copy] = {}
        self.error: Optional[str] = None

    # -- events from the probe ----------------------------------------------------------
    def on_move(self, event: Move, mover: _tensors.Located, frame: Optional[FrameType]) -> None:
        run = self.run
        birth = event.birth
        built_in_step = False
        if birth is not None:
            if birth.caller_kind == TORCH or birth.explicit or birth.site is None or birth.with_module:
                return  # torch's own tensors, a host buffer on purpose, or one that moves with its module
            born_in_scope = birth.in_scope_of(run)
            if not born_in_scope and birth.caller_kind != USER:
                return  # a library's state, built before the step
            if not event.first and (mover.kind != USER or _reassigns(mover.frame)):
                # Moved before, and moved in place (on a CPU-only machine, always): ``self.w = self.w.to(dev)``
                # moves it once (later moves are no-ops on the device). Libraries do this too (torchmetrics
                # states): only the user's own ``w = self.w.to(dev)`` in a step copies it again and again.
                return
            # Built and moved in the same step (for scope="test": both outside steps, or in the same one).
            born_in = next((u for r, u in birth.in_scope if r is run), None)
            built_in_step = born_in_scope and event.first and born_in == unit_of(run)
            by_user = birth.caller_kind == USER
        elif event.real_copy:
            if _tensors.from_loader(event.tensor) or _is_pinned(event.tensor):
                return
            by_user = mover.kind == USER
        else:
            return
        if mover.frame is None:
            return
        allowed_by = None
        if self.allow:
            allowed_by = self.allow.match(mover, frame)
            if allowed_by is None and birth is not None and birth.site is not None:
                allowed_by = self.allow.match_site(birth.site.filename, birth.site.lineno)
                allowed_by = allowed_by or self.allow.match_names(birth.functions)
        created = (birth.site.filename, birth.site.lineno) if birth is not None and birth.site else None
        key = (created, mover.frame.f_code, mover.frame.f_lineno, event.op, allowed_by)
        copy = self._copies.get(key)
        if copy is None:
            move_stack = stack_cache.get(("move",) + key[1:3], frame)
            copy = self._copies[key] = _Copy(event, describe_frame(mover.frame), move_stack, by_user, allowed_by)
        copy.add(event, unit_of(run), built_in_step)

    # -- verdict -------------------------------------------------------------------------
    def _finding(self, copy: _Copy, total: int, note: str = "") -> Finding:
        freq = frequency(copy.per_unit, copy.outside, total)
        op = {"to": ".to(...)", "cuda": ".cuda()", "type_as": ".type_as(...)", "copy_": ".copy_(...)"}[copy.op]
        birth = copy.birth
        facts = []
        sites = []
        if birth is not None and birth.site is not None:
            made = f"torch.{birth.factory}(...)"
            via = "".join(f".{step}()" for step in birth.path if step != "view")
            if copy.kind == CONSTANT:
                title = f"{note}the same {made} copied again with {op} in {copy.mover.function}: {freq}"
            else:
                title = f"{note}{made}{via} built on the host, then copied with {op} in {copy.mover.function}: {freq}"
            if birth.site.location() == copy.mover.location():
                facts.append(f"created and moved at {birth.site.location()}: {birth.site.source}")
                sites.append(Site(f"torch.{birth.factory} then {op}", copy.move_stack, copy.count))
            else:
                facts.append(f"created at {birth.site.location()}: {birth.site.source}")
                facts.append(f"moved at {copy.mover.location()}: {copy.mover.source}")
                sites.append(Site(f"created by torch.{birth.factory}", birth.stack, copy.count))
                sites.append(Site(f"copied by {op}", copy.move_stack, copy.count))
        else:
            title = f"{note}host tensor copied to the device with {op} in {copy.mover.function}: {freq}"
            sites.append(Site(f"copied by {op}", copy.move_stack, copy.count))
        facts.append(f"tensor: shape {tuple(copy.shape)}, {copy.dtype}")
        if copy.kind == CONSTANT:
            facts.append(
                f"the very same tensor was copied in {copy.most_steps} steps: it should be built on the device once"
            )
        if copy.real:
            facts.append("a real host-to-device copy on this machine")
        else:
            facts.append("on this CPU-only run the move is a no-op; on a GPU it is a host-to-device copy each time")
        if copy.allowed_by:
            facts.append(f"accepted by allowed_copies entry {copy.allowed_by!r}")
        elif not copy.by_user:
            facts.append(f"made by {owner_label(copy.creation or copy.mover)}, not by your code: a note, not a failure")
        hint = copy.hint if copy.by_user and not copy.allowed_by else ""
        if not (copy.by_user and not copy.allowed_by):
            sites = [Site(s.label, _short(s.stack), s.count) for s in sites]
        return Finding(title, facts, sites, hint)

    def result(self) -> CheckResult:
        run = self.run
        total = units_total(run)
        copies = sorted((c for c in self._copies.values() if c.broken), key=lambda c: -c.count)
        failing = [c for c in copies if c.by_user and not c.allowed_by]
        noted = [c for c in copies if not c.by_user and not c.allowed_by]
        allowed = [c for c in copies if c.allowed_by]
        steps = "step" if total == 1 else "steps"
        figures: dict[str, Any] = {
            "scope": run.options.scope,
            "steps": total,
            "host_built_copies": sum(c.count for c in failing),
            "sites": len(failing),
            "framework_copies": sum(c.count for c in noted),
            "allowed_copies": sum(c.count for c in allowed),
            "events": [c.to_dict(total) for c in copies],
        }
        budget = run.options.max_copies_per_step
        worst, over = over_budget((c.per_unit for c in failing), sum(c.outside for c in failing), budget)
        figures["worst_step_copies"] = worst
        figures["max_copies_per_step"] = budget
        findings = [self._finding(c, total) for c in failing]
        findings += [self._finding(c, total, "note: ") for c in noted]
        findings += [self._finding(c, total, "allowed: ") for c in allowed]
        if self.error:
            return CheckResult(NAME, NOT_CHECKED, f"internal error: {self.error}", 0, findings, figures)
        if failing and not over:
            count = sum(c.count for c in failing)
            summary = (
                f"{count} host-built tensor cop{'ies' if count != 1 else 'y'}, at most {worst} in a step: "
                f"within max_copies_per_step={budget}"
            )
            return CheckResult(NAME, PASSED, summary, 0, findings, figures)
        if failing:
            count = sum(c.count for c in failing)
            noun = "copy" if count == 1 else "copies"
            if len(failing) == 1:
                c = failing[0]
                where = c.creation.location() if c.creation else c.mover.location()
                what = "host-built tensor" if c.birth else "host tensor"
                summary = f"{count} {what} {noun} from {where}: {frequency(c.per_unit, c.outside, total)}"
            else:
                summary = f"{count} host-to-device {noun} of tensors built on the host, at {len(failing)} sites over {total} {steps}"
            if budget is not None:
                summary += f"; {worst} in one step, max_copies_per_step={budget}"
            return CheckResult(NAME, FAILED, summary, count, findings, figures)
        extras = []
        if noted:
            owners = sorted({owner_label(c.creation or c.mover) for c in noted})
            extras.append(f"{figures['framework_copies']} in {', '.join(owners)} (noted)")
        if allowed:
            extras.append(f"{figures['allowed_copies']} allowed")
        passed = f"no host-built tensor copied over {total} {steps}"
        return clean_result(NAME, run, total, bool(copies), passed, extras, findings, figures)


def _short(stack: Stack) -> Stack:
    return tuple(f for i, f in enumerate(stack) if f.is_user or i == len(stack) - 1)


def _is_pinned(tensor: Any) -> bool:
    try:
        return bool(tensor.is_pinned())
    except Exception:  # pragma: no cover - no pinned memory on this build
        return False


# -- the hint: the device-side spelling of that very call -----------------------------------------


def _statement(frame: Frame) -> Optional[tuple[str, ast.AST]]:
    """The source of the statement starting at ``frame``'s line, parsed (up to 10 lines), or None."""
    lines = []
    for offset in range(10):
        line = linecache.getline(frame.filename, frame.lineno + offset)
        if not line:
            break
        lines.append(line)
        text = textwrap.dedent("".join(lines))
        try:
            return text, ast.parse(text)
        except SyntaxError:
            continue
    return None


_reassigning: dict[tuple[str, int], bool] = {}


def _reassigns(frame: Optional[FrameType]) -> bool:
    """Whether the statement at ``frame`` stores a move back where it came from: ``x = x.to(dev)``."""
    if frame is None:
        return False
    key = (frame.f_code.co_filename, frame.f_lineno)
    found = _reassigning.get(key)
    if found is None:
        found = False
        parsed = _statement(describe_frame(frame))
        if parsed is not None:
            text, tree = parsed
            for node in ast.walk(tree):
                if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                    continue
                target = _segment(text, node.targets[0])
                for call in _calls(node.value, ("to", "cuda", "type_as")):
                    if isinstance(call.func, ast.Attribute) and _segment(text, call.func.value) == target:
                        found = True
        if len(_reassigning) > 10000:
            _reassigning.clear()
        _reassigning[key] = found
    return found


def _calls(tree: ast.AST, names: tuple[str, ...]) -> list[ast.Call]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
            if name in names:
                found.append(node)
    return sorted(found, key=lambda n: (n.lineno, n.col_offset))


def _segment(text: str, node: ast.AST) -> Optional[str]:
    return ast.get_source_segment(text, node)


def _target_text(event: Move, mover: Frame) -> tuple[str, bool]:
    """The target as written at the move (``self.device``, ``x``...), and whether it names a tensor."""
    is_tensor = isinstance(event.target, _tensors._Tensor[0])
    if event.op == "cuda":
        return '"cuda"', False
    parsed = _statement(mover)
    if parsed is not None:
        text, tree = parsed
        for call in _calls(tree, (event.op,)):
            func = call.func
            if event.op == "copy_" and isinstance(func, ast.Attribute):
                return _segment(text, func.value) or "dst", True
            arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg in ("device", "other")), None)
            if arg is not None:
                return _segment(text, arg) or "device", is_tensor
    return ("x" if is_tensor else "device"), is_tensor


def _factory_call(birth: Birth) -> Optional[tuple[str, str, str]]:
    """``(call text, function text, argument text)`` of the factory call at the birth site."""
    if birth.site is None:
        return None
    parsed = _statement(birth.site)
    if parsed is None:
        return None
    text, tree = parsed
    calls = _calls(tree, (birth.factory,))
    if not calls:
        return None
    call = calls[0]
    call_text = _segment(text, call)
    func_text = _segment(text, call.func)
    if not call_text or not func_text:
        return None
    args_text = call_text[len(func_text):].strip()
    if args_text.startswith("(") and args_text.endswith(")"):
        args_text = args_text[1:-1].strip()
    return call_text, func_text, args_text


def _spell(event: Move, mover: Frame) -> str:
    """A hint naming the device-side spelling of the very call that built the tensor."""
    birth = event.birth
    target, is_tensor = _target_text(event, mover)
    if birth is None:
        if is_tensor:
            return f"build the tensor on the device (`device={target}.device`), or move it once before the loop"
        return (
            "build the tensor on the device where it is created (`device=...`), register it as a buffer "
            "so it moves once with the module, or feed it through the DataLoader (pin_memory=True)"
        )
    device = f"{target}.device" if is_tensor else target
    factory = birth.factory
    call = _factory_call(birth)
    args = call[2] if call else "..."
    converted = [step for step in birth.path if step != "view"]
    # .type_as(t) and .to(t) convert to t's dtype too; a conversion on the way changed the dtype.
    retyped = is_tensor and event.op in ("type_as", "to") and event.target.dtype != event.tensor.dtype
    dtype = f", dtype=torch.{_tensors_dtype(event)}" if converted or retyped else ""
    sep = ", " if args else ""
    if factory == "from_numpy":
        spelled = f"torch.as_tensor({args}, device={device}{dtype})"
    elif is_tensor and factory in _LIKE and event.op == "type_as" and tuple(event.target.shape) == tuple(event.tensor.shape):
        spelled = f"torch.{_LIKE[factory]}({target})"
    elif is_tensor and factory in _NEW_METHODS and not converted and event.op in ("type_as", "to"):
        spelled = f"{target}.{_NEW_METHODS[factory]}({args})"
    else:
        func = call[1] if call else f"torch.{factory}"
        spelled = f"{func}({args}{sep}device={device}{dtype})"
    hint = f"create it on the device: `{spelled}`"
    if event.op == "type_as" and is_tensor and factory not in _NEW_METHODS:
        hint += f" (or `torch.{_LIKE.get(factory, factory + '_like')}({target})` for the same shape)"
    if birth.factory in _CONSTANT_FACTORIES or not birth.in_scope or not event.first:
        made = call[0] if call else f"torch.{factory}(...)"
        hint += (
            f"; if it is the same every step, build it once in `__init__` with "
            f"`self.register_buffer(\"name\", {made}, persistent=False)` so it moves with the module"
        )
    return hint


def _tensors_dtype(event: Move) -> str:
    target = event.target
    if event.op in ("type_as", "to") and isinstance(target, _tensors._Tensor[0]):
        return str(target.dtype).replace("torch.", "")
    return str(event.tensor.dtype).replace("torch.", "")


# -- probe --------------------------------------------------------------------------------------


def _checks() -> list[DevicePlacementCheck]:
    out = []
    for run in active_runs():
        if run.in_scope:
            check = run.checks.get(NAME)
            if check is not None:
                out.append(check)  # type: ignore[arg-type]
    return out


def install(patcher: "Patcher") -> None:
    """Listen to the moves :mod:`._tensors` sees; undone by ``patcher``."""

    def on_move(event: Move) -> None:
        checks = _checks()
        if not checks:
            return
        mover = locate(event.frame)
        if mover.caller_kind == TORCH:
            return  # torch's own code moved it (module.to() moving parameters and buffers once)
        for check in checks:
            try:
                check.on_move(event, mover, event.frame)
            except Exception as exc:  # never break the user's step; the report says what happened
                check.error = check.error or f"{type(exc).__name__}: {exc}"

    _tensors.move_listeners.append(on_move)
    patcher.callback(_reassigning.clear)
    patcher.callback(lambda: _tensors.move_listeners.remove(on_move) if on_move in _tensors.move_listeners else None)
