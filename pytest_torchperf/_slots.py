"""Keep a patched class's CPython type slots exactly as they were.

Setting a dunder method on a class updates the C-level *slots* Python uses
for syntax and protocols (``x[i]``, ``bool(x)``, ``len(x)``...), and some
names update two slots. ``__getitem__`` fills both the mapping slot
``mp_subscript`` and the sequence slot ``sq_item``. ``torch.Tensor`` has only
the first (it inherits ``mp_subscript`` from its C base), so a Python
``__getitem__`` on it makes every tensor look like a *sequence* to C code
(``PySequence_Check``): ``torch.tensor([t0, t1])`` of 0-d tensors then fails
with ``len() of a 0-d tensor``. Deleting the attribute again does not undo
it: CPython recomputes ``sq_item`` from the names it finds, sees two filled
slots and keeps the generic one. So the class would stay changed for the rest
of the process.

:class:`SlotGuard` snapshots the slot tables of a class and of its
subclasses before the first such patch, puts the sequence "twin" slots back
right after each patch (the class keeps calling the Python method for
``x[i]`` through ``mp_subscript``, and stays a non-sequence), and writes the
whole snapshot back when the patch is undone, so the class is byte for byte
what it was. Subclasses created during the patch get the twin slots their
base had.

It reads and writes ``PyTypeObject`` fields with :mod:`ctypes`, only on heap
types (classes whose slot tables live inside the type object), and only
after checking the layout it assumes against known classes
(:func:`supported`); where the check fails (another Python implementation, a
free-threaded build, a layout it does not know) it reports that and the
caller does not patch those names at all.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
import threading
import weakref
from typing import Any, Optional

__all__ = ["MP_SUBSCRIPT", "TWIN_NAMES", "SlotGuard", "SlotRoute", "live_guards", "supported", "table_bytes"]

_PTR = ctypes.sizeof(ctypes.c_void_p)
_HEAPTYPE = 1 << 9
#: Field indices (in pointers) of PyTypeObject after the PyVarObject header.
_AS_NUMBER, _AS_SEQUENCE, _AS_MAPPING = 9, 10, 11
#: Pointers in PyNumberMethods, PySequenceMethods and PyMappingMethods.
_TABLE_SIZES = {_AS_NUMBER: 36, _AS_SEQUENCE: 10, _AS_MAPPING: 3}

#: Names that fill a sequence slot besides the slot they are meant for (a mapping or number slot):
#: the index of that sequence slot. Left filled, it would make instances look like sequences to C code.
TWIN_NAMES = {
    "__getitem__": 3,  # sq_item (besides mp_subscript)
    "__setitem__": 5,  # sq_ass_item (besides mp_ass_subscript)
    "__delitem__": 5,
    "__len__": 0,  # sq_length (besides mp_length)
    "__add__": 1,  # sq_concat (besides nb_add)
    "__mul__": 2,  # sq_repeat (besides nb_multiply)
    "__rmul__": 2,
    "__iadd__": 8,  # sq_inplace_concat
    "__imul__": 9,  # sq_inplace_repeat
}

_supported: Optional[str] = None  # "" when supported, else why not


#: Bytes before ``tp_name``: the PyVarObject header (refcount, type, size).
_HEADER = object.__basicsize__ + ctypes.sizeof(ctypes.c_ssize_t)


def _header() -> int:
    return _HEADER


def _field(tp: type, index: int) -> ctypes.c_void_p:
    return ctypes.c_void_p.from_address(id(tp) + _HEADER + index * _PTR)


def _table(tp: type, which: int) -> Optional[int]:
    return _field(tp, which).value


def _slot(tp: type, which: int, index: int) -> ctypes.c_void_p:
    base = _table(tp, which)
    assert base is not None
    return ctypes.c_void_p.from_address(base + index * _PTR)


def _inside(tp: type, address: Optional[int]) -> bool:
    return address is not None and id(tp) < address < id(tp) + type.__sizeof__(tp)


def supported() -> str:
    """``""`` when this interpreter's type layout is the one this module writes, else the reason it is not."""
    global _supported
    if _supported is None:
        _supported = _check_layout()
    return _supported


