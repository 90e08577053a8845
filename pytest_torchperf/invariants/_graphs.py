"""Autograd graphs, seen from Python: tagging a step's graph, finding the graphs still alive, and who holds them.

Used by ``no_graph_retention``. Three tools:

- :func:`tag_graph`: walk a graph from its roots and put one *sentinel* object
  in the ``metadata`` dict of every node built since a given point (a node's
  metadata lives and dies with the C++ node, so the sentinel is alive exactly
  as long as some node of that step is). Nodes are dated by their autograd
  sequence number, a per-thread counter torch stamps on every node it builds
  (:func:`sequence_now` reads it without building one).
- :func:`scan`: every tensor that carries a graph, from the garbage
  collector's list of objects, dated by the nodes of its graph; the ones whose
  graph holds nodes of a step that has ended are *retained*. Costly (a pass
  over every Python object): only run once a sentinel said something survived.
- :func:`find_holders`: who keeps a retained tensor reachable, by a short
  breadth-first search over :func:`gc.get_referrers` up to an object attribute
  (``LossList.losses``), a module global, a closure or a local variable of a
  function on the stack (``local 'outputs' in test_loop``).
"""

from __future__ import annotations

import bisect
import gc
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from types import FrameType, ModuleType
from typing import Any, Callable, Optional

from ..clocks import perf_counter
from ..frames import kind_of
from ..stacks import TORCHPERF, USER, Frame, Stack

__all__ = [
    "Holder",
    "Retained",
    "Scan",
    "find_holders",
    "frame_locals",
    "parse_trace",
    "scan",
    "sequence_now",
    "tag_graph",
    "tensors_of",
]

#: The sequence number of nodes outside any sequence (AccumulateGrad, graph roots): never a step's own.
NO_SEQUENCE = 2**64 - 1
#: Where anomaly mode stores a node's creation stack.
TRACE_KEY = "traceback_"
#: At most this many graph nodes visited by one scan (a retained graph of thousands of steps is cut there).
SCAN_NODE_LIMIT = 200_000


def sequence_now() -> Callable[[], int]:
    """A function returning the sequence number the next graph node built on this thread will get."""
    import torch

    peek = getattr(getattr(torch._C, "_autograd", None), "_get_sequence_nr", None)
    if peek is not None:
        return peek

    def built() -> int:  # pragma: no cover - torch without _get_sequence_nr: build one node to read it
        with torch.enable_grad():
            probe = torch.zeros((), requires_grad=True)
            return probe.view_as(probe).grad_fn._sequence_nr() + 1  # type: ignore[union-attr]

    return built


def tag_graph(roots: Iterable[Any], floor: int, key: str, sentinel: Any, limit: int = 100_000) -> int:
    """Put ``sentinel`` under ``key`` in the metadata of each node reachable from ``roots`` built at or after
    sequence number ``floor``; returns how many nodes were tagged.

    Nodes built before ``floor`` are not entered (their inputs are older still),
    nor nodes already tagged under ``key`` (an earlier walk tagged what they
    lead to); so each node is tagged once, by the first walk that reaches it.
    """
    stack = list(roots)
    seen: set[int] = set()
    keep = []  # holds the node wrappers, so that their ids stay theirs during the walk
    tagged = 0
    while stack:
        node = stack.pop()
        ident = id(node)
        if ident in seen:
            continue
        seen.add(ident)
        keep.append(node)
        seq = node._sequence_nr()
        if seq < floor or seq == NO_SEQUENCE:
            continue
        metadata = node.metadata
        if key in metadata:
            continue
        metadata[key] = sentinel
        tagged += 1
        if tagged >= limit:
            break
        for child, _ in node.next_functions:
            if child is not None:
                stack.append(child)
    return tagged


