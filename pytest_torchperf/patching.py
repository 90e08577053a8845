"""Reversible patches: every attribute set here is put back exactly as it was.

An attribute that was inherited (not in the owner's own ``__dict__``) is
deleted on undo rather than re-set, so a patched class ends up with the very
same ``__dict__`` it started with. A dunder method set on a class also keeps
the class's CPython type slots as they were, during the patch and after it
(see :mod:`pytest_torchperf._slots`): a patched ``torch.Tensor.__getitem__``
never turns tensors into sequences.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import sys
import types
import weakref
from collections.abc import Hashable, Iterator
from types import ModuleType
from typing import Any, Callable, Optional, TypeVar

from . import _guard, _slots

__all__ = ["Patch", "Patcher", "SlotPatchUnsupported", "lift_all", "relay_all", "wraps"]

#: Callables implemented in C, whose ``__name__``, ``__doc__``... are read-only and which have no ``__dict__``:
#: what :func:`wraps` copies from one of them is read once per process.
_READ_ONLY = frozenset((
    types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
))
_F = TypeVar("_F", bound=Callable[..., Any])

#: id(original) -> (original, the ``functools.WRAPPER_ASSIGNMENTS`` it has, as (name, value) pairs).
_ASSIGNMENTS: dict[int, tuple[Any, tuple[tuple[str, Any], ...]]] = {}


def wraps(original: Any) -> Callable[[_F], _F]:
    """``functools.wraps(original)``, the same attributes copied, in a fraction of the time for torch's C
    functions and methods.

    ``functools.update_wrapper`` looks every name up again and raises and catches an ``AttributeError`` for
    each one a builtin lacks (``__annotations__``, ``__dict__``): 3 to 5 microseconds a wrapper, and every
    watch makes over a hundred. A C callable's attributes cannot change, so they are read once. Only
    functions of modules and classes are kept (a builtin bound to some other object would keep it alive).
    """

    original = _guard.original_of(original)  # a probe's wrapper shows torch's function, not the tracked one

    def decorate(wrapper: _F) -> _F:
        bound = getattr(original, "__self__", None)
        if type(original) not in _READ_ONLY or not (bound is None or isinstance(bound, (ModuleType, type))):
            return functools.update_wrapper(wrapper, original)  # type: ignore[return-value]
        entry = _ASSIGNMENTS.get(id(original))
        if entry is None or entry[0] is not original:
            pairs = tuple(
                (name, getattr(original, name)) for name in functools.WRAPPER_ASSIGNMENTS if hasattr(original, name)
            )
            entry = _ASSIGNMENTS[id(original)] = (original, pairs)
        for name, value in entry[1]:
            setattr(wrapper, name, value)
        wrapper.__wrapped__ = original  # type: ignore[attr-defined]  # (no ``__dict__`` to copy: C callables have none)
        return wrapper

    return decorate


class SlotPatchUnsupported(RuntimeError):
    """This interpreter does not let a twin-slot dunder (``__getitem__``...) be patched without side effects."""

_MISSING = object()


class _Layers:
    """Every patch of one attribute, by every patcher, over the value it had before the first.

    Patchers are undone in any order (a probe taken out mid-run, probes
    installed lazily), so an attribute is never put back to "the value before
    my patch": it is set to the top remaining layer, or, when none is left,
    to what it was before any (deleted if it was inherited).

    A patch is its layer, ``(layers, value)``: the patcher's undo list holds that
    very tuple, and :func:`_restore` takes it out by identity. Once no layer is
    left, the object is kept (without its owner and base) for the next patch of the
    same attribute (:data:`_SPARE`): a watch sets and undoes the same hundred-odd
    attributes every time, and each new bookkeeping object is one more for the
    garbage collector's count.
    """

    __slots__ = ("owner", "name", "base", "stack", "key")

    def __init__(self, owner: Any, name: str, key: tuple[int, str]) -> None:
        self.name = name
        self.key = key
        #: ``(self, value)``, oldest first.
        self.stack: list[tuple[_Layers, Any]] = []
        self.owner: Any = None
        self.base: Any = _MISSING
        self.own(owner)

    def own(self, owner: Any) -> None:
        """Hold the attribute of ``owner`` as it is now, below any layer."""
        self.owner = owner
        own = getattr(owner, "__dict__", None)  # ``vars(owner)``, read once
        self.base = own.get(self.name, _MISSING) if own is not None else _MISSING

    def show(self) -> None:
        """Set the attribute to the top layer, or to its own value when there is none."""
        owner, name = self.owner, self.name
        if self.stack:
            setattr(owner, name, self.stack[-1][1])
        elif self.base is _MISSING:
            own = getattr(owner, "__dict__", None)
            if own is not None and name in own:
                delattr(owner, name)
        else:
            setattr(owner, name, self.base)

    def hide(self) -> None:
        """Set the attribute to its own value for a moment (see :func:`lifted`)."""
        top, self.stack = self.stack, []
        try:
            self.show()
        finally:
            self.stack = top


#: One patch: its layer, ``(the attribute's layers, the value set)``, as :meth:`Patcher.setattr` returns it.
Patch = tuple[_Layers, Any]

#: Wrappers built inside :meth:`Patcher.reusing`: (scope, id(owner), name) -> (owner, what it wrapped, wrapper).
_KEPT: dict[tuple[Hashable, int, str], tuple[Any, Any, Any]] = {}

#: (id(owner), name) -> its layers, while patched.
_ATTRIBUTES: dict[tuple[int, str], _Layers] = {}

#: (id(owner), name) -> (a weak reference to the owner, its layers, empty): kept for the next patch of the
#: attribute. Bounded: cleared when it outgrows :data:`_SPARE_MAX` (owners that died leave dead entries).
_SPARE: dict[tuple[int, str], tuple[Any, _Layers]] = {}
_SPARE_MAX = 4096


def _layers(owner: Any, name: str) -> _Layers:
    """The layers of ``owner.name``: the live ones, a spare one, or new ones."""
    key = (id(owner), name)
    layers = _ATTRIBUTES.get(key)
    if layers is not None and layers.owner is owner:
        return layers
    spare = _SPARE.pop(key, None)
    if spare is not None and spare[0]() is owner:
        layers = spare[1]
        layers.own(owner)
    else:
        layers = _Layers(owner, name, key)
    _ATTRIBUTES[layers.key] = layers  # a spare's own key: the one just made is dropped at once
    return layers


def _restore(entry: tuple[_Layers, Any]) -> None:
    """Undo one patch: take its layer out, show what is left, and forget the attribute once none is."""
    layers = entry[0]
    stack = layers.stack
    if stack and stack[-1] is entry:  # the newest layer (the usual case: undone newest first)
        stack.pop()
    else:
        stack[:] = [layer for layer in stack if layer is not entry]
    layers.show()
    if stack:
        return
    key = layers.key
    if _ATTRIBUTES.get(key) is layers:
        del _ATTRIBUTES[key]
    owner, layers.owner, layers.base = layers.owner, None, _MISSING
    try:
        ref = weakref.ref(owner)
    except TypeError:  # an owner without weak references: nothing kept
        return
    if len(_SPARE) >= _SPARE_MAX:
        _SPARE.clear()
    _SPARE[key] = (ref, layers)


def lift_all() -> None:
    """Every patched attribute (of every patcher) as it was unpatched, until :func:`relay_all`."""
    for layers in list(_ATTRIBUTES.values()):
        layers.hide()
    for guard in list(_slots.live_guards()):
        guard.restore()


def relay_all() -> None:
    """Every patched attribute set again to its top layer."""
    for layers in list(_ATTRIBUTES.values()):
        layers.show()
    for guard in list(_slots.live_guards()):
        guard.fix_twins()


class _PostImportHook(importlib.abc.MetaPathFinder):
    """Runs callbacks right after a module is executed, the first time it is imported."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Callable[[ModuleType], None]]] = {}
        #: Names this hook is looking up now: another patcher's hook waiting for the same module asks the
        #: finders again, this one among them, which then steps aside (each hook wraps the loader once).
        self._finding: set[str] = set()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname not in self.pending or fullname in self._finding:
            return None
        self._finding.add(fullname)
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            self._finding.discard(fullname)
        loader: Any = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        callbacks = self.pending.pop(fullname)
        hook = self

        class _Loader(importlib.abc.Loader):
            def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
                return getattr(loader, name)

            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: ModuleType) -> None:
                loader.exec_module(module)
                if hook in sys.meta_path:  # the patcher is still live
                    for callback in callbacks:
                        callback(module)

        spec.loader = _Loader()
        return spec