def _check_layout() -> str:
    if sys.implementation.name != "cpython":
        return f"not CPython ({sys.implementation.name})"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        return "a free-threaded CPython build"
    try:
        size = ctypes.c_ssize_t.from_address(id(int) + _header() + _PTR).value
        if size != int.__basicsize__:
            return "an unknown PyTypeObject layout"

        class Plain:
            pass

        class Indexed:
            def __getitem__(self, i: Any) -> Any:
                return i

        for tp in (Plain, Indexed):
            if not (tp.__flags__ & _HEAPTYPE) or not _inside(tp, _table(tp, _AS_SEQUENCE)):
                return "an unknown heap type layout"
            if not _inside(tp, _table(tp, _AS_MAPPING)) or not _inside(tp, _table(tp, _AS_NUMBER)):
                return "an unknown heap type layout"
        if _slot(Plain, _AS_SEQUENCE, 3).value or _slot(Plain, _AS_MAPPING, 1).value:
            return "an unknown slot layout"
        if not (_slot(Indexed, _AS_SEQUENCE, 3).value and _slot(Indexed, _AS_MAPPING, 1).value):
            return "an unknown slot layout"
    except Exception as exc:  # noqa: BLE001 - any surprise means: do not write
        return f"the layout check failed ({type(exc).__name__}: {exc})"
    return ""


def _subclasses(tp: type) -> list[type]:
    out: list[type] = []
    seen: set[int] = set()
    todo: list[type] = list(type.__subclasses__(tp))
    while todo:
        sub = todo.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        out.append(sub)
        todo.extend(type.__subclasses__(sub))
    return out


#: id(class) -> (a weak reference to it, ``{table: address}`` of its number, sequence and mapping tables). A
#: heap type's tables are parts of the type object itself, so their addresses are fixed for the class's life:
#: read once (reading a field through ctypes costs about a microsecond, and a guard of ``torch.Tensor`` reads
#: its 20-odd subclasses). Keyed by id with the reference checked, not a ``WeakKeyDictionary`` (whose ``get``
#: is a Python call making a reference: a watch asks a few hundred times).
_ADDRESSES: dict[int, tuple[Any, dict[int, int]]] = {}


def _addresses(cls: type) -> dict[int, int]:
    entry = _ADDRESSES.get(id(cls))
    if entry is not None and entry[0]() is cls:
        return entry[1]
    found = {}
    for which in _TABLE_SIZES:
        address = _table(cls, which)
        if address:
            found[which] = address
    if len(_ADDRESSES) > 4096:  # classes that died leave dead entries: bounded
        _ADDRESSES.clear()
    _ADDRESSES[id(cls)] = (weakref.ref(cls), found)
    return found


def table_bytes(tp: type) -> bytes:
    """The number, sequence and mapping slot tables of a heap type, as bytes (for tests and checks)."""
    out = b""
    for which, size in _TABLE_SIZES.items():
        base = _table(tp, which)
        out += ctypes.string_at(base, size * _PTR) if base else b""
    return out


#: The guard of each class some patcher has patched a dunder on (shared: one snapshot per class).
_GUARDS: dict[type, SlotGuard] = {}
#: Guards released since, by class (weakly): one whose snapshot is still true serves the next patch.
_RELEASED: weakref.WeakKeyDictionary[type, SlotGuard] = weakref.WeakKeyDictionary()


def live_guards() -> list[SlotGuard]:
    """The guards of the classes patched now."""
    return list(_GUARDS.values())


