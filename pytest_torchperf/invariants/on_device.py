"""Invariant ``on_device``: tensors are created on the device, not built on the host and copied every step.

``torch.randn(shape).to(self.device)``, ``torch.tensor([...]).to(x.device)``,
``torch.ones(n).type_as(x)`` (an idiom Lightning's docs once recommended) and
``torch.rand(n).cuda()`` fill a tensor in host memory and copy it to the
device, every step. ``torch.randn(shape, device=x.device)``, ``torch.ones_like(x)``,
``x.new_tensor([...])`` or a buffer registered once in ``__init__`` do not.

The probe :mod:`pytest_torchperf.probes.tensors` records every tensor a
factory builds on the host and sends an ``on_move`` event when one of them is
moved (``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``,
``dst.copy_(t)``). Inside a step such a move is a violation when

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

import weakref
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from .. import frameworks
from ..allow import AllowList
from ..arguments import Argument, Flag, Fraction, Integer, SiteList
from ..core import Check
from ..frames import describe_frame, locate, owner_label, stack_of
from ..probes._host import DATA, LEGACY
from ..probes.tensors import Birth, Move
from ..registry import Invariant
from ..report import CheckResult, Finding, Site
from ..stacks import TORCH, USER, Frame, Stack, classify
from ..text import plural
from ._spelling import one_copy, reassigns, spell
from ._steps import (
    DEFAULT_RATE,
    PERIODIC,
    CountsEpochs,
    PerStep,
    cadence,
    cadence_text,
    cadences_text,
    extent,
    frequency,
    periodic_text,
    rate,
    step_verdict,
)

if TYPE_CHECKING:
    from ..core import Run

NAME = "on_device"

BUILT = "built in the step"
CONSTANT = "built once, copied every step"
COPY = "copied from the host"
DATA_COPY = "python data copied to the device"
_OPS = {"to": ".to(...)", "cuda": ".cuda()", "type_as": ".type_as(...)", "copy_": ".copy_(...)", DATA: "device="}
#: Python data a device factory can build without any copy (``torch.full((), v, device=dev)``): never input data.
_CONSTANT_DATA = frozenset(("scalar", "zeros", "ones"))
_OPERATORS = frozenset(("==", "!=", "<", "<=", ">", ">=", "+", "-", "*", "/", "&", "|", "~", "**", "@", "//", "%", "^"))


def made_by(birth: Birth) -> str:
    """``torch.randn(...)``, ``torch.FloatTensor(...)``, ``x.new_tensor(...)``: what built the tensor."""
    if birth.factory == "new_tensor":
        return "x.new_tensor(...)"
    return f"torch.{birth.factory}(...)"


def path_text(birth: Birth) -> str:
    """The operations from the factory to the move: ``.triu().float()``, `` == …``."""
    out = []
    for step in birth.path:
        if step == "view":
            continue
        out.append(f" {step} …" if step in _OPERATORS else f".{step}()")
    return "".join(out)

# -- per-run state and verdict ----------------------------------------------------------------


class _Copy(PerStep):
    """One pattern (created here, moved there) as one run saw it."""

    def __init__(self, event: Move, mover: Frame, move_stack: Stack, by_user: bool, allowed_by: Optional[str]) -> None:
        super().__init__()
        self.birth: Optional[Birth] = event.birth
        self.op = event.op
        self.mover = mover
        self.move_stack = move_stack
        self.by_user = by_user
        self.allowed_by = allowed_by
        #: A tensor built inside the step was moved (the first move of it).
        self.built_in_step = False
        #: id(tensor) -> (weak reference, the steps it was copied in): the same tensor copied again and again.
        self._tensors: dict[int, tuple[Any, set[Optional[int]]]] = {}
        #: The most steps one tensor was copied in.
        self.most_steps = 0
        self.in_lightning = frameworks.current_call("lightning") is not None
        # The hints read the statements' source (``ast``): only your code's copies show them (a library's copy
        # is a note without a hint; Lightning's logged values are two such copies in every fit).
        self.hint = spell(event, mover, self.in_lightning) if by_user else ""
        self.one_copy = one_copy(event, mover) if by_user and event.birth is not None and event.birth.copied else ""
        tensor = event.tensor
        self.shape = tuple(tensor.shape)
        self.dtype = str(tensor.dtype).replace("torch.", "")
        self.real = event.real_copy
        #: PERIODIC / PER_EPOCH / ONCE, or None: set when the verdict is made.
        self.cadence: Optional[str] = None
        #: The numpy array the first copied tensor was made from (a weak reference), and whether a later one
        #: came from another array: input data built by hand each step (a batch), not a constant.
        self._array: Any = None
        self._content: Optional[int] = None
        self.fresh_input = False
        #: The same data (by its fingerprint) moved again: a constant rebuilt every step.
        self.same_content = False

    @property
    def judged(self) -> bool:
        """Your code's copy, not accepted by an allow-list and not on a period: it fails unless it is input data."""
        return self.by_user and not self.allowed_by and self.cadence is None

    def record(self, event: Move, unit: Optional[int], built_in_step: bool, epoch: int = 0) -> None:
        self.add(unit, epoch)
        birth = event.birth
        array = birth.array if birth is not None else None
        content = birth.content if birth is not None and birth.data not in _CONSTANT_DATA else None
        if array is not None:
            # A numpy array: a new one at a move is input data (an environment's step may well return the same
            # values), the very same one a constant.
            if self._array is None:
                self._array = array
            elif self._array() is None or self._array() is not array():
                self.fresh_input = True
        elif content is not None:
            # Python data (a new list every time): its values decide, new ones input data, the same a constant.
            if self._content is None:
                self._content = content
            elif content != self._content:
                self.fresh_input = True
            else:
                self.same_content = True
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
    def final_hint(self) -> str:
        """The hint, once the copies are all seen: the one-copy spelling for input data copied on the host on the
        way; for data seen again unchanged (a constant), without the guess about changing values."""
        if self.extra_copy and self.fresh_input:
            return self.one_copy
        hint = self.hint
        if hint and self.same_content and not self.fresh_input:
            hint = hint.replace("if the values are the same every step, ", "the values are the same every step: ")
            hint = hint.split("; if they change")[0]
        return hint

    @property
    def extra_copy(self) -> bool:
        """Input data copied on the host on the way (``torch.tensor(array).to(dev)``): the avoidable copy."""
        return self.birth is not None and self.birth.copied

    @property
    def input_data(self) -> bool:
        """Fresh input data moved once: at most a note."""
        return self.fresh_input and not self.extra_copy

    @property
    def repeated(self) -> bool:
        """The very same host tensor was copied in two or more steps (it should be a buffer)."""
        return self.most_steps > 1

    @property
    def kind(self) -> str:
        if self.birth is None:
            return COPY
        if self.op == DATA:
            return DATA_COPY
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
            "factory": made_by(self.birth)[:-5] if self.birth else None,
            "path": [p for p in self.birth.path if p != "view"] if self.birth else [],
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
            "rate": rate(self, total),
            "cadence": self.cadence,
            "input_data": self.fresh_input,
            "extra_host_copy": self.extra_copy and self.fresh_input,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "real_copy": self.real,
            "allowed_by": self.allowed_by,
            "hint": self.final_hint,
        }


