"""Host provenance through a few cheap operations, and the legacy constructors read from the source.

A mask or a constant is often built on the host from a factory and a few
cheap transformations, then moved every step::

    mask = torch.triu(torch.ones(n, n), diagonal=1)
    mask = mask.float().masked_fill(mask == 1, float("-inf"))
    out = self.transformer(x, mask=mask.to(x.device))

The registry (:mod:`._host`) knows ``torch.ones(n, n)`` is a host tensor;
:func:`install` lets the results of these operations keep that provenance
when every tensor they read is a host tensor (python numbers are fine):

- ``torch.triu``/``tril`` and the Tensor methods ``triu``, ``tril``,
  ``masked_fill``, ``detach`` and ``clone``;
- the comparisons ``== != < <= > >=``, the arithmetic ``+ - * /`` (either
  side), ``-t``, ``~t``, ``&`` and ``|``;
- ``torch.stack`` and ``torch.cat`` called by code outside torch (a
  DataLoader's collate is torch's, so batches never count).

Each is a Python wrapper on a Tensor method or a ``torch`` function. The Tensor
operations are installed only when the first host tensor built by code outside
torch appears during the watch (torch's own host tensors, such as an
optimizer's step counters, are not followed): a run whose code builds none pays
nothing for them. Once installed, each costs a call and a dictionary check on
top of the operation; measured in ``benchmarks/bench_step_checks.py``.
Every other operation (``pow``, ``exp``, ``sin``, ``einsum``, ``matmul``,
reductions, ``where``...) is followed by :mod:`._follow`, installed at the
same moment; indexing with tensors and operations of a subclass with its own
``__torch_function__`` are not: their results count as device tensors.

The legacy constructors (``torch.Tensor(2, 3).fill_(v)``, ``torch.FloatTensor(n)``)
are classes: patching them would change ``torch.Tensor`` itself. They return
uninitialised memory, so their tensors are found where that memory is first
written: when a fresh tensor the registry does not know (never written, no
autograd history) is filled in a step (:data:`INITIALIZERS`: ``fill_``,
``zero_``, ``normal_``...), :class:`LegacySites` reads the statement there (once
per line, then cached); a receiver chain that starts at ``torch.<Legacy>Tensor(...)``
(or ``Tensor(...)``, ``th.FloatTensor(...)``: the name is looked up in the frame),
in the same statement or assigned to that name earlier in the same function,
makes it a host tensor built in the step. ``.cuda()`` and ``.type_as()`` of an
unknown tensor read the source at the move the same way, and so does ``.to()``
of a fresh tensor in a step, for a legacy constructor given data
(``torch.LongTensor([1, 2]).to(dev)``): a batch's move reads its caller's frame,
and the line is parsed once and then known by its instruction offset.
"""

from __future__ import annotations

import ast
import linecache
import textwrap
from types import CodeType, FrameType
from typing import TYPE_CHECKING, Any, Callable, Optional

from .._guard import caller_frame
from ..core import FLAGS
from ..frames import caller, kind_of
from ..patching import wraps
from ..stacks import TORCH, Frame
from . import _follow
from ._host import FACTORIES, LEGACY, Birth, is_cpu_string

if TYPE_CHECKING:
    from ..patching import Patcher
    from ._host import HostRegistry

__all__ = [
    "BINARY", "FUNCTIONS", "INITIALIZERS", "METHODS", "MOVES", "UNARY", "CpuLiterals", "LegacySites", "install",
]

#: Tensor dunders of two operands (``t * 0.5``, ``mask == 1``, ``1 - t``).
BINARY = (
    "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__",
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__and__", "__or__",
    "__pow__", "__rpow__", "__matmul__", "__rmatmul__", "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__",
    "__xor__",
)
#: Tensor dunders of one operand.
UNARY = ("__neg__", "__invert__", "__abs__")
#: Other Tensor methods followed.
METHODS = ("triu", "tril", "masked_fill", "detach", "clone")
#: ``torch`` functions followed.
FUNCTIONS = ("triu", "tril", "stack", "cat")
#: The readable name of each operation in a birth's path.
_LABELS = {
    "__eq__": "==", "__ne__": "!=", "__lt__": "<", "__le__": "<=", "__gt__": ">", "__ge__": ">=",
    "__add__": "+", "__radd__": "+", "__sub__": "-", "__rsub__": "-", "__mul__": "*", "__rmul__": "*",
    "__truediv__": "/", "__rtruediv__": "/", "__and__": "&", "__or__": "|", "__neg__": "-", "__invert__": "~",
    "__pow__": "**", "__rpow__": "**", "__matmul__": "@", "__rmatmul__": "@", "__floordiv__": "//",
    "__rfloordiv__": "//", "__mod__": "%", "__rmod__": "%", "__xor__": "^", "__abs__": "abs",
}