class SlotGuard:
    """The slot tables of one class and its subclasses, taken before the first dunder is patched on it.

    One guard per class, shared by every patcher that patches it (:meth:`acquire`
    / :meth:`release`): the snapshot is taken before the first patch and written
    back after the last patcher's attributes are put back.
    """

    @classmethod
    def acquire(cls, tp: type) -> SlotGuard:
        guard = _GUARDS.get(tp)
        if guard is None:
            guard = _RELEASED.pop(tp, None)
            if guard is None or not guard._still_true():
                guard = cls(tp)
            _GUARDS[tp] = guard
        guard.users += 1
        return guard

    def release(self) -> None:
        """A patcher put its attributes of the class back: the last one restores everything."""
        self.users -= 1
        if self.users > 0:
            self.fix_twins()  # another patcher still patches the class: no sequence slot meanwhile
            return
        _GUARDS.pop(self.tp, None)
        self.restore()
        self.names.clear()
        _RELEASED[self.tp] = self  # its snapshot, checked again before it serves the next patch

    def _still_true(self) -> bool:
        """Whether the snapshot is still the class's tables byte for byte, for the same subclasses (a
        released guard's snapshot serves the next watch then: a watch patches the same classes every time)."""
        classes = [cls for cls in [self.tp] + _subclasses(self.tp) if cls.__flags__ & _HEAPTYPE]
        if len(classes) != len(self._saved):
            return False
        for cls in classes:
            saved = self._saved.get(cls)
            addresses = _addresses(cls)
            if saved is None or addresses.keys() != saved.keys():
                return False
            for which, (address, data) in saved.items():
                if addresses[which] != address or ctypes.string_at(address, len(data)) != data:
                    return False
        return True

    def __init__(self, tp: type) -> None:
        if supported():
            raise RuntimeError(f"type slots cannot be kept on {supported()}")
        if not (tp.__flags__ & _HEAPTYPE):
            raise RuntimeError(f"{tp.__qualname__} is not a heap type")
        self.tp = tp
        self.users = 0
        self.names: list[str] = []
        #: class -> {table: (its address, its bytes)}.
        self._saved: dict[type, dict[int, tuple[int, bytes]]] = {}
        for cls in [tp] + _subclasses(tp):
            if cls.__flags__ & _HEAPTYPE:
                self._saved[cls] = _tables(cls)

    def patched(self, name: str) -> None:
        """Right after ``setattr(tp, name, ...)``: put the sequence twin back (it stays a non-sequence)."""
        if name not in self.names:
            self.names.append(name)
        if name in TWIN_NAMES:
            self.fix_twins((name,))

    def fix_twins(self, names: Any = None) -> None:
        """The sequence slots of ``names`` (default: every twin name) back to the snapshot's values."""
        names = tuple(TWIN_NAMES) if names is None else names
        for cls in [self.tp] + _subclasses(self.tp):
            if not cls.__flags__ & _HEAPTYPE:
                continue
            found = self._saved.get(cls)
            own = found is not None
            saved = found if found is not None else self._saved[self.tp]
            sequence = _addresses(cls).get(_AS_SEQUENCE)
            if not sequence:
                continue
            # The table read once, the twin slots set in the copy, written back once if any differs.
            want = saved[_AS_SEQUENCE][1]
            now = ctypes.string_at(sequence, len(want))
            table = bytearray(now)
            for name in names:
                if not own and _overrides(cls, self.tp, name):
                    continue  # created while patched and defines the name itself: its own slot
                at = TWIN_NAMES[name] * _PTR
                table[at:at + _PTR] = want[at:at + _PTR]
            if table != now:
                ctypes.memmove(sequence, bytes(table), len(table))

    def adopt(self, cls: type) -> None:
        """``cls`` was just created as a subclass while patched: the twin slots its base had."""
        if not cls.__flags__ & _HEAPTYPE:
            return
        base = self._saved[self.tp][_AS_SEQUENCE][1]
        sequence = _table(cls, _AS_SEQUENCE)
        for name in self.names:
            index = TWIN_NAMES.get(name)
            if index is not None and not _overrides(cls, self.tp, name):
                _copy_pointer(sequence, base, index)

    def restore(self) -> None:
        """After the attribute is put back: every slot table as it was before the first patch."""
        for cls in [self.tp] + _subclasses(self.tp):
            if not cls.__flags__ & _HEAPTYPE:
                continue
            saved = self._saved.get(cls)
            if saved is not None:
                addresses = _addresses(cls)
                for which, (address, data) in saved.items():
                    if addresses.get(which) == address and ctypes.string_at(address, len(data)) != data:
                        ctypes.memmove(address, data, len(data))
            else:  # created while patched: the twin slots its base had, unless it defines the name itself
                self.adopt(cls)