def tensors_of(output: Any) -> list[Any]:
    """The tensors of a module's output: a tensor, or inside a tuple, list or dict (two levels)."""
    import torch

    found: list[Any] = []
    stack: list[tuple[Any, int]] = [(output, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif depth < 2 and isinstance(value, (list, tuple)):
            stack.extend((v, depth + 1) for v in value)
        elif depth < 2 and isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
    return found


# -- scanning the live graphs ---------------------------------------------------------------


@dataclass
class Retained:
    """One tensor alive at a scan whose graph holds nodes of a step that has ended."""

    tensor: Any
    #: The step that built the tensor itself (its ``grad_fn``); 0: before the first step.
    own_step: int
    #: The steps whose nodes its graph holds (the ones that ended count; the current one too).
    steps: set[int]
    #: ids of its graph's nodes from steps that have ended (valid during the scan).
    nodes: set[int]
    #: ``(device, data pointer) -> bytes`` of the activations those nodes still save (none once backward ran).
    storages: dict[tuple, int]
    #: Bytes of the tensor's own data.
    data_bytes: int
    #: ``grad_fn`` name (``MseLossBackward0``).
    node_name: str
    #: Where it was built, when torch recorded it (anomaly mode during a traced step).
    trace: Optional[Stack] = None


@dataclass
class Scan:
    """What one scan found."""

    #: The step count when it ran: nodes of steps before this one are from ended steps.
    at_step: int
    retained: list[Retained] = field(default_factory=list)
    #: Tensors with a graph alive (retained or not), graph nodes visited, whether the node limit cut the walk.
    graph_tensors: int = 0
    nodes_visited: int = 0
    truncated: bool = False
    seconds: float = 0.0
    #: ids of the Python objects of tensors that old nodes still save (valid while the retained tensors live).
    saved_ids: set[int] = field(default_factory=set)


class _Dater:
    """Maps a node's sequence number to the step that built it, from the sequence number at each step's start."""

    def __init__(self, starts: list[int]) -> None:
        self.starts = starts

    def __call__(self, seq: int) -> int:
        if seq == NO_SEQUENCE or not self.starts or seq < self.starts[0]:
            return 0
        return bisect.bisect_right(self.starts, seq)


def _saved_names(node_type: type, cache: dict[type, tuple[str, ...]]) -> tuple[str, ...]:
    names = cache.get(node_type)
    if names is None:
        names = tuple(n for n in dir(node_type) if n.startswith("_saved_"))
        if not names and hasattr(node_type, "saved_tensors"):
            names = ("saved_tensors",)  # a custom autograd.Function's context
        cache[node_type] = names
    return names


def _saved_storages(node: Any, names: tuple[str, ...], skip: set[int], saved: set[int]) -> dict[tuple, int]:
    """``(device, data pointer) -> bytes`` of the tensors ``node`` still saves for backward (none once backward
    freed them), parameters (``skip``) left out; the ids of those tensors' Python objects go to ``saved``.

    A tensor a graph saves keeps its Python object for as long as the graph
    keeps the tensor (torch preserves it), so it is alive in the garbage
    collector's list with no Python holder: the scan's caller tells those
    apart from what the user retained by ``saved``.
    """
    out: dict[tuple, int] = {}
    for name in names:
        try:
            value = getattr(node, name)
        except Exception:  # noqa: BLE001 - freed by backward ("...graph a second time"), or not a tensor
            continue
        values = value if isinstance(value, (tuple, list)) else (value,)
        for t in values:
            saved.add(id(t))
            try:
                storage = t.untyped_storage()
                ptr = storage.data_ptr()
                if ptr and ptr not in skip:
                    out[(str(t.device), ptr)] = storage.nbytes()
            except Exception:  # noqa: BLE001 - not a tensor, or no storage
                continue
    return out


_TRACE_LINE = re.compile(r'\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)')


def parse_trace(entries: Any) -> Optional[Stack]:
    """The stack anomaly mode recorded for a node (``["  File ..., line N, in fn\\n    code\\n", ...]``)."""
    if not isinstance(entries, (list, tuple)):
        return None
    frames = []
    for entry in entries:
        match = _TRACE_LINE.match(str(entry).split("\n", 1)[0])
        if match:
            frames.append(Frame(match.group("file"), int(match.group("line")), match.group("fn").strip()))
    return tuple(frames) or None


def _trace_of(node: Any) -> Optional[Stack]:
    try:
        return parse_trace(node.metadata.get(TRACE_KEY))
    except Exception:  # noqa: BLE001
        return None


def live_graph_tensors() -> list[Any]:
    """Every tensor alive in this process that carries an autograd graph (a ``grad_fn``)."""
    import itertools

    import torch

    objects = gc.get_objects()
    tensor_types = {tp for tp in set(map(type, objects)) if issubclass(tp, torch.Tensor)}
    tensors = list(itertools.compress(objects, map(tensor_types.__contains__, map(type, objects))))
    del objects
    out = []
    with torch._C.DisableTorchFunctionSubclass():  # read grad_fn without running any subclass's code
        for t in tensors:
            try:
                if t.grad_fn is not None:
                    out.append(t)
            except Exception:  # noqa: BLE001
                pass
    return out


def scan(
    starts: list[int],
    at_step: int,
    skip_storages: set[int],
    traced_step: Optional[int] = None,
) -> Scan:
    """Find the tensors whose graph holds nodes of steps before ``at_step``.

    ``starts``: the sequence number at the start of each step (step ``i`` is
    ``starts[i - 1]``); ``skip_storages``: data pointers of the parameters (a
    node that saves a parameter does not hold activations); ``traced_step``: a
    step run under a creation trace, whose nodes carry their creation stack.
    """
    import torch

    begin = perf_counter()
    result = Scan(at_step)
    date = _Dater(list(starts))
    tensors = live_graph_tensors()
    result.graph_tensors = len(tensors)
    # id(node) -> saved storages of an old node (read once per node); the wrappers are kept in ``keep``
    # so that ids stay unique during the scan.
    storages_of: dict[int, dict[tuple, int]] = {}
    keep: list[Any] = []
    name_cache: dict[type, tuple[str, ...]] = {}
    visited_total = 0
    with torch._C.DisableTorchFunctionSubclass():
        for t in tensors:
            root = t.grad_fn
            if root is None:
                continue
            steps: set[int] = set()
            old: set[int] = set()
            storages: dict[tuple, int] = {}
            traces: dict[str, Stack] = {}  # node name -> creation stack, for nodes of the traced step
            stack = [root]
            seen: set[int] = set()
            while stack:
                node = stack.pop()
                ident = id(node)
                if ident in seen:
                    continue
                seen.add(ident)
                keep.append(node)
                step = date(node._sequence_nr())
                if step == 0:
                    continue  # built before the first step (or an AccumulateGrad): not a step's graph
                visited_total += 1
                if visited_total > SCAN_NODE_LIMIT:
                    result.truncated = True
                    stack.clear()
                    break
                steps.add(step)
                if step < at_step:
                    old.add(ident)
                    found = storages_of.get(ident)
                    if found is None:
                        names = _saved_names(type(node), name_cache)
                        found = storages_of[ident] = _saved_storages(node, names, skip_storages, result.saved_ids)
                    storages.update(found)
                if step == traced_step and (node is root or node.name() == root.name()):
                    trace = _trace_of(node)
                    if trace is not None:
                        traces.setdefault("root" if node is root else "same", trace)
                for child, _ in node.next_functions:
                    if child is not None:
                        stack.append(child)
            if not steps or min(steps) >= at_step:
                continue
            try:
                data = t.untyped_storage().nbytes()
            except Exception:  # noqa: BLE001
                data = 0
            # Where it was built: its own node, if built in the traced step; else, in a graph spanning steps, the
            # traced step's node of the same operation (the running sum's addition of that step).
            trace = traces.get("root", traces.get("same"))
            result.retained.append(
                Retained(t, date(root._sequence_nr()), steps, old, storages, data, root.name(), trace)
            )
            if result.truncated:
                break
    result.nodes_visited = visited_total
    result.seconds = perf_counter() - begin
    del keep, tensors
    return result


# -- who holds it -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Holder:
    """What keeps a retained tensor reachable."""

    #: ``LossList.losses``, ``local 'outputs' in test_loop``, ``LossList.history['train']``, ``a closure variable``.
    label: str
    #: The container the tensor sits in (``list``, ``dict``, ``tuple``...), or "" when held directly.
    container: str = ""
    #: Whether the anchor is the user's (not an object of torch, Lightning or torchmetrics).
    user: bool = True


_CONTAINERS = (list, tuple, set, frozenset, dict)
_FRAMEWORKS = ("torch", "pytorch_lightning", "lightning", "lightning_fabric", "torchmetrics")


def frame_locals(skip: set[int]) -> tuple[dict[int, tuple[str, str]], set[int]]:
    """``id(value) -> (variable, function)`` for the locals of the user's functions on the stack now, and the
    ids of the dicts those locals were read from (to be skipped as holders).

    Before Python 3.13 a running frame's locals can only be read as a snapshot
    dict that the frame keeps (and refreshes at the next read) until it
    returns; they are read only while a scan runs, in a run that already broke
    the invariant, and only for the user's own functions.
    """
    out: dict[int, tuple[str, str]] = {}
    borrowed: dict[
        int, tuple[str, str]
    ] = {}  # a closure's free variables: named after their owner if it is on the stack
    dicts: set[int] = set()
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if kind_of(code) == USER:
            try:
                snapshot = frame.f_locals
                dicts.add(id(snapshot))
                variables = list(snapshot.items())
                del snapshot
            except Exception:  # noqa: BLE001
                variables = []
            for name, value in variables:
                if id(value) not in skip:
                    target = borrowed if name in code.co_freevars else out
                    target.setdefault(id(value), (name, code.co_name))
            del variables
        frame = frame.f_back
    for ident, where in borrowed.items():
        out.setdefault(ident, where)
    return out, dicts


def _key_of(container: Any, child: Any) -> Optional[str]:
    if isinstance(container, dict):
        for key, value in container.items():
            if value is child:
                return key if isinstance(key, str) else repr(key)
    return None


def _owner_label(owner: Any) -> tuple[str, bool]:
    """``(name, is the user's)`` of an attribute's owner: its class name, a module's or a class's own name."""
    if isinstance(owner, ModuleType):
        name, module = owner.__name__, owner.__name__
    elif isinstance(owner, type):
        name, module = owner.__name__, owner.__module__ or ""
    else:
        name, module = type(owner).__name__, getattr(type(owner), "__module__", "") or ""
    return name, module.split(".", 1)[0] not in _FRAMEWORKS


_MODULE_DICTS = re.compile(r"\._(?:buffers|parameters|modules)\['([^']*)'\]")


def _class_dict(cls: type, d: dict, down: dict[int, list[tuple[int, Optional[str]]]], objects: dict[int, Any]) -> bool:
    """Whether ``d`` is the attribute dict of class ``cls`` (a class shows it only as a mappingproxy)."""
    links = down.get(id(d), ())
    try:
        return bool(links) and all(k is not None and vars(cls).get(k) is objects.get(c) for c, k in links)
    except Exception:  # noqa: BLE001
        return False


def find_holders(
    targets: list[Any], skip: set[int], locals_index: dict[int, tuple[str, str]], depth: int = 7
) -> dict[int, tuple[Holder, Optional[Any]]]:
    """``id(target) -> (holder, the container it sits in or None)`` for each target a holder was found for.

    A breadth-first search upwards from all targets at once, one
    :func:`gc.get_referrers` pass per level, through lists, tuples, sets and
    dicts, to the first *anchor*: the object, class or module whose attribute
    dict (or ``__slots__``) holds the chain, a closure cell, or a local of a
    running function. ``skip``: ids of the caller's own objects, never taken
    for holders.
    """
    found: dict[int, tuple[Holder, Optional[Any]]] = {}
    wanted = {id(t) for t in targets}
    objects: dict[int, Any] = {id(t): t for t in targets}
    # down[id(container)] = [(id(what it holds), key)]: how to walk back from an anchor to the targets
    down: dict[int, list[tuple[int, Optional[str]]]] = {}
    frontier: dict[int, Any] = dict(objects)
    skip = set(skip)
    skip.update(id(x) for x in (found, objects, down, targets, frontier, wanted))

    def resolve(start: int, label: str, user: bool, attributes: bool = False) -> None:
        """Name every target below ``start``; ``attributes``: ``start`` is an attribute dict (keys are names)."""
        stack: list[tuple[int, str, Any, bool]] = [(start, "", None, attributes)]
        while stack:
            node, pieces, parent, named = stack.pop()
            if node in wanted:
                if node not in found:
                    container = "" if parent is None or named else type(parent).__name__
                    text = _MODULE_DICTS.sub(r".\1", label + pieces)
                    found[node] = (Holder(text, container, user), None if named else parent)
                continue
            obj = objects.get(node)
            for child, key in down.get(node, ()):
                if named:
                    more = f".{key}"
                elif isinstance(obj, dict) and key is not None and child not in wanted:
                    more = f"[{key!r}]"
                else:
                    more = ""
                stack.append((child, pieces + more, obj, False))

    for _ in range(depth):
        for ident in list(frontier):
            local = locals_index.get(ident)
            if local is not None:
                resolve(ident, f"local '{local[0]}' in {local[1]}", True)
                del frontier[ident]
        if not frontier or len(found) == len(wanted):
            break
        held_ids = set(frontier)
        referrers = gc.get_referrers(*frontier.values())
        following: dict[int, Any] = {}
        skip.update((id(referrers), id(following), id(held_ids)))
        for ref in referrers:
            rid = id(ref)
            if rid in skip or rid in objects:
                continue
            try:
                held = [c for c in gc.get_referents(ref) if id(c) in held_ids]
            except Exception:  # noqa: BLE001
                continue
            if not held:
                continue
            if isinstance(ref, FrameType):
                if kind_of(ref.f_code) == TORCHPERF:
                    continue
                names = {id(v): n for n, v in list(ref.f_locals.items())}
                for child in held:
                    label = f"local '{names.get(id(child), '?')}' in {ref.f_code.co_name}"
                    resolve(id(child), label, kind_of(ref.f_code) == USER)
            elif type(ref).__name__ == "cell":
                for child in held:
                    resolve(id(child), "a closure variable", True)
            elif isinstance(ref, _CONTAINERS):
                objects[rid] = ref
                down[rid] = [(id(c), _key_of(ref, c)) for c in held]
                following[rid] = ref
            else:
                name, user = _owner_label(ref)
                try:
                    attributes = getattr(ref, "__dict__", None)
                except Exception:  # noqa: BLE001
                    attributes = None
                slots = getattr(type(ref), "__slots__", ())
                if isinstance(slots, str):
                    slots = (slots,)
                for child in held:
                    if attributes is not None and child is attributes:
                        resolve(id(child), name, user, attributes=True)
                        continue
                    if isinstance(ref, type) and isinstance(child, dict) and _class_dict(ref, child, down, objects):
                        resolve(id(child), name, user, attributes=True)
                        continue
                    slot = next((s for s in slots if getattr(ref, s, None) is child), None)
                    if slot is not None:
                        resolve(id(child), f"{name}.{slot}", user)
        del referrers
        frontier = following
    return found