def install(probe: HostRegistry, patcher: Patcher, torch: Any, dispatch: Any) -> None:
    """Patch the operations above so their results keep host provenance; undone by ``patcher``."""
    tensor_type = torch.Tensor
    flags = FLAGS
    is_compiling = probe.compiling
    traced = probe.traced

    def binary(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        label = _LABELS[name]

        def op(self: Any, other: Any) -> Any:
            __tracebackhide__ = True
            if type(self) is not tensor_type and dispatch.overrides(self):
                return dispatch.call(original, self, (other,), {})
            out = original(self, other)
            if traced and not is_compiling() and flags.active and (
                id(self) in traced or id(other) in traced or id(self._base) in traced  # ``i + 8`` for i in ix
            ):
                try:
                    probe.follow(label, out, (self, other))
                except Exception as exc:  # noqa: BLE001 - never into the user's code
                    probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(op)

    def unary(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        label = _LABELS[name]

        def op(self: Any) -> Any:
            __tracebackhide__ = True
            if type(self) is not tensor_type and dispatch.overrides(self):
                return dispatch.call(original, self, (), {})
            out = original(self)
            if traced and not is_compiling() and flags.active and (id(self) in traced or id(self._base) in traced):
                try:
                    probe.follow(label, out, (self,))
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(op)

    def method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def op(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if type(self) is not tensor_type and dispatch.overrides(self):
                return dispatch.call(original, self, args, kwargs)
            out = original(self, *args, **kwargs)
            if traced and not is_compiling() and flags.active:
                try:
                    if probe.is_traced(self):
                        probe.follow(name, out, (self,) + args + tuple(kwargs.values()))
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(op)

    def function(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        many = name in ("stack", "cat")

        def fn(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(*args, **kwargs)
            # nothing of torchperf's read while dynamo traces
            if not is_compiling() and traced and args and flags.active:
                try:
                    if many:
                        first = args[0]
                        if isinstance(first, (list, tuple)) and first and probe.is_host_tensor(first[0]):
                            site = caller(caller_frame())
                            if site is not None and kind_of(site.f_code) != TORCH:
                                probe.follow(name, out, tuple(first))
                    elif probe.is_traced(args[0]):
                        probe.follow(name, out, args[:1])
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(fn)

    scope = patcher.reuse_scope  # the lazy patches below are kept for later watches as the others are

    def wrap_tensor_operations() -> None:
        with patcher.reusing(scope):
            _wrap_tensor_operations()

    def _wrap_tensor_operations() -> None:
        for name in BINARY:
            patcher.wrap(tensor_type, name, lambda original, name=name: binary(name, original))  # type: ignore[misc]
        for name in UNARY:
            patcher.wrap(tensor_type, name, lambda original, name=name: unary(name, original))  # type: ignore[misc]
        for name in METHODS:
            patcher.wrap(tensor_type, name, lambda original, name=name: method(name, original))  # type: ignore[misc]
        # Every other operation (``pow``, ``sin``, ``einsum``, ``matmul``...): :mod:`._follow`.
        _follow.install(probe, patcher, torch, dispatch, set(METHODS) | set(BINARY) | set(UNARY), set(FUNCTIONS))

    # The ``torch`` functions now: in ``torch.triu(torch.ones(n, n))`` the function is looked up before
    # its argument is built. Tensor operations only when the first host tensor built outside torch
    # appears (``x * 2`` and ``x.masked_fill`` are looked up after ``x`` exists): until then there is
    # nothing to follow, and tensor arithmetic everywhere (optimizers, losses) runs without a wrapper.
    for name in FUNCTIONS:
        if getattr(torch, name, None) is not None:
            patcher.wrap(torch, name, lambda original, name=name: function(name, original))  # type: ignore[misc]
    probe.when_traced = wrap_tensor_operations


# -- the legacy constructors, read from the source -------------------------------------------

#: Moves whose source is read for a legacy constructor (``.to()`` of a fresh tensor in a step, once a line).
MOVES = frozenset(("to", "cuda", "type_as"))
#: In-place initialisers: the first write of a legacy constructor's uninitialised memory.
INITIALIZERS = (
    "fill_", "zero_", "normal_", "uniform_", "random_", "bernoulli_", "exponential_", "geometric_",
    "log_normal_", "cauchy_",
)


#: ``(constructor, methods called on it, the name it is reached through)``: ``("Tensor", ("fill_",), "torch")`` for
#: ``torch.Tensor(n).fill_(v)``, ``("Tensor", ("fill_",), None)`` for ``Tensor(n).fill_(v)`` after
#: ``from torch import Tensor``. The source only shows the spelling: :func:`_resolves` checks it at the frame.
LegacyCall = tuple[str, tuple[str, ...], Optional[str]]


def _legacy_call(node: ast.AST, helper: Optional[Callable[[str], Optional[LegacyCall]]] = None) -> Optional[LegacyCall]:
    """The host constructor that ``node``'s chain starts at: a legacy constructor (``<module>.<Legacy>(...)``,
    ``<Legacy>(...)``) or a host factory (``torch.arange(10)``, no ``device=``), through indexing
    (``torch.arange(10).float()[idx]``: a result the registry lost, indexing is not followed); with
    ``helper``, also a call of a function of the module (``make_weights()``) that returns one."""
    path: list[str] = []
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in LEGACY:
                return node.func.id, tuple(reversed(path)), None
            if helper is not None and not node.args and not node.keywords:
                found = helper(node.func.id)
                if found is not None:
                    return found[0], found[1] + tuple(reversed(path)), found[2]
            return None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if isinstance(func.value, ast.Name) and func.attr in LEGACY:
                return func.attr, tuple(reversed(path)), func.value.id
            if (
                isinstance(func.value, ast.Name) and func.attr in FACTORIES and "view" in path
                and not any(k.arg == "device" for k in node.keywords)
            ):
                return func.attr, tuple(reversed(path)), func.value.id
            path.append(func.attr)
            node = func.value
        elif isinstance(node, ast.Subscript):
            path.append("view")
            node = node.value
        else:
            return None


def _statement_at(filename: str, lineno: int) -> Optional[ast.AST]:
    lines = []
    for offset in range(10):
        line = linecache.getline(filename, lineno + offset)
        if not line:
            break
        lines.append(line)
        try:
            return ast.parse(textwrap.dedent("".join(lines)))
        except SyntaxError:
            continue
    return None


class _PerLine:
    """A fact read from the source of the line a frame is at: read once per line, then cached."""

    #: What a line whose source cannot be read gives.
    unreadable: Any = None

    def __init__(self) -> None:
        #: id(code) -> (code, {line: fact}). Keyed by the code's id (hashing a code object costs more than the
        #: whole lookup); the code is kept, so its id stays its own.
        self.cache: dict[int, tuple[CodeType, dict[int, Any]]] = {}

    def clear(self) -> None:
        self.cache.clear()

    def at(self, frame: FrameType) -> Any:
        code = frame.f_code
        entry = self.cache.get(id(code))
        if entry is None or entry[0] is not code:
            if len(self.cache) > 5000:
                self.cache.clear()
            entry = self.cache[id(code)] = (code, {})
        lines = entry[1]
        lineno = frame.f_lineno
        if lineno in lines:
            return lines[lineno]
        try:
            found = self._read(code, lineno)
        except Exception:  # noqa: BLE001 - unreadable source
            found = self.unreadable
        lines[lineno] = found
        return found

    def _read(self, code: CodeType, lineno: int) -> Any:
        raise NotImplementedError


class CpuLiterals(_PerLine):
    """Whether the statement at a line writes a CPU device out (``"cpu"``, ``"cpu:0"``) as a call's argument.

    ``.to("cpu")`` written out is a host target on purpose; ``.to(device)`` where ``device`` holds ``"cpu"`` on
    this machine (``"cpu" if not on_gpu else index``) is the training device, a copy on a GPU machine.
    """

    unreadable = True  # source that cannot be read: the value is taken at its word

    def _read(self, code: CodeType, lineno: int) -> bool:
        tree, offset = _statement_at(code.co_filename, lineno), lineno - 1
        if tree is None:  # a line inside a statement (``{"a": torch.tensor(v).to(device),``): the function
            tree, offset = _function_body(code, lineno) or (None, 0)
        if tree is None:
            return self.unreadable
        return any(
            isinstance(arg, ast.Constant) and is_cpu_string(arg.value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Call) and node.lineno + offset <= lineno <= (node.end_lineno or 0) + offset
            for arg in [*node.args, *(k.value for k in node.keywords)]
        )


def _function_body(code: CodeType, lineno: int) -> Optional[tuple[ast.AST, int]]:
    """The function (or module) whose code is ``code``, parsed, with the line offset of its first line."""
    first = code.co_firstlineno
    lines = linecache.getlines(code.co_filename)
    if not lines:
        return None
    if code.co_name == "<module>":
        try:
            return ast.parse("".join(lines)), 0
        except SyntaxError:
            return None
    text = []
    for i in range(first - 1, min(len(lines), first - 1 + 2000)):
        text.append(lines[i])
        if i + 1 >= lineno:
            try:
                return ast.parse(textwrap.dedent("".join(text))), first - 1
            except SyntaxError:
                continue
    return None


#: ``(constructor, methods called on it, the line that built it, the name it is reached through)``.
LegacySite = tuple[str, tuple[str, ...], int, Optional[str]]


def _helper_returns(filename: str, name: str) -> Optional[LegacyCall]:
    """The host constructor a module-level function ``name`` of ``filename`` returns, when each of its
    ``return`` statements returns one (``def weights(): return torch.Tensor([1, 2, 3])``)."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    try:
        module = ast.parse("".join(lines))
    except SyntaxError:
        return None
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and node.name == name and not node.args.args:
            returns = [n for n in ast.walk(node) if isinstance(n, ast.Return) and n.value is not None]
            found = [_legacy_call(r.value) for r in returns]  # type: ignore[arg-type]
            if found and all(f is not None for f in found):
                return found[0]
    return None


def _resolves(frame: FrameType, constructor: str, through: Optional[str]) -> bool:
    """Whether ``through.constructor`` (or the bare ``constructor``) names torch's legacy constructor at ``frame``:
    ``Tensor(n)`` after ``from torch import Tensor``, ``th.FloatTensor(n)`` after ``import torch as th``."""
    import torch

    def lookup(name: str) -> Any:
        # f_globals first: reading f_locals builds a snapshot of the frame's locals
        value = frame.f_globals.get(name, _MISSING)
        if value is _MISSING or name in frame.f_code.co_varnames or name in frame.f_code.co_cellvars:
            value = frame.f_locals.get(name, value)
        return value

    if through is None:
        return lookup(constructor) is getattr(torch, constructor, None)
    return lookup(through) is torch and hasattr(torch, constructor)


_MISSING = object()


class LegacySites(_PerLine):
    """Which lines call one of ``calls`` on a tensor a legacy constructor (``torch.FloatTensor(...)``) built:
    ``(constructor, path, the line that built it, the name it is reached through)`` or None."""

    def __init__(self, calls: frozenset[str] | tuple[str, ...]) -> None:
        super().__init__()
        self.calls = frozenset(calls)

    def _read(self, code: CodeType, lineno: int) -> Optional[LegacySite]:
        tree = _statement_at(code.co_filename, lineno)
        if tree is None:
            return None
        names: list[str] = []

        def helper(name: str) -> Optional[LegacyCall]:
            return _helper_returns(code.co_filename, name)

        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in self.calls:
                receiver = node.func.value
                found = _legacy_call(receiver, helper)
                if found is not None:
                    filled = (node.func.attr,) if node.func.attr in INITIALIZERS else ()
                    return found[0], found[1] + filled, lineno, found[2]
                if isinstance(receiver, ast.Name):
                    names.append(receiver.id)
        if not names:
            return None
        for node in ast.walk(tree):  # ``t = torch.LongTensor(x); t = t.to(dev)`` on one line
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id in names:
                    found = _legacy_call(node.value)
                    if found is not None:
                        return found[0], found[1], lineno, found[2]
        parsed = _function_body(code, lineno)
        if parsed is None:
            return None
        body, offset = parsed
        best: Optional[LegacySite] = None
        for node in ast.walk(body):
            if not isinstance(node, ast.Assign) or len(node.targets) != 1:
                continue
            target = node.targets[0]
            line = node.lineno + offset
            if isinstance(target, ast.Name) and target.id in names and line < lineno:
                found = _legacy_call(node.value)
                if found is not None and (best is None or line > best[2]):
                    best = (found[0], found[1], line, found[2])
                elif found is None and best is not None and line > best[2]:
                    best = None  # reassigned to something else since
        return best


def legacy_birth(probe: HostRegistry, sites: LegacySites, frame: Optional[FrameType], tensor: Any) -> Optional[Birth]:
    """The birth of ``tensor`` moved at ``frame`` when the source there shows a legacy constructor built it."""
    site = caller(frame)
    if site is None or tensor.device.type != "cpu":
        return None
    kind = kind_of(site.f_code)
    if kind == TORCH:
        return None
    found = sites.at(site)
    if found is None:
        return None
    constructor, path, line, through = found
    if not _resolves(site, constructor, through):
        return None
    birth = probe.site_birth(constructor, tensor, site, kind, False)
    birth.path = tuple(p for p in path if p != "view")
    if line != site.f_lineno:
        birth.site = Frame(site.f_code.co_filename, line, site.f_code.co_name)
        birth.stack = tuple(birth.stack[:-1]) + (birth.site,)
    return birth
