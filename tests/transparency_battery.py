"""Torch behaviours a watch must not change: run in a fresh interpreter by ``test_transparency.py``.

``python tests/transparency_battery.py OUT.json`` evaluates every behaviour in
:data:`BEHAVIOURS` four ways, in this order, in one process that has never
been watched before:

- ``unwatched``: before any watch (the reference);
- ``in_step``: inside a watch with every invariant on, inside ``run.step()``;
- ``out_of_step``: inside such a watch, between steps;
- ``after``: after the watches ended;

and writes each result as plain data: a value (tensors as dtype, shape,
device, requires_grad and values) or an exception (type and message). A
behaviour is one line: ``name: lambda: expression`` (or a small function).
"""

from __future__ import annotations

import collections.abc
import copy
import io
import json
import operator
import pickle
import sys
import warnings
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F


def t0() -> torch.Tensor:
    return torch.tensor(1.5)


def dense() -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3)


def ints() -> torch.Tensor:
    return torch.tensor([3, 1, 2, 3])


def mask() -> torch.Tensor:
    return torch.tensor([True, False, True, False])


def cplx() -> torch.Tensor:
    return torch.tensor([1 + 2j, 3 - 1j])


def empty() -> torch.Tensor:
    return torch.zeros(0)


def setitem(t: torch.Tensor, index: Any, value: Any) -> torch.Tensor:
    t[index] = value
    return t


def autograd_grad() -> torch.Tensor:
    x = torch.ones(3, requires_grad=True)
    (x * torch.arange(3.0)).sum().backward()
    return x.grad


class Square(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


def custom_function() -> torch.Tensor:
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    Square.apply(x).sum().backward()
    return x.grad


def tensor_hook() -> torch.Tensor:
    x = torch.ones(2, requires_grad=True)
    x.register_hook(lambda g: g * 10)
    (x * 2).sum().backward()
    return x.grad


#: torch's own methods, captured before any watch: what a subclass keyed on them would hold.
TABLE = {torch.Tensor.item, torch.Tensor.to, torch.Tensor.__format__, torch.Tensor.cpu, torch.Tensor.float}


class Logged(torch.Tensor):
    """A subclass with its own ``__torch_function__`` that records which torch functions reach it."""

    seen: list = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.seen.append((getattr(func, "__name__", str(func)), func in TABLE))
        return super().__torch_function__(func, types, args, kwargs or {})


def subclass_calls() -> list:
    Logged.seen = []
    x = torch.ones(2).as_subclass(Logged)
    x.to(torch.float64)
    x.float()
    x.sum().item()
    x.cpu()
    format(x, "")
    return [entry for entry in Logged.seen if entry[0] in ("to", "float", "item", "__format__", "cpu")]


def compiled() -> tuple:
    graphs: list = []

    def backend(gm: Any, example_inputs: Any) -> Any:
        graphs.append(sorted(str(node.target) for node in gm.graph.nodes if node.op == "call_function"))
        return gm.forward

    def step(x: torch.Tensor) -> torch.Tensor:
        noise = torch.zeros(x.shape).to(x.device)
        return (x * 2 + noise).float().sum()

    out = torch.compile(step, backend=backend)(torch.ones(4))
    return out, graphs


def module_roundtrips() -> tuple:
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape))
    copied = copy.deepcopy(model)
    unpickled = pickle.loads(pickle.dumps(model))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.ones(1, 3)
    return model(x), copied(x), unpickled(x), loaded(x)


def optimizer_roundtrip() -> tuple:
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.Adam([p], lr=0.1)
    p.sum().backward()
    opt.step()
    clone = copy.deepcopy(opt)
    state = pickle.loads(pickle.dumps(opt.state_dict()))
    return p, clone.state_dict()["state"][0]["exp_avg"], state["state"][0]["step"]


def warning_of_copy_construct() -> tuple:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.tensor(torch.ones(2))
    return [(w.category.__name__, str(w.message)[:40], w.filename.rsplit("/", 1)[-1], w.lineno) for w in caught]


