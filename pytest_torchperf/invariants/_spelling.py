"""The ``on_device`` hint: the device-side spelling of the very call that built a host tensor.

Reads the statement at the factory's and the move's lines (``ast``), so the
hint names the user's own arguments: ``torch.randn(x.shape, device=self.device)``.

No hint recommends what another check flags. Python data given to a device
factory (``torch.tensor(v, device=dev)``, ``x.new_tensor(v)``) is itself a
copy from host memory (blocking on CUDA), so data is spelled as what needs no
copy: ``torch.full((), v, device=dev)`` for a number, ``torch.zeros(n,
device=dev)`` for zeros, and otherwise a tensor built once (a buffer of the
module, or before the loop) and reused.
"""

from __future__ import annotations

import ast
import linecache
import textwrap
from types import FrameType
from typing import Any, Optional

from ..frames import describe_frame
from ..probes._host import DATA, DATA_FACTORIES, LEGACY
from ..probes.tensors import Birth, Move
from ..stacks import Frame

__all__ = ["one_copy", "reassigns", "spell", "CONSTANT_FACTORIES"]

#: Factories whose values are the same every step: a registered buffer is the better fix.
CONSTANT_FACTORIES = frozenset(("tensor", "as_tensor", "asarray", "from_numpy", "arange", "linspace", "logspace",
                                "eye", "zeros", "ones", "full", "tril_indices", "triu_indices",
                                "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window"))
#: ``x.new_*`` twins of the factories that take a shape (``new_tensor`` is a copy of host data: not one).
_NEW_METHODS = {"zeros": "new_zeros", "ones": "new_ones", "empty": "new_empty", "full": "new_full"}
_LIKE = {"zeros": "zeros_like", "ones": "ones_like", "empty": "empty_like", "full": "full_like",
         "rand": "rand_like", "randn": "randn_like", "randint": "randint_like"}
#: The dtype each legacy constructor builds (``torch.Tensor`` builds the default dtype).
_LEGACY_DTYPES = {"DoubleTensor": "float64", "HalfTensor": "float16", "BFloat16Tensor": "bfloat16",
                  "ByteTensor": "uint8", "CharTensor": "int8", "ShortTensor": "int16", "IntTensor": "int32",
                  "LongTensor": "int64", "BoolTensor": "bool"}
#: Steps of a birth's path that only convert or view (the rest are operations the hint mentions).
_PLAIN_STEPS = frozenset(("view", "to", "float", "double", "half", "bfloat16", "long", "int", "short", "bool",
                          "detach", "clone"))
_DATA_NOTE = "copies host memory to the device: on CUDA a blocking copy that waits for the stream, every time"


def _tensor_type() -> Any:
    import torch

    return torch.Tensor


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


def reassigns(frame: Optional[FrameType]) -> bool:
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


_methods: dict[tuple[str, int], bool] = {}


def in_method(site: Optional[Frame]) -> bool:
    """Whether ``site`` is inside a method (a function whose first parameter is ``self``): a buffer fits there."""
    if site is None:
        return False
    key = (site.filename, site.lineno)
    found = _methods.get(key)
    if found is None:
        found = False
        try:
            tree = ast.parse("".join(linecache.getlines(site.filename)))
        except (SyntaxError, ValueError):
            tree = None
        best = None
        for node in ast.walk(tree) if tree is not None else ():
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                end = getattr(node, "end_lineno", None) or node.lineno
                if node.lineno <= site.lineno <= end and (best is None or node.lineno > best.lineno):
                    best = node
        if best is not None and best.args.args:
            found = best.args.args[0].arg == "self"
        if len(_methods) > 10000:
            _methods.clear()
        _methods[key] = found
    return found


def _target_text(event: Move, mover: Frame) -> tuple[str, bool]:
    """The target as written at the move (``self.device``, ``x``...), and whether it names a tensor."""
    is_tensor = isinstance(event.target, _tensor_type())
    if event.op == "cuda":
        return '"cuda"', False
    parsed = _statement(mover)
    if parsed is not None:
        text, tree = parsed
        for call in _calls(tree, (event.op,)):
            func = call.func
            if event.op == "copy_" and isinstance(func, ast.Attribute):
                return _segment(text, func.value) or "dst", True
            arg = (
                call.args[0]
                if call.args
                else next((k.value for k in call.keywords if k.arg in ("device", "other")), None)
            )
            if arg is not None:
                return _segment(text, arg) or "device", is_tensor
    return ("x" if is_tensor else "device"), is_tensor


