"""The host-tensor registry behind probe ``tensors``: where each host tensor came from, and its moves.

A :class:`Birth` records how a host tensor came to be (the factory, who
called it, where, in which runs' steps, the operations that derived it); a
:class:`Move` is one host tensor sent to a device, as the ``on_move`` event
carries it. :class:`HostRegistry` holds the births of the tensors alive now,
keyed by ``id`` with weak references (an entry disappears with its tensor),
and answers the hot paths' question "is this a host tensor?" with one
dictionary lookup. The patches that fill it are in :mod:`.tensors` and
:mod:`._propagate`; nothing here patches anything.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .. import core
from .._guard import handing_over
from ..core import FLAGS
from ..frames import StackCache, caller, describe_frame, kind_of
from ..stacks import TORCH, USER, Frame, Stack

if TYPE_CHECKING:
    from ..core import Run

__all__ = [
    "CONVERSIONS",
    "DATA",
    "FACTORIES",
    "LEGACY",
    "Birth",
    "HostRegistry",
    "Move",
    "describe_data",
    "is_cpu_string",
    "subclass_dispatch",
]

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
DATA_FACTORIES = frozenset(("tensor", "as_tensor", "asarray"))
#: Tensor methods that convert the dtype and so return a new tensor with the same provenance.
CONVERSIONS = ("float", "double", "half", "bfloat16", "long", "int", "short", "bool")
#: The legacy constructors (``torch.Tensor(2, 3)``, ``torch.FloatTensor([...])``): host tensors, found by reading
#: the source at the move (they are classes, not functions to wrap).
LEGACY = frozenset((
    "Tensor", "FloatTensor", "DoubleTensor", "HalfTensor", "BFloat16Tensor", "ByteTensor", "CharTensor",
    "ShortTensor", "IntTensor", "LongTensor", "BoolTensor",
))
#: ``Move.op`` of python data built straight on the device (``torch.tensor(data, device=dev)``).
DATA = "device="


def is_cpu_string(device: Any) -> bool:
    """``"cpu"``/``"cpu:0"`` written out: a host target on purpose (a ``torch.device`` is the training device)."""
    return isinstance(device, str) and device.split(":")[0] == "cpu"


@dataclass(eq=False)
class Birth:
    """How a host tensor came to be: the factory, who called it, where, in which runs' steps."""

    #: The factory: ``"randn"``, ``"tensor"``, a legacy constructor (``"FloatTensor"``)...
    factory: str
    #: The frame kind that called the factory: user, framework, library or torch (torch's own code).
    caller_kind: str
    #: Where (the innermost frame outside torch), None for torch's own tensors.
    site: Optional[Frame]
    #: The stack of the first birth at that site from the same calling line.
    stack: Stack
    #: ``device="cpu"`` written out, or ``pin_memory=True``: placed on the host on purpose.
    explicit: bool
    #: ``(run, unit)`` for each run whose step checks applied at birth (unit None: between steps).
    in_scope: tuple[tuple[Run, Optional[int]], ...]
    #: The factory call's ``shape``/``dtype`` for the hint.
    shape: tuple[int, ...] = ()
    dtype: str = ""
    #: Moved to a device in place (the move returned the tensor itself): no longer a host tensor.
    moved: bool = False
    #: Registered as a buffer, or moved by torch's own code (``module.to()``): it travels with its module.
    with_module: bool = False
    #: Operations on the way from the factory to the move (``float``, ``view``, ``triu``, ``*``...).
    path: tuple[str, ...] = field(default_factory=tuple)
    #: Functions on the stack at birth that an allow-list names (see :meth:`HostRegistry.want_functions`).
    functions: frozenset[str] = frozenset()
    #: For python data given to a device factory (``torch.tensor(v, device=dev)``): ``"scalar"``, ``"zeros"``,
    #: ``"ones"`` or ``"values"``; empty otherwise.
    data: str = ""
    #: A weak reference to the numpy array the tensor was made from (``torch.from_numpy(a)``,
    #: ``torch.as_tensor(a)``), None otherwise: a new array at every move is input data, the same one a constant.
    array: Any = None
    #: A fingerprint of the python data it was made from (a sequence of numbers, built in a step), None otherwise:
    #: data that changes from step to step is input data, the same data every step a constant.
    content: Optional[int] = None
    #: The factory copied a numpy array on the host (``torch.tensor(a)``, ``torch.Tensor(a)``): moving the result
    #: copies it a second time, where ``torch.as_tensor(a, device=dev)`` copies once.
    copied: bool = False

    def in_scope_of(self, run: Run) -> bool:
        return any(r is run for r, _ in self.in_scope)

    def unit_in(self, run: Run) -> Optional[int]:
        """The step of ``run`` the tensor was born in (None: between steps or not in its scope)."""
        return next((unit for r, unit in self.in_scope if r is run), None)

    def derived(self, step: str) -> Birth:
        path = self.path if self.path and self.path[-1] == step else self.path + (step,)
        return Birth(
            self.factory, self.caller_kind, self.site, self.stack, self.explicit, self.in_scope,
            self.shape, self.dtype, False, False, path, self.functions, self.data, self.array, self.content,
            self.copied,
        )