def device_context() -> str:
    with torch.device("meta"):
        return str(torch.zeros(2).device) + str(torch.randn(2).device)


def loader_values() -> list:
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.arange(8.0))
    return [b[0] for b in DataLoader(data, batch_size=3)]


#: name -> behaviour. Adding one is one line.
BEHAVIOURS: dict[str, Callable[[], Any]] = {
    "tensor_of_0d_tensors": lambda: torch.tensor([t0() * 2, t0()]),
    "tensor_of_nested_0d": lambda: torch.tensor([[t0(), t0() + 1], [t0(), t0()]]),
    "as_tensor_of_0d": lambda: torch.as_tensor([t0(), t0()]),
    "numpy_array_of_0d": lambda: np.array([t0(), t0()]).tolist(),
    "is_sequence_dense": lambda: isinstance(dense(), collections.abc.Sequence),
    "len_dense": lambda: len(dense()),
    "len_0d": lambda: len(t0()),
    "len_empty": lambda: len(empty()),
    "iter_dense": lambda: list(dense()),
    "iter_0d": lambda: list(t0()),
    "contains": lambda: (2 in ints(), 7 in ints()),
    "getitem_int": lambda: dense()[1],
    "getitem_slice": lambda: dense()[:, 1:],
    "getitem_none_ellipsis": lambda: dense()[None, ..., 0],
    "getitem_mask": lambda: ints()[mask()],
    "getitem_mask_tuple": lambda: dense()[torch.tensor([True, False]), 0],
    "getitem_tensor_index": lambda: ints()[torch.tensor([0, 2])],
    "getitem_out_of_range": lambda: dense()[5],
    "setitem_mask_scalar": lambda: setitem(ints(), mask(), 0),
    "setitem_mask_tensor": lambda: setitem(ints(), mask(), torch.tensor([7, 8])),
    "setitem_slice": lambda: setitem(dense(), (0, slice(None)), 1.0),
    "bool_0d": lambda: bool(t0()),
    "bool_dense": lambda: bool(dense()),
    "bool_empty": lambda: bool(empty()),
    "bool_mask_any": lambda: bool(mask().any()),
    "float_int_complex": lambda: (float(t0()), int(t0()), complex(t0())),
    "float_dense": lambda: float(dense()),
    "index_int": lambda: operator.index(torch.tensor(3)),
    "index_float": lambda: operator.index(t0()),
    "range_of_tensor": lambda: list(range(torch.tensor(3))),
    "list_index_by_tensor": lambda: [10, 20, 30][torch.tensor(1)],
    "format_0d": lambda: f"{t0():.2f}",
    "format_dense": lambda: f"{dense()}",
    "format_spec_dense": lambda: format(dense(), ".2f"),
    "repr_str": lambda: (repr(dense()), str(cplx()), repr(empty()), repr(mask())),
    "item_tolist_numpy": lambda: (t0().item(), dense().tolist(), dense().numpy().tolist()),
    "item_dense": lambda: dense().item(),
    "array_protocol": lambda: np.asarray(dense()).sum().item(),
    "complex_ops": lambda: (cplx().abs(), cplx().real, cplx() * 1j),
    "int_ops": lambda: (ints() // 2, ints() % 3, divmod(torch.tensor(7), 3)),
    "builtin_sum_max_sorted": lambda: (sum(torch.arange(4)), max(torch.arange(4)), sorted(torch.tensor([3, 1, 2]))),
    "equal_allclose": lambda: (ints().equal(ints()), torch.allclose(dense(), dense())),
    "nonzero_where_unique": lambda: (torch.nonzero(ints()), torch.where(mask()), torch.unique(ints())),
    "bincount_repeat_masked": lambda: (
        torch.bincount(ints()), torch.repeat_interleave(torch.tensor([1, 2])), ints().masked_select(mask())
    ),
    "one_hot": lambda: F.one_hot(torch.tensor([0, 2])),
    "is_nonzero": lambda: torch.is_nonzero(torch.tensor([1])),
    "to_dtype_device": lambda: (dense().to(torch.float64), dense().to("cpu"), dense().to(t0())),
    "cuda_on_cpu": lambda: dense().cuda(),
    "type_as_copy": lambda: (ints().type_as(t0()), torch.empty(2, 3).copy_(dense())),
    "conversions": lambda: (dense().double(), dense().half(), dense().long(), mask().int(), ints().bool()),
    "seeded_factories": lambda: (torch.manual_seed(0), torch.randn(3), torch.rand(2), torch.randint(5, (3,)))[1:],
    "factories": lambda: (torch.zeros(2), torch.ones(2, dtype=torch.int64), torch.full((2,), 7.0), torch.eye(2),
                          torch.linspace(0, 1, 3), torch.arange(3), torch.from_numpy(np.ones(2))),
    "zero_grad_zero_": lambda: torch.ones(3).zero_(),
    "pickle_tensor": lambda: pickle.loads(pickle.dumps(dense())),
    "deepcopy_tensor": lambda: copy.deepcopy(cplx()),
    "autograd": autograd_grad,
    "autograd_function": custom_function,
    "tensor_hook": tensor_hook,
    "subclass_torch_function": subclass_calls,
    "device_context_manager": device_context,
    "warning_location": warning_of_copy_construct,
    "module_pickle_deepcopy_save": module_roundtrips,
    "optimizer_deepcopy_pickle": optimizer_roundtrip,
    "dataloader_values": loader_values,
    "compile_eager_backend": compiled,
}


def plain(value: Any) -> Any:
    """``value`` as JSON-able data (tensors by dtype, shape, device, grad flag and values)."""
    if isinstance(value, torch.Tensor):
        data = value.detach()
        values = data.tolist() if data.device.type != "meta" else None
        if data.is_complex():
            values = [[v.real, v.imag] for v in data.reshape(-1).tolist()]
        return {"tensor": str(value.dtype), "shape": list(value.shape), "device": str(value.device),
                "requires_grad": value.requires_grad, "type": type(value).__name__, "values": values}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, complex):
        return ["complex", value.real, value.imag]
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, np.generic):
        return value.item()
    return repr(type(value))