def _factory_call(birth: Birth, name: Optional[str] = None) -> Optional[tuple[str, str, str, ast.Call, str]]:
    """``(call text, function text, argument text, call node, statement text)`` of the factory call at the birth
    site.
    """
    if birth.site is None:
        return None
    parsed = _statement(birth.site)
    if parsed is None:
        return None
    text, tree = parsed
    calls = _calls(tree, (name or birth.factory,))
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
    return call_text, func_text, args_text, call, text


def _keyword(text: str, call: ast.Call, name: str) -> Optional[str]:
    for keyword in call.keywords:
        if keyword.arg == name:
            return _segment(text, keyword.value)
    return None


def _moved_expression(event: Move, mover: Frame) -> Optional[str]:
    """The expression the move was applied to, as written (``torch.triu(torch.ones(n, n), 1).float()``, ``mask``)."""
    parsed = _statement(mover)
    if parsed is None or event.op not in ("to", "cuda", "type_as"):
        return None
    text, tree = parsed
    for call in _calls(tree, (event.op,)):
        if isinstance(call.func, ast.Attribute):
            return _segment(text, call.func.value)
    return None


def _build_once(what: str, site: Optional[Frame], in_lightning: bool, on_device: str = "") -> str:
    """Advice to build ``what`` once: a buffer in a module's method, else before the loop (``on_device``:
    the same call with its ``device=``)."""
    if in_method(site) or in_lightning:
        return (f"build it once in `__init__` with `self.register_buffer(\"name\", {what}, persistent=False)` "
                "so it moves with the module")
    return f"build it once before the loop, `t = {on_device or what + '.to(device)'}`, and reuse it"


def _once_derived(expression: Optional[str], birth: Birth, mover: Frame, in_lightning: bool) -> str:
    """Advice to build a host tensor made by several operations once (a mask, a table of constants)."""
    site = birth.site
    if expression and expression.isidentifier() and site is not None and site.location() != mover.location():
        if in_method(site) or in_lightning:
            return (f"build `{expression}` once in `__init__` (it is made at {site.location()}) and register it: "
                    f"`self.register_buffer(\"{expression}\", {expression}, persistent=False)`, so it moves with "
                    "the module")
        return (f"build `{expression}` once before the loop (it is made at {site.location()}) and move it to the "
                "device once")
    text = expression or "the tensor"
    wrapped = text if _is_primary(text) else f"({text})"
    return _build_once(text, site, in_lightning, f"{wrapped}.to(device)")


def _is_primary(text: str) -> bool:
    """Whether ``text`` needs no parentheses before ``.to(...)`` (a name, call, attribute or subscript)."""
    try:
        node = ast.parse(text, mode="eval").body
    except SyntaxError:
        return False
    return isinstance(node, (ast.Name, ast.Call, ast.Attribute, ast.Subscript))


def _dtype_text(birth: Birth, explicit: Optional[str]) -> str:
    """``, dtype=...`` for a factory that would otherwise build another dtype than the data did."""
    if explicit:
        return f", dtype={explicit}"
    if birth.dtype and birth.dtype != "float32":
        return f", dtype=torch.{birth.dtype}"
    return ""


def _shape_text(shape: tuple[int, ...]) -> str:
    return ", ".join(str(n) for n in shape) if shape else "()"


def _data_spelling(birth: Birth, device: str, value: Optional[str], dtype: Optional[str], site: Optional[Frame],
                   in_lightning: bool, made: str, on_device: str = "") -> str:
    """The spelling of python data that needs no copy from host memory."""
    if birth.data == "scalar" and value:
        typed = f", dtype={dtype}" if dtype else ""
        return f"build it on the device without a copy: `torch.full((), {value}, device={device}{typed})`"
    if birth.data in ("zeros", "ones"):
        return (f"build it on the device without a copy: "
                f"`torch.{birth.data}({_shape_text(birth.shape)}, device={device}{_dtype_text(birth, dtype)})`")
    return (f"if the values are the same every step, {_build_once(made, site, in_lightning, on_device)}; if they "
            "change, compute them on the device from device tensors")