def _transparent(owner: Any, original: Any) -> bool:
    """Whether a wrapper of ``owner.<name>`` (now ``original``) is held by a :class:`._transparent.Transparent`:
    a function set on a module."""
    return isinstance(owner, ModuleType) and not isinstance(original, type)


class Patcher:
    """Collects undo actions; :meth:`undo` runs them newest first, once."""

    def __init__(self, contain: Optional[Callable[[BaseException], None]] = None) -> None:
        #: The engine's guard of a probe's patcher: every wrapper :meth:`wrap` sets is built around a tracked
        #: original and contained, its own errors handed to this (the probe's failure) and the user's call
        #: finished (:mod:`._guard`).
        self.contain = contain
        #: Callables, and the layers of patches (``(layers, value)`` tuples, see :class:`_Layers`).
        self._undo: list[Any] = []
        #: Undo actions that must not run in the middle of a probe's own call (see :meth:`callback`).
        self._deferred: set[int] = set()
        self._import_hook: Optional[_PostImportHook] = None
        self._guards: dict[type, _slots.SlotGuard] = {}
        #: Classes this patcher gave an ``__init_subclass__`` hook (see :meth:`_adopt_subclasses`).
        self._adopting: set[type] = set()
        #: The scope of the :meth:`reusing` block open now.
        self._reuse: Optional[Hashable] = None

    def setattr(self, owner: Any, name: str, value: Any) -> Patch:
        """Set ``owner.name = value``, remembering how to put the old state back; returns the patch (for
        :meth:`take_back`).

        Raises :class:`SlotPatchUnsupported` (and sets nothing) for a name such as
        ``__getitem__`` on a class when this interpreter's type slots cannot be kept.
        """
        guard = self._guard(owner, name) if name.endswith("__") else None
        # The attribute's layers (about 136 patches a watch, each set and undone); the new layer is the undo.
        layers = _layers(owner, name)
        entry = (layers, value)
        layers.stack.append(entry)
        setattr(owner, name, value)
        if guard is not None:
            guard.patched(name)
            if name in _slots.TWIN_NAMES and owner not in self._adopting:
                self._adopt_subclasses(owner, guard)
        self._undo.append(entry)
        return entry

    def take_back(self, patch: Patch) -> bool:
        """Undo one patch of this patcher's now, when nothing was put over it since (no later layer, the
        attribute still holds it); returns whether it was undone. Its place is free: a later patch of the
        same attribute goes on top of whatever is there then."""
        layers, value = patch
        stack = layers.stack
        if not stack or stack[-1] is not patch or getattr(layers.owner, layers.name, _MISSING) is not value:
            return False
        for i in range(len(self._undo) - 1, -1, -1):
            if self._undo[i] is patch:
                del self._undo[i]
                _restore(patch)
                return True
        return False

    def _guard(self, owner: Any, name: str) -> Optional[_slots.SlotGuard]:
        """The slot guard of class ``owner`` when ``name`` is a dunder (created before its first patch)."""
        if not (isinstance(owner, type) and name.startswith("__") and name.endswith("__")):
            return None
        guard = self._guards.get(owner)
        if guard is not None:
            return guard
        why = _slots.supported()
        if why or not owner.__flags__ & (1 << 9):  # not a heap type: CPython leaves its slots alone
            if name in _slots.TWIN_NAMES:
                raise SlotPatchUnsupported(
                    f"cannot patch {owner.__qualname__}.{name} without changing how its instances behave "
                    f"on {why or 'a static type'}"
                )
            return None
        guard = self._guards[owner] = _slots.SlotGuard.acquire(owner)
        self._undo.append(guard.release)  # runs after this patcher's patches of the class are undone

        def forget() -> None:
            self._guards.pop(owner, None)
            self._adopting.discard(owner)

        self._undo.append(forget)
        return guard

    def _adopt_subclasses(self, owner: type, guard: _slots.SlotGuard) -> None:
        """Give a subclass of ``owner`` created while it is patched the slots it would have had."""
        self._adopting.add(owner)
        own = vars(owner).get("__init_subclass__")

        def __init_subclass__(cls: type, /, **kwargs: Any) -> None:
            if isinstance(own, classmethod):
                own.__get__(None, cls)(**kwargs)
            else:
                super(owner, cls).__init_subclass__(**kwargs)  # type: ignore[misc,arg-type,unused-ignore]
            try:
                guard.adopt(cls)
            except Exception:  # noqa: BLE001 - a class must always be creatable
                pass

        self.setattr(owner, "__init_subclass__", classmethod(__init_subclass__))

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> Patch:
        """Replace ``owner.name`` by ``make(original)`` (inside :meth:`reusing`: the wrapper kept from the last
        time, when ``owner.name`` is still the very object it wrapped).

        A module's function is replaced by a :class:`~pytest_torchperf._transparent.Transparent` holding the
        wrapper: it compares equal to the function and hashes alike (``op == torch.lt`` keeps its answer).
        """
        original = getattr(owner, name)
        scope = self._reuse
        if scope is None:
            return self.setattr(owner, name, self._made(make, original, _transparent(owner, original)))
        key = (scope, id(owner), name)
        kept = _KEPT.get(key)
        if kept is not None and kept[0] is owner and kept[1] is original:
            wrapper = kept[2]
        else:
            wrapper = self._made(make, original, _transparent(owner, original))
            _KEPT[key] = (owner, original, wrapper)
        return self.setattr(owner, name, wrapper)

    def _made(self, make: Callable[[Any], Any], original: Any, transparent: bool = False) -> Any:
        """``make(original)``; for a probe's patcher, built around the tracked original and contained
        (:func:`._guard.contain`); where ``transparent``, held so that it compares equal to and hashes like
        ``original`` (:class:`._transparent.Transparent`: a function set on a module)."""
        if self.contain is None or not callable(original):
            wrapper = make(original)
        else:
            wrapper = _guard.contain(make, original, self.contain)
        if transparent and callable(wrapper):
            from ._transparent import Transparent

            wrapper = Transparent(wrapper, original)
        return wrapper

    @contextlib.contextmanager
    def reusing(self, scope: Hashable) -> Iterator[None]:
        """Inside, :meth:`wrap` keeps each wrapper it builds for the next watch, and reuses the one kept when
        the attribute still holds the object it wrapped, under the same ``scope``.

        ``scope`` is everything a wrapper's behaviour depends on besides what it wraps and the state it reads
        when called: the probe that builds it and the values its install read once (is there an
        accelerator?). A probe's wrappers are closures over the probe and its install's locals, so building
        them anew at every watch (a function, its cells and its ``__dict__`` a wrapper, over a hundred a
        watch) is what most of a watch's objects were; kept, they live in the old generation once, instead
        of every watch's adding to the count that triggers a full garbage collection.
        """
        previous, self._reuse = self._reuse, scope
        try:
            yield
        finally:
            self._reuse = previous

    @property
    def reuse_scope(self) -> Optional[Hashable]:
        """The scope of the :meth:`reusing` block the patcher is in (None outside one): for patches made later,
        from a callback, under the same scope."""
        return self._reuse

    def callback(self, fn: Callable[[], None], *, deferred: bool = False) -> None:
        """Run ``fn`` on undo (for state that is not an attribute).

        ``deferred``: ``fn`` removes a hook from a registry torch may be iterating
        right now, or resets state a call in flight still uses; an early
        ``undo(keep_deferred=True)`` (a probe taken out mid-run) leaves it for the
        final :meth:`undo`.
        """
        self._undo.append(fn)
        if deferred:
            self._deferred.add(id(fn))

    def on_import(self, module_name: str, callback: Callable[[ModuleType], None]) -> None:
        """Call ``callback(module)`` now if ``module_name`` is imported, else right after its first import.

        The wait ends on undo: a module first imported afterwards is left alone.
        Patches the callback makes through this patcher are undone with it.
        """
        module = sys.modules.get(module_name)
        if module is not None:
            callback(module)
            return
        if self._import_hook is None:
            hook = self._import_hook = _PostImportHook()
            sys.meta_path.insert(0, hook)

            def remove() -> None:
                hook.pending.clear()
                if hook in sys.meta_path:
                    sys.meta_path.remove(hook)
                self._import_hook = None

            self._undo.append(remove)
        self._import_hook.pending.setdefault(module_name, []).append(callback)

    def undo(self, keep_deferred: bool = False) -> list[BaseException]:
        """Undo everything, newest first; returns the errors of actions that failed (the rest still ran).

        ``keep_deferred``: put every attribute back now, but keep the deferred
        callbacks for a later ``undo()``.
        """
        errors: list[BaseException] = []
        kept: list[Callable[[], None]] = []
        while self._undo:
            action = self._undo.pop()
            if keep_deferred and id(action) in self._deferred:
                kept.append(action)
                continue
            try:
                if type(action) is tuple:  # a patch's layer (:meth:`setattr`)
                    _restore(action)
                else:
                    action()
            except Exception as exc:  # keep undoing the rest, then report
                errors.append(exc)
        self._undo = kept[::-1]
        if not keep_deferred:
            self._deferred.clear()
        return errors

    def __len__(self) -> int:
        return len(self._undo)