def evaluate(behaviour: Callable[[], Any]) -> Any:
    try:
        return {"value": behaviour()}
    except Exception as exc:  # noqa: BLE001 - the exception is the behaviour
        return {"raised": type(exc).__name__, "message": str(exc)}


def every_invariant() -> dict[str, Any]:
    """Every registered invariant on, with a valid value."""
    from pytest_torchperf import registry
    from pytest_torchperf.arguments import Flag

    out: dict[str, Any] = {}
    for name, invariant in registry.invariants().items():
        if isinstance(invariant.kind, Flag):
            out[name] = True
        elif name == "max_overhead":
            out[name] = 0.5
        elif name == "gpu_settings":
            out[name] = "ampere"
        else:
            out[name] = getattr(invariant.kind, "minimum", None) or 1
    return out


def main(path: str) -> None:
    from pytest_torchperf import InvariantViolation, watch

    results: dict[str, dict[str, Any]] = {name: {} for name in BEHAVIOURS}
    for name, behaviour in BEHAVIOURS.items():
        results[name]["unwatched"] = evaluate(behaviour)
    kwargs = every_invariant()
    for condition in ("in_step", "out_of_step"):
        raw: dict[str, Any] = {}
        try:
            with watch(**kwargs) as run:
                for name, behaviour in BEHAVIOURS.items():
                    if condition == "in_step":
                        with run.step():
                            raw[name] = evaluate(behaviour)
                    else:
                        raw[name] = evaluate(behaviour)
        except InvariantViolation:
            pass  # the behaviours sync and copy on purpose: only what they return matters here
        for name, result in raw.items():
            results[name][condition] = result
    for name, behaviour in BEHAVIOURS.items():
        results[name]["after"] = evaluate(behaviour)
    data = {name: {cond: json.loads(json.dumps(plain(r), default=repr)) for cond, r in conds.items()}
            for name, conds in results.items()}
    data["__invariants__"] = sorted(kwargs)  # type: ignore[assignment]
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1])
