"""The ``on_device`` hint: the device-side spelling of the very call that built a host tensor.

Reads the statement at the factory's and the move's lines (``ast``), so the
hint names the user's own arguments: ``torch.randn(x.shape, device=self.device)``.
"""

from __future__ import annotations

import ast
import linecache
import textwrap
from types import FrameType
from typing import Any, Optional

from ..frames import describe_frame
from ..probes.tensors import Birth, Move
from ..stacks import Frame

__all__ = ["reassigns", "spell", "CONSTANT_FACTORIES"]

#: Factories whose values are the same every step: a registered buffer is the better fix.
CONSTANT_FACTORIES = frozenset(("tensor", "as_tensor", "asarray", "from_numpy", "arange", "linspace", "logspace",
                                "eye", "zeros", "ones", "full", "tril_indices", "triu_indices",
                                "hann_window", "hamming_window", "bartlett_window", "blackman_window", "kaiser_window"))
_NEW_METHODS = {"zeros": "new_zeros", "ones": "new_ones", "empty": "new_empty", "full": "new_full",
                "tensor": "new_tensor", "as_tensor": "new_tensor", "asarray": "new_tensor"}
_LIKE = {"zeros": "zeros_like", "ones": "ones_like", "empty": "empty_like", "full": "full_like",
         "rand": "rand_like", "randn": "randn_like", "randint": "randint_like"}


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


def spell(event: Move, mover: Frame) -> str:
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
    if birth.factory in CONSTANT_FACTORIES or not birth.in_scope or not event.first:
        made = call[0] if call else f"torch.{factory}(...)"
        hint += (
            f"; if it is the same every step, build it once in `__init__` with "
            f"`self.register_buffer(\"name\", {made}, persistent=False)` so it moves with the module"
        )
    return hint


def _tensors_dtype(event: Move) -> str:
    target = event.target
    if event.op in ("type_as", "to") and isinstance(target, _tensor_type()):
        return str(target.dtype).replace("torch.", "")
    return str(event.tensor.dtype).replace("torch.", "")