def _spell_data(event: Move, in_lightning: bool) -> str:
    """``torch.tensor(data, device=dev)`` / ``x.new_tensor(data)`` in a step."""
    birth = event.birth
    assert birth is not None
    found = _factory_call(birth)
    value = dtype = None
    device = "device"
    made = f"torch.{birth.factory}(...)"
    if found is not None:
        call_text, func_text, _, call, text = found
        value = _segment(text, call.args[0]) if call.args else _keyword(text, call, "data")
        dtype = _keyword(text, call, "dtype")
        if birth.factory == "new_tensor" and isinstance(call.func, ast.Attribute):
            device = f"{_segment(text, call.func.value)}.device"
            made = f"torch.tensor({value})" if value else made
        else:
            device = _keyword(text, call, "device") or device
            made = call_text.replace(f", device={device}", "") if device else call_text
    on_device = found[0] if found is not None and birth.factory != "new_tensor" else ""
    what = "`x.new_tensor(data)`" if birth.factory == "new_tensor" else f"`torch.{birth.factory}(data, device=...)`"
    return f"{what} {_DATA_NOTE}; " + _data_spelling(
        birth, device, value, dtype, birth.site, in_lightning, made, on_device
    )


def _is_count(arg: ast.expr, birth: Birth) -> bool:
    """Whether the one argument of ``torch.Tensor(arg)`` is a length (``n``, ``8``), not a whole shape (``x.shape``,
    ``*dims``, or a name for a shape of other than one dimension)."""
    if isinstance(arg, ast.Constant):
        return True
    if isinstance(arg, ast.Starred) or isinstance(arg, ast.Attribute) and arg.attr == "shape":
        return False
    return len(birth.shape) == 1


def _spell_legacy(event: Move, birth: Birth, device: str, in_lightning: bool) -> str:
    """``torch.Tensor(n).fill_(v)``, ``torch.FloatTensor(data)``: a legacy constructor builds on the host."""
    found = _factory_call(birth)
    dtype = _LEGACY_DTYPES.get(birth.factory)
    typed = f", dtype=torch.{dtype}" if dtype else ""
    if found is None:
        return f"create it on the device with a factory: `torch.empty(shape, device={device}{typed})`"
    call_text, _, args_text, call, text = found
    shape_like = (
        call.args
        and all(
            isinstance(a, ast.Constant)
            and isinstance(a.value, int)
            or isinstance(a, (ast.Name, ast.Attribute, ast.Starred))
            for a in call.args
        )
        and not any(isinstance(a, (ast.List, ast.Tuple)) for a in call.args)
    )
    fills = _calls(ast.parse(text), ("fill_",)) if "fill_" in birth.path else []
    if shape_like and fills and fills[0].args:
        value = _segment(text, fills[0].args[0])
        if len(call.args) > 1:
            shape = f"({args_text})"
        else:
            shape = f"({args_text},)" if _is_count(call.args[0], birth) else args_text
        return (f"the legacy constructor `{call_text}` builds on the host: create it on the device with "
                f"`torch.full({shape}, {value}, device={device}{typed})`")
    if shape_like:
        return (f"the legacy constructor `{call_text}` builds on the host: create it on the device with "
                f"`torch.empty({args_text}, device={device}{typed})` (or `torch.zeros`/`torch.full`)")
    return (f"the legacy constructor `{call_text}` copies host data: "
            + _build_once(f"torch.tensor({args_text}{typed})", birth.site, in_lightning,
                          f"torch.tensor({args_text}, device={device}{typed})"))