class DevicePlacementCheck(CountsEpochs, Check):
    """Per-run state and verdict of ``on_device``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.allow = AllowList(run.options.allowed_copies)
        self._tensors = run.probe("tensors")
        self._tensors.want_functions(self.allow.function_names)
        self._copies: dict[Any, _Copy] = {}
        self.limit: float = run.options.max_copy_rate

    # -- events from the probe ----------------------------------------------------------
    def on_move(self, event: Move) -> None:
        run = self.run
        birth = event.birth
        # What the tensor's birth decides comes before the mover's frames are walked: a library's state
        # moved at every batch (Lightning's logged values) ends there.
        if birth is not None:
            if birth.caller_kind == TORCH or birth.explicit or birth.site is None or birth.with_module:
                return  # torch's own tensors, a host buffer on purpose, or one that moves with its module
            born_in_scope = birth.in_scope_of(run)
            if not born_in_scope and birth.caller_kind != USER:
                return  # a library's state, built before the step
        elif not event.real_copy:
            return
        mover = locate(event.frame)
        if mover.caller_kind == TORCH:
            return  # torch's own code moved it (module.to() moving parameters and buffers once)
        built_in_step = False
        if birth is not None:
            if not event.first and (mover.kind != USER or reassigns(mover.frame)):
                # Moved before, and moved in place (on a CPU-only machine, always): ``self.w = self.w.to(dev)``
                # moves it once (later moves are no-ops on the device). Libraries do this too (torchmetrics
                # states): only the user's own ``w = self.w.to(dev)`` in a step copies it again and again.
                return
            # Built and moved in the same step (for scope="test": both outside steps, or in the same one).
            built_in_step = born_in_scope and event.first and birth.unit_in(run) == run.unit
            by_user = birth.caller_kind == USER
        else:  # a real copy of a tensor of unknown birth
            if self._tensors.from_loader(event.tensor) or _is_pinned(event.tensor):
                return
            by_user = mover.kind == USER
        if mover.frame is None:
            return
        allowed_by = None
        if self.allow:
            allowed_by = self.allow.match(mover, event.frame)
            if allowed_by is None and birth is not None and birth.site is not None:
                allowed_by = self.allow.match_site(birth.site.filename, birth.site.lineno)
                allowed_by = allowed_by or self.allow.match_names(birth.functions)
        created = (birth.site.filename, birth.site.lineno) if birth is not None and birth.site else None
        key = (created, mover.frame.f_code, mover.frame.f_lineno, event.op, allowed_by)
        copy = self._copies.get(key)
        if copy is None:
            move_stack = stack_of(event.frame)
            copy = self._copies[key] = _Copy(event, describe_frame(mover.frame), move_stack, by_user, allowed_by)
        copy.record(event, run.unit, built_in_step, self.epoch)

    # -- verdict -------------------------------------------------------------------------
    def _finding(self, copy: _Copy, note: str = "") -> Finding:
        if copy.cadence is not None:
            freq = cadence_text(copy.cadence, copy, self.run.units, self.run.unit_name)
        else:
            freq = frequency(copy.per_unit, copy.outside, self.run.units, self.run.unit_name)
        op = _OPS[copy.op]
        birth = copy.birth
        facts = []
        sites = []
        if birth is not None and birth.site is not None and copy.op == DATA:
            data = "<numpy array>" if birth.array is not None else "<python data>"
            spelled = f"({data}, device=...)" if birth.factory != "new_tensor" else f"({data})"
            made = made_by(birth).replace("(...)", spelled)
            title = f"{note}{made} copies host memory to the device in {copy.mover.function}: {freq}"
            facts.append(f"at {birth.site.location()}: {birth.site.source}")
            facts.append(
                "on CUDA a copy from pageable host memory is blocking: torch waits for the stream to finish "
                "everything queued so far, then copies, every time"
            )
            sites.append(Site(f"{made_by(birth)} with python data", copy.move_stack, copy.count))
        elif birth is not None and birth.site is not None and copy.extra_copy and copy.fresh_input:
            made = made_by(birth)
            title = (
                f"{note}{made[:-5]}(<numpy array>) copies the array on the host, then {op} copies it again, in "
                f"{copy.mover.function}: {freq}"
            )
            if birth.site.location() == copy.mover.location():
                facts.append(f"at {birth.site.location()}: {birth.site.source}")
            else:
                facts.append(f"created at {birth.site.location()}: {birth.site.source}")
                facts.append(f"moved at {copy.mover.location()}: {copy.mover.source}")
            facts.append(
                "a new array at each move: input data, which must be copied once; the host copy on the way is the "
                "avoidable one"
            )
            sites.append(Site(f"{made[:-5]} then {op}", copy.move_stack, copy.count))
        elif birth is not None and birth.site is not None:
            made = made_by(birth)
            via = path_text(birth)
            if copy.kind == CONSTANT:
                title = f"{note}the same {made}{via} copied again with {op} in {copy.mover.function}: {freq}"
            else:
                title = f"{note}{made}{via} built on the host, then copied with {op} in {copy.mover.function}: {freq}"
            if birth.factory in LEGACY:
                facts.append(f"torch.{birth.factory} is a legacy constructor: it always builds on the host")
            if birth.site.location() == copy.mover.location():
                facts.append(f"created and moved at {birth.site.location()}: {birth.site.source}")
                sites.append(Site(f"{made[:-5]} then {op}", copy.move_stack, copy.count))
            else:
                facts.append(f"created at {birth.site.location()}: {birth.site.source}")
                facts.append(f"moved at {copy.mover.location()}: {copy.mover.source}")
                sites.append(Site(f"created by {made[:-5]}", birth.stack, copy.count))
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
        if copy.cadence == PERIODIC and copy.by_user and not copy.allowed_by:
            unit = self.run.unit_name
            facts.append(f"{periodic_text(copy, self.run.units, self.limit, 'max_copy_rate', 'copied', unit)}: a "
                         "note, not a failure (0 fails on it)")
        elif copy.cadence is not None and copy.by_user and not copy.allowed_by:
            what = {
                "once per epoch": "at most once per epoch",
                "once": "once in the run (like a tensor built lazily in the first step and kept)",
            }
            facts.append(f"copied {what[copy.cadence]}: a note, not a failure (max_copy_rate={self.limit:g}; "
                         "0 fails on it)")
        if copy.judged and copy.input_data:
            source = "a new numpy array" if birth is not None and birth.array is not None else "new values"
            facts.append(
                f"made from {source} at each move: input data (a batch built by hand), which every step "
                "must copy once, as it would a DataLoader's batch: a note, not a failure; on CUDA pin it "
                "(`.pin_memory()`) and move it with `non_blocking=True`, or load it with "
                "`DataLoader(..., pin_memory=True)`"
            )
        if copy.allowed_by:
            facts.append(f"accepted by allowed_copies entry {copy.allowed_by!r}")
        elif not copy.by_user:
            owner_frame = copy.creation or copy.mover
            facts.append(
                f"made by {owner_label(owner_frame)}, not by your code ({classify.rule(owner_frame.filename)}): "
                "a note, not a failure"
            )
        elif copy.creation is not None and classify.rule_matters(copy.creation.filename):
            facts.append(f"counted as your code: {classify.rule(copy.creation.filename)}")
        hint = copy.final_hint if copy.judged and not copy.input_data else ""
        finding = Finding(title, facts, sites, hint)
        if not copy.by_user and not copy.allowed_by:
            where = copy.creation or copy.mover
            short = f"{where.filename.rsplit('/', 1)[-1]}:{where.lineno}"
            finding.framework_note = (owner_label(where), short, copy.count)
        return finding

    def result(self) -> CheckResult:
        run = self.run
        total = run.units
        unit = run.unit_name
        copies = sorted((c for c in self._copies.values() if c.broken), key=lambda c: -c.count)
        for c in copies:
            c.cadence = cadence(c, total, self.limit) if c.by_user and not c.allowed_by else None
        failing = [c for c in copies if c.judged and not c.input_data]
        periodic = [c for c in copies if c.cadence is not None]
        inputs = [c for c in copies if c.judged and c.input_data]
        framework = [c for c in copies if not c.by_user and not c.allowed_by]
        noted = periodic + inputs + framework
        allowed = [c for c in copies if c.allowed_by]
        figures: Figures = {
            "scope": run.scope,
            "steps": total,
            "host_built_copies": sum(c.count for c in failing),
            "sites": len(failing),
            "periodic_copies": sum(c.count for c in periodic),
            "input_copies": sum(c.count for c in inputs),
            "max_copy_rate": self.limit,
            "framework_copies": sum(c.count for c in framework),
            "allowed_copies": sum(c.count for c in allowed),
            "events": [c.to_dict(total) for c in copies],
        }
        extras = []
        if periodic:
            extras.append(f"{cadences_text(periodic)} in your code (noted)")
        if inputs:
            extras.append(f"{plural(figures['input_copies'], 'copy', 'copies')} of input data built by hand (noted)")
        if framework:
            owners = sorted({owner_label(c.creation or c.mover) for c in framework})
            extras.append(f"{figures['framework_copies']} in {', '.join(owners)} (noted)")
        if allowed:
            extras.append(f"{figures['allowed_copies']} allowed")

        def one_site(c: _Copy) -> str:
            where = c.creation.location() if c.creation else c.mover.location()
            what = "host-built tensor" if c.birth and c.op != DATA else "python-data" if c.birth else "host tensor"
            noun = "copy" if c.count == 1 else "copies"
            return f"{c.count} {what} {noun} from {where}: {frequency(c.per_unit, c.outside, total, unit)}"

        def many_sites(count: int, n: int) -> str:
            noun = "copy" if count == 1 else "copies"
            return f"{count} host-to-device {noun} of tensors built on the host, at {n} sites {extent(run)}"

        return step_verdict(
            NAME, run, what="copies", failing=failing, noted=noted, allowed=allowed, finding=self._finding,
            figures=figures,
            within=lambda count, worst, budget: (
                f"{plural(count, 'host-built tensor copy', 'host-built tensor copies')}, at most {worst} in a "
                f"{unit}: within max_copies_per_step={budget}"
            ),
            one_site=one_site, many_sites=many_sites,
            clean=f"no host-built tensor copied {extent(run)}", extras=extras,
        )


def _is_pinned(tensor: Any) -> bool:
    try:
        return bool(tensor.is_pinned())
    except Exception:  # pragma: no cover - no pinned memory on this build
        return False


class Figures(TypedDict, total=False):
    """The figures of a on_device verdict (see :mod:`pytest_torchperf.figures`)."""

    scope: str
    steps: int
    host_built_copies: int
    sites: int
    periodic_copies: int
    input_copies: int
    max_copy_rate: float
    framework_copies: int
    allowed_copies: int
    events: list[dict[str, Any]]
    worst_step_copies: int
    max_copies_per_step: Optional[int]


INVARIANT = Invariant(
    name=NAME,
    doc="tensors are created on the device, not built on the host and copied",
    check=DevicePlacementCheck,
    figures=Figures,
    kind=Flag(),
    default=True,
    probes=("tensors", "iterators"),
    arguments=(
        Argument(
            "allowed_copies",
            SiteList(),
            (),
            "accept host-built tensors created or moved at these sites or in these "
            "functions (same forms as allowed_syncs)",
        ),
        Argument(
            "max_copies_per_step",
            Integer(minimum=0),
            None,
            "pass while no training step makes more than N copies of host-built tensors",
            meaning="the most copies of host-built tensors any training step may make",
        ),
        Argument(
            "max_copy_rate",
            Fraction(),
            DEFAULT_RATE,
            "on_device notes, without failing, a copy made periodically: after its first step in each epoch, in "
            "at most this share of the steps, at most once per epoch, or once (a tensor built lazily in the first step "
            "and "
            "kept); 0 fails on every copy",
            meaning="the largest share of the steps a periodic copy may take",
        ),
    ),
)