def _tables(cls: type) -> dict[int, tuple[int, bytes]]:
    """``{table: (address, bytes)}`` of a heap type's number, sequence and mapping tables."""
    return {
        which: (address, ctypes.string_at(address, _TABLE_SIZES[which] * _PTR))
        for which, address in _addresses(cls).items()
    }


def _copy_pointer(table: Optional[int], saved: bytes, index: int) -> None:
    """Slot ``index`` of the table at ``table`` set to its value in ``saved`` (that table's bytes)."""
    if table:
        ctypes.memmove(table + index * _PTR, saved[index * _PTR:(index + 1) * _PTR], _PTR)


def _overrides(cls: type, base: type, name: str) -> bool:
    """Whether a class between ``cls`` and ``base`` (``cls`` included) defines ``name`` itself."""
    for klass in cls.__mro__:
        if klass is base:
            return False
        if name in vars(klass):
            return True
    return False


#: Index of ``mp_subscript`` in PyMappingMethods.
MP_SUBSCRIPT = 1


class SlotRoute:
    """One mapping slot of a patched class pointed, for a while, at the C function it had before the patch.

    ``tensor[i]`` on a class whose ``__getitem__`` is patched in Python goes through CPython's generic slot,
    which looks the method up and calls it: about 1.4 thousand instructions before the method does anything.
    Where the patch has nothing to see (a DataLoader fetching samples outside the training steps: 64
    indexings a batch of 32 from a ``TensorDataset``), :meth:`unpatched` points the slot straight at the C
    function again and :meth:`patched` points it back. The attribute stays patched all along, so
    ``t.__getitem__(i)`` and code CPython has specialised for the patched class still call the patch, and
    the class's type version does not change. Each switch writes one pointer. Counted (:meth:`unpatched`
    may be entered by several threads): the slot goes back when the last one leaves, and never after
    :meth:`close` (the patch is undone; the guard puts the whole table back).
    """

    def __init__(self, tp: type, index: int) -> None:
        guard = _GUARDS.get(tp)
        mapping = _addresses(tp).get(_AS_MAPPING)
        if guard is None or not mapping or tp not in guard._saved:
            raise RuntimeError(f"{tp.__qualname__} has no slot guard: patch its dunder first")
        saved = guard._saved[tp][_AS_MAPPING][1]
        self._slot = ctypes.c_void_p.from_address(mapping + index * _PTR)
        self._original = int.from_bytes(saved[index * _PTR:(index + 1) * _PTR], sys.byteorder)
        self._patch = self._slot.value or 0
        #: False once the patch is undone: nothing is written any more.
        self.live = bool(self._original) and self._patch != self._original
        self.users = 0
        self._lock = threading.Lock()

    def on_scope(self, in_scope: bool) -> None:
        """A scope listener (``FLAGS.listeners``) while a fetch runs: a step beginning meanwhile (in another
        thread) points the slot back at the patch at once."""
        if in_scope:
            self.patched(leaving=False)

    def unpatched(self) -> None:
        with self._lock:
            self.users += 1
            if self.users == 1 and self.live:
                self._slot.value = self._original

    def patched(self, leaving: bool = True) -> None:
        """The patch's slot again. ``leaving``: a user of :meth:`unpatched` leaves (the slot goes back when
        the last one does); else it goes back now, and stays so until the users have all left."""
        with self._lock:
            if leaving:
                self.users -= 1
            if self.live and (not leaving or self.users == 0):
                self._slot.value = self._patch

    def close(self) -> None:
        with self._lock:
            if self.live:
                self._slot.value = self._patch
            self.live = False