def spell(event: Move, mover: Frame, in_lightning: bool = False) -> str:
    """A hint naming the device-side spelling of the very call that built the tensor.

    ``in_lightning``: the move happened inside a Lightning call (a module method:
    a registered buffer is the way to build a constant once).
    """
    birth = event.birth
    if event.op == DATA and birth is not None:
        return _spell_data(event, in_lightning)
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
    if factory in LEGACY:
        return _spell_legacy(event, birth, device, in_lightning)
    found = _factory_call(birth)
    args = found[2] if found else "..."
    made = found[0] if found else f"torch.{factory}(...)"
    operations = [step for step in birth.path if step not in _PLAIN_STEPS]
    expression = _moved_expression(event, mover) if operations else None
    if factory in DATA_FACTORIES or factory == "from_numpy":
        # torch.tensor(data, device=dev) is itself a copy of host memory: spell what needs none.
        value = dtype = None
        on_device = ""
        if found is not None:
            call = found[3]
            value = _segment(found[4], call.args[0]) if call.args else None
            dtype = _keyword(found[4], call, "dtype")
            converted = [step for step in birth.path if step not in ("view", "detach", "clone")]
            typed = f", dtype=torch.{_tensors_dtype(event)}" if converted and not dtype else ""
            func = "torch.as_tensor" if factory == "from_numpy" else found[1]
            on_device = f"{func}({found[2]}, device={device}{typed})"
        if operations:
            return _once_derived(expression, birth, mover, in_lightning)
        return _data_spelling(birth, device, value, dtype, birth.site, in_lightning, made, on_device)
    converted = [step for step in birth.path if step not in ("view", "detach", "clone")]
    # .type_as(t) and .to(t) convert to t's dtype too; a conversion on the way changed the dtype.
    retyped = is_tensor and event.op in ("type_as", "to") and event.target.dtype != event.tensor.dtype
    dtype = f", dtype=torch.{_tensors_dtype(event)}" if (converted and not operations) or retyped else ""
    sep = ", " if args else ""
    if (
        is_tensor
        and factory in _LIKE
        and event.op == "type_as"
        and tuple(event.target.shape) == tuple(event.tensor.shape)
    ):
        spelled = f"torch.{_LIKE[factory]}({target})"
    elif is_tensor and factory in _NEW_METHODS and not converted and event.op in ("type_as", "to"):
        spelled = f"{target}.{_NEW_METHODS[factory]}({args})"
    else:
        func = found[1] if found else f"torch.{factory}"
        spelled = f"{func}({args}{sep}device={device}{dtype})"
    hint = f"create it on the device: `{spelled}`"
    if operations:
        hint += f" (then {', '.join(dict.fromkeys(operations))} run on the device too)"
    if event.op == "type_as" and is_tensor and factory not in _NEW_METHODS:
        hint += f" (or `torch.{_LIKE.get(factory, factory + '_like')}({target})` for the same shape)"
    if operations:
        hint += f"; if it is the same every step, {_once_derived(expression, birth, mover, in_lightning)}"
    elif factory in CONSTANT_FACTORIES or not birth.in_scope or not event.first:
        hint += f"; if it is the same every step, {_build_once(made, birth.site, in_lightning, spelled)}"
    return hint


def _tensors_dtype(event: Move) -> str:
    target = event.target
    if event.op in ("type_as", "to") and isinstance(target, _tensor_type()):
        return str(target.dtype).replace("torch.", "")
    return str(event.tensor.dtype).replace("torch.", "")


def one_copy(event: Move, mover: Frame) -> str:
    """The one-copy spelling of an array copied on the host on the way to the device (``torch.tensor(a).to(dev)``,
    CleanRL's ``torch.Tensor(obs).to(dev)``): ``torch.as_tensor(a, device=dev)``."""
    birth = event.birth
    if birth is None:
        return ""
    target, is_tensor = _target_text(event, mover)
    device = f"{target}.device" if is_tensor else target
    found = _factory_call(birth)
    array = "array"
    dtype = _LEGACY_DTYPES.get(birth.factory, "float32" if birth.factory == "Tensor" else "")
    if found is not None:
        call = found[3]
        array = (_segment(found[4], call.args[0]) if call.args else None) or array
        written = _keyword(found[4], call, "dtype")
        if written:
            dtype = written.replace("torch.", "")
    typed = f", dtype=torch.{dtype}" if dtype else ""
    return (
        f"copy it once: `torch.as_tensor({array}{typed}, device={device})` builds it from the array without a host "
        f"copy first; on CUDA, `torch.from_numpy({array}).pin_memory().to({device}, non_blocking=True)` also lets "
        "the copy overlap"
    )
