"""Host provenance through every other tensor operation: a result whose tensor inputs are all host tensors is one.

:mod:`._propagate` follows a few cheap operations by hand (``triu``,
``masked_fill``, ``+ - * /``, ``stack``/``cat``). A table is often built on the
host through any other math and moved every step, as a sinusoidal position or
timestep embedding is::

    pos = torch.arange(n).float()
    inv = 1 / (10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.einsum("i,j->ij", pos, inv)
    table = torch.cat([emb.sin(), emb.cos()], -1).to(dev)

The rule is the same for every operation: a result computed only from host
tensors (python numbers are fine) is a host tensor, with the birth of its
first host input and the operation appended to its path. :func:`install`
applies it to every public, non in-place Tensor method that returns a new
tensor (``pow``, ``sin``, ``sum``, ``repeat``, ``flip``...), except those in
:data:`SKIP_METHODS` (no tensor result, views, already followed elsewhere),
to ``torch.einsum`` and the other Python functions of :data:`PY_FUNCTIONS`,
and to the eight table-building operators of :data:`TABLE_MATH` (``torch.exp``,
``torch.outer``...). Torch's other operators in the ``torch`` namespace
(``torch.lt``, ``torch.add``, ``torch.relu``...) are not wrapped: code keeps them
in tables and compares them (``op == torch.lt``), so a watch leaves them the
very objects they were; their results (``torch.tanh(t)``, where ``t.tanh()``
is followed) count as device tensors.
Views (``t[:, None]``, ``t.unsqueeze(0)``) keep the provenance of their base
without a wrapper.

Cost: nothing until the first host tensor built by code outside torch
appears in the watch (installed with the other Tensor operations of
:mod:`._propagate`, on that event); afterwards each wrapped call pays one
Python call, one dictionary lookup of its first argument (two for a view) and
nothing else unless that argument is a host tensor your code built. Torch's
own layers call :mod:`torch.nn.functional`'s functions and ``torch._C``
operators directly (bound at import), which are not wrapped. Not followed:
indexing with ``[]`` (``table[idx]``: patching ``Tensor.__getitem__`` would
change the class's C slots), functions imported by name before the run
(``from torch import exp``), operations of a tensor subclass with its own
``__torch_function__``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from ..core import FLAGS
from ..patching import wraps

if TYPE_CHECKING:
    from ..patching import Patcher
    from ._host import HostRegistry

__all__ = ["PY_FUNCTIONS", "SKIP_METHODS", "TABLE_MATH", "install", "method_names", "function_names"]

#: The ``torch`` functions followed: Python functions of torch (``torch.einsum`` calls torch's operator
#: directly, past any Tensor method); torch's own operators are followed through their Tensor methods.
PY_FUNCTIONS = ("einsum", "tensordot", "cdist", "broadcast_tensors", "meshgrid", "cartesian_prod", "block_diag",
                "norm", "split", "chain_matmul", "atleast_1d", "atleast_2d", "atleast_3d")
#: The few operators of the ``torch`` namespace followed too: the math that builds position and timestep
#: tables on the host, spelled as functions more often than as methods (``torch.exp(-log(10000) * i / d)``,
#: ``torch.outer(t, inv_freq)``, ``torch.polar(ones, freqs)``). Comparisons and the arithmetic and activations
#: code keys op tables by (``torch.lt``, ``torch.add``, ``torch.relu``) are left alone: their Tensor methods
#: and operators follow them.
TABLE_MATH = ("exp", "log", "sin", "cos", "pow", "sqrt", "outer", "polar")
#: Tensor methods never wrapped: no tensor result, a view (its ``_base`` keeps the provenance), a move or a
#: conversion (followed by :mod:`.tensors`), or hot on every path while meaning nothing here.
SKIP_METHODS = frozenset((
    "size", "dim", "numel", "nelement", "ndimension", "item", "tolist", "stride", "data_ptr", "element_size",
    "storage", "untyped_storage", "storage_offset", "storage_type", "get_device", "is_contiguous",
    "is_floating_point", "is_complex", "is_pinned", "is_shared", "is_set_to", "is_same_size", "is_signed",
    "is_nonzero", "is_inference", "is_coalesced", "is_conj", "is_neg", "has_names", "dim_order",
    "backward", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "numpy", "pin_memory",
    "record_stream", "apply_", "map_", "map2_", "share_memory_", "to", "cuda", "cpu", "type", "type_as", "copy_",
    "new_tensor", "new_zeros", "new_ones", "new_empty", "new_full", "new_empty_strided", "align_to", "refine_names",
    "rename", "module_load", "dequantize", "q_scale", "q_zero_point", "qscheme", "int_repr", "to_dense",
    "to_sparse", "to_mkldnn", "coalesce", "values", "indices", "crow_indices", "col_indices", "ccol_indices",
    "row_indices", "sparse_dim", "dense_dim", "smm", "resize", "resize_as", "untyped_storage", "nbytes",
    "view", "view_as", "expand", "expand_as", "t", "transpose", "permute", "unsqueeze", "squeeze", "narrow",
    "select", "unfold", "as_strided", "unbind", "split", "chunk", "tensor_split", "movedim", "moveaxis",
    "swapaxes", "swapdims", "diagonal", "real", "imag", "unflatten", "split_with_sizes", "hsplit", "vsplit",
    "dsplit", "adjoint", "conj", "resolve_conj", "resolve_neg", "requires_grad_", "detach", "clone",
    "masked_fill", "triu", "tril", "float", "double", "half", "bfloat16", "long", "int", "short", "bool",
    "byte", "char", "cfloat", "cdouble", "sum_to_size", "data", "grad", "is_leaf",
))
def method_names(tensor_type: Any, skip: frozenset[str] | set[str]) -> list[str]:
    """The public, non in-place Tensor methods to wrap (the ones returning a new tensor).

    Read from ``dir(tensor_type)`` once for each set of names its classes hold (about 0.2 ms, and every watch
    of a training loop asks): a name added to or taken from any class of its MRO reads them again. The key
    holds the names themselves, not how many there are: one library's method added after another test took
    its own away leaves the count as it was.
    """
    key = (tensor_type, frozenset(skip), tuple(tuple(vars(cls)) for cls in tensor_type.__mro__))
    found = _METHOD_NAMES.get(key)
    if found is None:
        if len(_METHOD_NAMES) > 64:  # each set of patches in place when asked is one key: bounded all the same
            _METHOD_NAMES.clear()
        found = _METHOD_NAMES[key] = tuple(_method_names(tensor_type, skip))
    return list(found)


#: (Tensor type, names skipped, the names its classes hold) -> the names :func:`method_names` found.
_METHOD_NAMES: dict[tuple[Any, frozenset[str], tuple[tuple[str, ...], ...]], tuple[str, ...]] = {}


def _method_names(tensor_type: Any, skip: frozenset[str] | set[str]) -> list[str]:
    names = []
    for name in dir(tensor_type):
        if name.startswith("_") or name.endswith("_") or name in SKIP_METHODS or name in skip:
            continue
        if name.startswith(("is_", "has_", "to_", "new_", "get_", "set_")):
            continue
        try:
            value = getattr(tensor_type, name)
        except Exception:  # noqa: BLE001 - a descriptor that raises on the class
            continue
        if callable(value) and not isinstance(value, (property, type)):
            names.append(name)
    return names


def function_names(torch: Any, skip: frozenset[str] | set[str]) -> list[str]:
    """The ``torch`` functions to wrap: :data:`PY_FUNCTIONS` and :data:`TABLE_MATH`.

    Torch's other operators (``torch.lt``, ``torch.add``, ``torch.relu``...) are followed through their Tensor
    methods and operators, not wrapped in the namespace: code keeps them in tables and compares them
    (``op == torch.lt``), and each one wrapped was one more attribute a watch replaced.
    """
    return [n for n in PY_FUNCTIONS + TABLE_MATH if callable(getattr(torch, n, None)) and n not in skip]


def _sources(args: tuple[Any, ...], kwargs: dict[str, Any], tensor_type: Any) -> list[Any]:
    """The tensors among a call's arguments (and inside its list or tuple arguments)."""
    found = []
    for value in args:
        if isinstance(value, tensor_type):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, tensor_type))
    for value in kwargs.values():
        if isinstance(value, tensor_type):
            found.append(value)
    return found


