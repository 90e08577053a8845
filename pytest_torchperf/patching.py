"""Reversible patches: every attribute set here is put back exactly as it was.

An attribute that was inherited (not in the owner's own ``__dict__``) is
deleted on undo rather than re-set, so a patched class ends up with the very
same ``__dict__`` it started with. A dunder method set on a class also keeps
the class's CPython type slots as they were, during the patch and after it
(see :mod:`pytest_torchperf._slots`): a patched ``torch.Tensor.__getitem__``
never turns tensors into sequences.
"""

from __future__ import annotations

import functools
import importlib.abc
import sys
import types
from types import ModuleType
from typing import Any, Callable, Optional, TypeVar

from . import _slots

__all__ = ["Patcher", "SlotPatchUnsupported", "lift_all", "relay_all", "wraps"]

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
    """

    __slots__ = ("owner", "name", "base", "stack")

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        own = getattr(owner, "__dict__", None)  # ``vars(owner)``, read once
        self.base = own.get(name, _MISSING) if own is not None else _MISSING
        #: ``(token, value)``, oldest first.
        self.stack: list[tuple[object, Any]] = []

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


#: (id(owner), name) -> its layers, while patched.
_ATTRIBUTES: dict[tuple[int, str], _Layers] = {}


def _restore(layers: _Layers, token: object, key: tuple[int, str]) -> None:
    """Undo one patch: take its layer out, show what is left, and forget the attribute once none is."""
    stack = layers.stack
    if len(stack) == 1 and stack[0][0] is token:  # the one layer (the usual case)
        stack.clear()
    else:
        stack[:] = [layer for layer in stack if layer[0] is not token]
    layers.show()
    if not stack and _ATTRIBUTES.get(key) is layers:
        del _ATTRIBUTES[key]


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


class Patcher:
    """Collects undo actions; :meth:`undo` runs them newest first, once."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []
        #: Undo actions that must not run in the middle of a probe's own call (see :meth:`callback`).
        self._deferred: set[int] = set()
        self._import_hook: Optional[_PostImportHook] = None
        self._guards: dict[type, _slots.SlotGuard] = {}
        #: Classes this patcher gave an ``__init_subclass__`` hook (see :meth:`_adopt_subclasses`).
        self._adopting: set[type] = set()

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        """Set ``owner.name = value``, remembering how to put the old state back.

        Raises :class:`SlotPatchUnsupported` (and sets nothing) for a name such as
        ``__getitem__`` on a class when this interpreter's type slots cannot be kept.
        """
        guard = self._guard(owner, name) if name.endswith("__") else None
        # The attribute's layers, found or made here (about 136 patches a watch, each set and undone).
        key = (id(owner), name)
        layers = _ATTRIBUTES.get(key)
        if layers is None or layers.owner is not owner:
            layers = _ATTRIBUTES[key] = _Layers(owner, name)
        token = object()
        layers.stack.append((token, value))
        setattr(owner, name, value)
        if guard is not None:
            guard.patched(name)
            if name in _slots.TWIN_NAMES and owner not in self._adopting:
                self._adopt_subclasses(owner, guard)
        self._undo.append(functools.partial(_restore, layers, token, key))

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

        def __init_subclass__(cls: type, **kwargs: Any) -> None:
            if isinstance(own, classmethod):
                own.__get__(None, cls)(**kwargs)
            else:
                super(owner, cls).__init_subclass__(**kwargs)  # type: ignore[misc,arg-type,unused-ignore]
            try:
                guard.adopt(cls)
            except Exception:  # noqa: BLE001 - a class must always be creatable
                pass

        self.setattr(owner, "__init_subclass__", classmethod(__init_subclass__))

    def wrap(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """Replace ``owner.name`` by ``make(original)``."""
        original = getattr(owner, name)
        self.setattr(owner, name, make(original))

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
                action()
            except Exception as exc:  # keep undoing the rest, then report
                errors.append(exc)
        self._undo = kept[::-1]
        if not keep_deferred:
            self._deferred.clear()
        return errors

    def __len__(self) -> int:
        return len(self._undo)