@dataclass
class Move:
    """A tensor sent to a device: ``.to(device)``, ``.to(tensor)``, ``.cuda()``, ``.type_as(t)``, ``copy_``,
    or python data built on the device (op :data:`DATA`)."""

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


class HostRegistry:
    """The births of the host tensors alive now, and what the hot paths ask of them."""

    def __init__(self) -> None:
        #: id(tensor) -> (weak reference, birth).
        self.births: dict[int, tuple[Any, Birth]] = {}
        #: id(tensor) -> weak reference, for the births that are host tensors now (not moved): the hot
        #: paths' one-lookup answer to "is this a host tensor?".
        self.host: dict[int, Any] = {}
        #: The same for the host tensors your code built: the operations of :mod:`._propagate` follow these
        #: only, so torch's and Lightning's own host tensors (step counters, logging state) cost them nothing.
        self.traced: dict[int, Any] = {}
        #: Called once, when the first tensor is traced (the propagation wrappers are installed then).
        self.when_traced: Optional[Any] = None
        #: id(tensor) -> weak reference: tensors a DataLoader produced (only where a real copy can happen).
        self.loader_tensors: dict[int, Any] = {}
        #: Function names some run's allow-list names: a birth inside one of them remembers it.
        self.functions: set[str] = set()
        #: Modules moved to a device target while watched (``module.to(dev)``, ``.cuda()``, Lightning's move).
        self.moved_modules: weakref.WeakSet[Any] = weakref.WeakSet()
        self.stacks = StackCache()
        self.tensor_type: Any = None
        self.device_type: Any = None
        self.compiling: Callable[[], bool] = lambda: False

    def clear(self) -> None:
        self.births.clear()
        self.host.clear()
        self.traced.clear()
        self.when_traced = None
        self.loader_tensors.clear()
        self.functions.clear()
        self.moved_modules = weakref.WeakSet()
        self.stacks.clear()

    # -- the registry ---------------------------------------------------------------------
    def _forget(self, key: int, ref: Any) -> None:
        entry = self.births.get(key)
        if entry is not None and entry[0] is ref:
            del self.births[key]
        if self.host.get(key) is ref:
            del self.host[key]
        if self.traced.get(key) is ref:
            del self.traced[key]

    def remember(self, tensor: Any, birth: Birth) -> None:
        key = id(tensor)
        try:
            ref = weakref.ref(tensor, lambda r, key=key: self._forget(key, r))  # type: ignore[misc]
        except TypeError:  # pragma: no cover - a tensor type without weak references
            return
        self.births[key] = (ref, birth)
        if birth.moved:
            self.host.pop(key, None)
            self.traced.pop(key, None)
        else:
            self.host[key] = ref
            if birth.site is not None and birth.caller_kind == USER:
                if self.when_traced is not None:
                    install, self.when_traced = self.when_traced, None
                    install()
                self.traced[key] = ref
            else:
                self.traced.pop(key, None)

    def own_birth(self, tensor: Any) -> Optional[Birth]:
        entry = self.births.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            return entry[1]
        return None

    def birth_of(self, tensor: Any) -> Optional[Birth]:
        """The :class:`Birth` of a host-born tensor (or of the tensor it is a view of), else None."""
        if not self.births:
            return None
        birth = self.own_birth(tensor)
        if birth is None:
            base = getattr(tensor, "_base", None)
            if base is not None:
                birth = self.own_birth(base)
                if birth is not None and not birth.moved:
                    birth = birth.derived("view")
        return birth

    def is_traced(self, tensor: Any) -> bool:
        """Whether ``tensor`` (or the tensor it is a view of) is a host tensor built outside torch."""
        traced = self.traced
        ref = traced.get(id(tensor))
        if ref is not None and ref() is tensor:
            return True
        base = getattr(tensor, "_base", None)
        if base is not None:
            ref = traced.get(id(base))
            return ref is not None and ref() is base
        return False

    def is_host_tensor(self, tensor: Any) -> bool:
        """Whether ``tensor`` lives on the host by construction (a factory without ``device=``, not moved)."""
        ref = self.host.get(id(tensor))
        if ref is not None and ref() is tensor:
            return True
        birth = self.birth_of(tensor)
        return birth is not None and not birth.moved

    def mark_host(self, tensor: Any, caller_kind: str = TORCH) -> None:
        """Record ``tensor`` as a host tensor nobody is to blame for (``.cpu()`` results, optimizer steps)."""
        if self.own_birth(tensor) is None:
            self.remember(tensor, Birth("", caller_kind, None, (), True, ()))

    def no_longer_host(self, tensor: Any, birth: Birth, with_module: bool = False) -> None:
        birth.moved = True
        birth.with_module = birth.with_module or with_module
        self.host.pop(id(tensor), None)
        self.traced.pop(id(tensor), None)

    def mark_moved(self, tensor: Any, birth: Birth, with_module: bool) -> None:
        """``tensor`` was moved in place (on a CPU-only machine, always): it now stands for the device copy."""
        own = self.own_birth(tensor)
        if own is None:  # a view of a host tensor: it gets its own record
            own = birth.derived("view")
            self.remember(tensor, own)
        self.no_longer_host(tensor, own, with_module)

    def want_functions(self, names: set[str] | frozenset[str]) -> None:
        """Births inside functions of these names remember them (for allow-list entries naming a function)."""
        self.functions.update(names)

    # -- tensors a DataLoader produced -----------------------------------------------------
    def remember_loader(self, tensor: Any) -> None:
        key = id(tensor)
        table = self.loader_tensors
        try:
            ref = weakref.ref(tensor, lambda r, key=key: table.pop(key, None) if table.get(key) is r else None)  # type: ignore[misc]  # noqa: E501
        except TypeError:  # pragma: no cover
            return
        table[key] = ref

    def mark_batch(self, batch: Any, depth: int = 0) -> None:
        """Remember every tensor of a batch (tuples, lists, mappings, a few levels deep).

        A mapping is any ``collections.abc.Mapping``: a dict, or a ``UserDict`` such as a tokenizer's
        ``BatchEncoding``, however it was collated."""
        if isinstance(batch, self.tensor_type):
            self.remember_loader(batch)
        elif depth < 4:
            if isinstance(batch, Mapping):
                for value in batch.values():
                    self.mark_batch(value, depth + 1)
            elif isinstance(batch, (list, tuple)):
                for value in batch:
                    self.mark_batch(value, depth + 1)

    def from_loader(self, tensor: Any) -> bool:
        """Whether ``tensor`` (or the tensor it is a view of) came out of a DataLoader during the run."""
        for t in (tensor, getattr(tensor, "_base", None)):
            if t is not None:
                ref = self.loader_tensors.get(id(t))
                if ref is not None and ref() is t:
                    return True
        return False

    def writes_cpu(self, frame: Optional[FrameType]) -> bool:
        """Whether the line at ``frame`` writes its CPU device out (see ``_propagate.CpuLiterals``)."""
        return True

    # -- births ----------------------------------------------------------------------------
    def site_birth(self, name: str, out: Any, site: FrameType, kind: str, explicit: bool, data: str = "") -> Birth:
        scope: tuple[tuple[Run, Optional[int]], ...] = ()
        if FLAGS.in_scope:
            scope = tuple((run, run.unit) for run in core.runs_in_scope())
        # keyed by the site and the line that called it: a helper that builds the tensor, called once at one
        # line and every step at another, has one stack for each
        back = site.f_back
        key = ("birth", site.f_code, site.f_lineno, back.f_code if back is not None else None,
               back.f_lineno if back is not None else 0)
        stack = self.stacks.get(key, site)
        birth = Birth(
            name, kind, describe_frame(site), stack, explicit, scope,
            tuple(out.shape), str(out.dtype).replace("torch.", ""), data=data,
        )
        if self.functions:
            from ..allow import function_names  # noqa: PLC0415 - only for allow-lists naming functions

            birth.functions = function_names(site, self.functions)
        return birth

    def born(
        self, name: str, out: Any, args: tuple[Any, ...], kwargs: dict[str, Any], frame: Optional[FrameType]
    ) -> None:
        tensor_type = self.tensor_type
        if not isinstance(out, tensor_type):
            return
        device = kwargs.get("device")
        if device is not None and (
            not is_cpu_string(device) or name in DATA_FACTORIES and FLAGS.in_scope and not self.writes_cpu(frame)
        ):
            # ``device=x.device`` / ``device=self.device``: the training device (the CPU on this machine).
            if name in DATA_FACTORIES and FLAGS.in_scope and args and not isinstance(args[0], tensor_type):
                self.data_to_device(name, out, args[0], device, frame)
            return
        if out.device.type != "cpu":
            return
        if name in DATA_FACTORIES and args and isinstance(args[0], tensor_type):
            return
        if name == "normal" and any(isinstance(a, tensor_type) for a in args):
            return  # normal(mean_tensor, std_tensor): follows its inputs
        explicit = device is not None or bool(kwargs.get("pin_memory"))
        site = caller(frame)
        kind = kind_of(site.f_code) if site is not None else TORCH
        if kind == TORCH or site is None:
            birth = Birth(name, TORCH, None, (), explicit, ())
        else:
            data = _data_kind(args[0]) if name in DATA_FACTORIES and args else ""
            birth = self.site_birth(name, out, site, kind, explicit, data)
            if args and (name in DATA_FACTORIES or name == "from_numpy"):
                describe_data(birth, args[0], name == "tensor")
        self.remember(out, birth)

    def data_to_device(self, name: str, out: Any, data: Any, device: Any, frame: Optional[FrameType]) -> None:
        """``torch.tensor(<python data>, device=dev)`` in a step: host memory copied to the device (blocking on
        CUDA).
        """
        site = caller(frame)
        if site is None:
            return
        kind = kind_of(site.f_code)
        if kind == TORCH:
            return
        birth = self.site_birth(name, out, site, kind, False, _data_kind(data))
        describe_data(birth, data, False)
        real = out.device.type not in ("cpu", "meta")
        self.tell(Move(DATA, out, birth, True, device, frame, real))

    def follow(self, name: str, out: Any, sources: tuple[Any, ...]) -> None:
        """``out`` was computed from ``sources`` by ``name``: a host tensor when every tensor among them is one."""
        if not isinstance(out, self.tensor_type) or out.device.type != "cpu":
            return
        birth = None
        tensor_type = self.tensor_type
        for source in sources:
            if isinstance(source, tensor_type):
                found = self.birth_of(source)
                if found is None or found.moved:
                    return
                if birth is None:
                    birth = found
        if birth is not None and out is not sources[0] and self.own_birth(out) is None:
            self.remember(out, birth.derived(name))

    def derive(self, name: str, source: Any, out: Any) -> None:
        """``out`` is ``source`` converted (dtype, ``.to(dtype)``): it keeps ``source``'s provenance."""
        birth = self.birth_of(source)
        if birth is not None and not birth.moved:
            self.remember(out, birth.derived(name))
        elif self.loader_tensors and self.from_loader(source):
            self.remember_loader(out)

    # -- moves -----------------------------------------------------------------------------
    def tell(self, event: Move) -> None:
        core.notify("on_move", event, in_scope=True)

    def on_move(
        self, op: str, tensor: Any, target: Any, out: Any, frame: Optional[FrameType], told: bool = False
    ) -> None:
        """After a move: tell the checks in scope and update the registry.

        ``told``: the checks already heard of this move (``.cuda()`` tells them
        before the call, which raises on a machine without CUDA).
        """
        birth = self.birth_of(tensor)
        first = birth is not None and not birth.moved
        if FLAGS.in_scope and not told:
            real = (
                tensor.device.type == "cpu"
                and isinstance(out, self.tensor_type)
                and out.device.type not in ("cpu", "meta")
            )
            known = birth if birth is not None and not birth.with_module else None
            if (known is not None or real) and moved_with_its_batch(frame, tensor):
                # Input data, like a DataLoader's batch (whose birth is not the point): told as one.
                self.remember_loader(tensor)
                if isinstance(out, self.tensor_type):
                    self.remember_loader(out)
                known = None
            if known is not None or real:
                self.tell(Move(op, tensor, known, first, target, frame, real))
        if birth is not None and first and out is tensor:
            mover = caller(frame)
            self.mark_moved(tensor, birth, mover is None or kind_of(mover.f_code) == TORCH)

    def target_of_to(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The device a ``Tensor.to(...)`` call moves to (a device, str, int or tensor), None for dtype only."""
        device = kwargs.get("device")
        if device is not None:
            return device
        for arg in args:
            if isinstance(arg, (str, self.device_type, self.tensor_type)):
                return arg
            if isinstance(arg, int) and not isinstance(arg, bool):
                return arg
        other = kwargs.get("other")
        return other if isinstance(other, self.tensor_type) else None


def _is_ndarray(data: Any) -> bool:
    """A numpy array (or memmap), told without importing numpy."""
    cls = type(data)
    return cls.__module__.startswith("numpy") and hasattr(cls, "__array_interface__")


def describe_data(birth: Birth, data: Any, copies: bool) -> None:
    """What ``birth`` was made from: the numpy array (a weak reference; a new one at each move is input data)
    and whether the factory copied it (``copies``), or, in a step, a fingerprint of python data (a new list every
    time: its values tell input data from a constant, see :attr:`Birth.content`)."""
    if _is_ndarray(data):
        try:
            birth.array = weakref.ref(data)
        except TypeError:  # pragma: no cover - an array type without weak references
            pass
        birth.copied = copies
    elif FLAGS.in_scope and isinstance(data, (list, tuple)) and 0 < len(data) <= 4096:
        flat = _flattened(data)
        if len(flat) <= 4096 and all(isinstance(v, (bool, int, float)) for v in flat):
            birth.content = hash((len(data), tuple(flat)))


def _flattened(data: list[Any] | tuple[Any, ...]) -> list[Any]:
    """The leaves of nested lists and tuples, stopping once past 4096 of them (a longer result means "too many")."""
    flat: list[Any] = []
    stack = [data]
    while stack and len(flat) <= 4096:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            flat.append(item)
    return flat


def _data_kind(data: Any) -> str:
    """What python data given to a device factory looks like, for the hint."""
    if isinstance(data, (bool, int, float)):
        return "scalar"
    if isinstance(data, (list, tuple)) and 0 < len(data) <= 4096:
        flat = _flattened(data)
        if flat and all(isinstance(v, (bool, int, float)) for v in flat):
            if all(v == 0 for v in flat):
                return "zeros"
            if all(v == 1 for v in flat):
                return "ones"
    return "values"


class _SubclassDispatch:
    """Hands a tensor subclass with its own ``__torch_function__`` to torch as if nothing were patched.

    Unwatched, ``x.to(...)`` on such a subclass reaches its ``__torch_function__``
    with ``func`` = torch's own ``Tensor.to``. Inside a watch the class attribute is
    torchperf's wrapper, and torch would pass *that* as ``func`` (a subclass keyed
    on torch's functions would no longer recognise it). So a wrapper gives such a
    tensor straight to ``handle_torch_function`` with torch's own method.
    """

    def __init__(self, torch: Any) -> None:
        self._has = torch._C._has_torch_function_unary
        self._handle = torch.overrides.handle_torch_function
        self._has_any = torch._C._has_torch_function

    def overrides(self, tensor: Any) -> bool:
        return bool(self._has(tensor))

    def call(self, original: Callable[..., Any], this: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        relevant = (this,) + tuple(a for a in args if self._has_any((a,)))
        # torch's own function to the subclass (not the guard's tracked one), recorded as the original's call
        return handing_over(original, self._handle, relevant, this, *args, **kwargs)


def subclass_dispatch(torch: Any) -> _SubclassDispatch:
    return _SubclassDispatch(torch)


def moved_with_its_batch(frame: Optional[FrameType], tensor: Any, depth: int = 3) -> bool:
    """Whether ``tensor`` moves as one value of a mapping's own ``.to(device)``, ``frame`` being the frame that
    called ``Tensor.to``: a tokenizer's padded ``BatchEncoding(...).to(device)``, or any ``Mapping`` of tensors
    with a ``to`` method. That batch is input data, whoever collated it: its tensors are built on the host from
    text or files, and moved once each step by design (what a DataLoader's batches are).

    Looks at ``frame`` and the few frames above it (a comprehension is a frame of its own before 3.12) for a
    function named ``to`` whose ``self`` is a mapping holding ``tensor``; read only for a real host-to-device
    copy in scope, never per operation.
    """
    while frame is not None and depth > 0:
        if frame.f_code.co_name == "to":
            owner = frame.f_locals.get("self")
            if isinstance(owner, Mapping):
                try:
                    return any(value is tensor for value in owner.values())
                except Exception:  # noqa: BLE001 - a mapping whose values cannot be read: not a batch
                    return False
            return False
        frame = frame.f_back
        depth -= 1
    return False