def install(probe: HostRegistry, patcher: Patcher, torch: Any, dispatch: Any, skip_methods: set[str],
            skip_functions: set[str]) -> None:
    """Wrap the methods and functions above so their results keep host provenance; undone by ``patcher``."""
    tensor_type = torch.Tensor
    flags = FLAGS
    is_compiling = probe.compiling
    traced = probe.traced
    follow = probe.follow

    def outcome(name: str, out: Any, sources: Any) -> None:
        if isinstance(out, tensor_type):
            follow(name, out, tuple(sources))
        elif isinstance(out, (tuple, list)):  # ``max(dim)``, ``sort``, ``split``, ``broadcast_tensors``
            for item in out:
                if isinstance(item, tensor_type):
                    follow(name, item, tuple(sources))

    def method(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def op(self: Any, *args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            if type(self) is not tensor_type and dispatch.overrides(self):
                return dispatch.call(original, self, args, kwargs)
            out = original(self, *args, **kwargs)
            # Every input must be a host tensor: ``self`` first, one lookup (two for a view).
            if traced and (id(self) in traced or (self._base is not None and id(self._base) in traced)):
                if not is_compiling() and flags.active:
                    try:
                        outcome(name, out, [self, *_sources(args, kwargs, tensor_type)])
                    except Exception as exc:  # noqa: BLE001 - never into the user's code
                        probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(op)

    def function(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def fn(*args: Any, **kwargs: Any) -> Any:
            __tracebackhide__ = True
            out = original(*args, **kwargs)
            if not is_compiling() and traced and flags.active:  # nothing of torchperf's read while dynamo traces
                try:
                    sources = _sources(args, kwargs, tensor_type)
                    if sources and any(probe.is_traced(s) for s in sources):
                        outcome(name, out, sources)
                except Exception as exc:  # noqa: BLE001
                    probe.failed(exc)  # type: ignore[attr-defined]
            return out

        return wraps(original)(fn)

    for name in method_names(tensor_type, skip_methods):
        patcher.wrap(tensor_type, name, lambda original, name=name: method(name, original))  # type: ignore[misc]
    for name in function_names(torch, skip_functions):
        patcher.wrap(torch, name, lambda original, name=name: function(name, original))  # type: ignore[misc]
