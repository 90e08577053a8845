"""The invariant registry: every invariant declared once, built-in and third-party alike.

An invariant is one :class:`Invariant` object in its own module: its name,
the value that turns it on (``True``, or a number such as ``max_overhead=0.1``),
the settings that tune it (:class:`~pytest_torchperf.arguments.Argument`), the
probes it needs and the class of its per-run check. That one declaration
drives the validation of ``@pytest.mark.torchperf(...)`` / ``watch(...)``
arguments and their error messages, the marker's signature in
``pytest --markers``, the README's argument tables, the JSON schema of the
options, which probes a run installs and which checks it builds.

Built-in invariants live in :mod:`pytest_torchperf.invariants`, one module
each. Other packages add theirs through the entry-point group
``pytest_torchperf.invariants``::

    [project.entry-points."pytest_torchperf.invariants"]
    no_host_to_device_in_forward = "acme_torchperf.forward:INVARIANT"

(an entry point may also name a module with an ``INVARIANT`` attribute, or a
list of invariants), or at run time with :func:`register`. Modules are found
by name, so this module imports none of them, and nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from . import figures as _figures
from .arguments import Argument, ArgumentKind, Choice, Flag, UsageError, suggest
from .declarations import QUALIFIER, validate_declaration, verify_handlers

__all__ = [
    "ENTRY_POINT_GROUP",
    "Invariant",
    "SCOPES",
    "SCOPE",
    "all_arguments",
    "get",
    "invariants",
    "make_checks",
    "markdown_table",
    "options_schema",
    "probes_for",
    "register",
    "spelling",
    "unregister",
]

from .constants import BUILTIN_INVARIANTS, INVARIANTS_ENTRY_POINT_GROUP, SCOPES  # noqa: E402

#: The entry point group other packages declare invariants in.
ENTRY_POINT_GROUP = INVARIANTS_ENTRY_POINT_GROUP

#: The argument every run has: where the step checks apply.
SCOPE = Argument(
    "scope",
    Choice(SCOPES),
    "training_step",
    "where the step checks apply: 'training_step', 'batch' (from batch start to batch end: step, backward, "
    "optimizer, callbacks) or 'test' (the whole body)",
)

#: The built-in invariants, in the order reports list them (module names in ``pytest_torchperf.invariants``).
BUILTIN = BUILTIN_INVARIANTS

#: Names an argument may not take: they are attributes of ``Options`` itself.
_RESERVED = frozenset(("enabled_checks", "to_dict", "replace", "values", "settings"))


@dataclass(frozen=True)
class Invariant:
    """One invariant: what turns it on, what tunes it, what it needs to see, and its check.

    - ``name``: the marker argument that turns it on (``no_host_sync``).
    - ``doc``: one line, shown in the README table and ``pytest --markers``.
    - ``check``: called as ``check(run)`` for every run that checks it; returns an object
      with ``result() -> CheckResult`` and event methods (see :class:`pytest_torchperf.extend.Check`).
    - ``kind`` / ``default``: its own value. A :class:`~pytest_torchperf.arguments.Flag`
      invariant is on when ``True``; any other kind is on when not ``None``.
    - ``arguments``: settings that tune it (``allowed_syncs``...), each validated likewise.
    - ``probes``: the probes its check listens to, by built-in name (``"syncs"``) or as
      :class:`~pytest_torchperf.probes.Probe` subclasses (the engine makes and owns their instances; its
      check gets them with ``run.probe(name)``); installed while a run checks it. A plug-in's
      ``Probe`` instance is still accepted (the older API): every engine then shares that one object.
    """

    name: str
    doc: str
    check: Callable[[Any], Any]
    kind: ArgumentKind = field(default_factory=Flag)
    default: Any = False
    arguments: tuple[Argument, ...] = ()
    probes: tuple[Any, ...] = ()
    #: Quoted in the error message of a wrong value (``"the fewest DataLoader workers"``).
    meaning: str = ""
    #: A frozen dataclass whose fields are the ``arguments`` (their values as ``Check.settings``);
    #: None: one is made from the declarations.
    settings: Optional[type] = None
    #: Checks only what a run may or may not contain (``no_graph_breaks``: compiled code): its "not checked"
    #: means there was nothing of that kind, so it is no warning of ``--torchperf-not-checked``.
    conditional: bool = False
    #: The figures its verdict carries: a ``TypedDict`` class (see :mod:`pytest_torchperf.figures`);
    #: None: undeclared (a plug-in's may be).
    figures: Optional[type] = None

    @property
    def argument(self) -> Argument:
        """The invariant's own argument (its name, kind and default)."""
        return Argument(self.name, self.kind, self.default, self.doc, self.meaning)

    def enabled(self, value: Any) -> bool:
        if isinstance(self.kind, Flag):
            return value is True
        return value is not None


class _Registry:
    """The invariants and the tables built from them, each built once per registry state.

    The state changes only through :meth:`register` and :meth:`unregister`, which drop the tables: the next
    read builds them again (a plug-in registered after the first watched test is known from then on).
    """

    def __init__(self) -> None:
        self._invariants: Optional[dict[str, Invariant]] = None
        self._extra: dict[str, Invariant] = {}
        #: The built-in and entry-point invariants, then the registered ones (validated once, when registered).
        self._all: Optional[dict[str, Invariant]] = None
        self._arguments: Optional[dict[str, tuple[Argument, Optional[Invariant]]]] = None
        self._spellings: dict[str, str] = {}
        self._ambiguous: dict[str, list[str]] = {}

    def table(self) -> dict[str, Invariant]:
        """Every invariant by name: the registry's own table (read it, never change it)."""
        if self._all is None:
            if self._invariants is None:
                found: dict[str, Invariant] = {}
                for name in BUILTIN:
                    module = importlib.import_module(f"pytest_torchperf.invariants.{name}")
                    # This package's own declarations are held valid by its tests (``_validate`` of each, as a
                    # plug-in's is validated here): not validated again in every process that watches a test.
                    _add(found, module.INVARIANT, f"pytest_torchperf.invariants.{name}", validate=False)
                for source, invariant in _from_entry_points():
                    _add(found, invariant, source)
                self._invariants = found
            merged = dict(self._invariants)
            for invariant in self._extra.values():
                _add(merged, invariant, "register()")
            self._all = merged
        return self._all

    def invariants(self) -> dict[str, Invariant]:
        return dict(self.table())

    def arguments(self) -> dict[str, tuple[Argument, Optional[Invariant]]]:
        """Every argument, in the marker's order: the invariants, ``scope``, then their settings.

        A setting's key is its plain name when it owns it (the only declarer, or the one built-in
        declarer among plug-ins), else ``<invariant>__<setting>`` (see :func:`spelling`).
        """
        if self._arguments is None:
            invariants = self.table()
            args: dict[str, tuple[Argument, Optional[Invariant]]] = {}
            for inv in invariants.values():
                args[inv.name] = (inv.argument, inv)
            args[SCOPE.name] = (SCOPE, None)
            declared: dict[str, list[Invariant]] = {}
            for inv in invariants.values():
                for arg in inv.arguments:
                    declared.setdefault(arg.name, []).append(inv)
            spellings: dict[str, str] = {}
            ambiguous: dict[str, list[str]] = {}
            for inv in invariants.values():
                builtin = inv.name in BUILTIN
                for arg in inv.arguments:
                    qualified = f"{inv.name}{QUALIFIER}{arg.name}"
                    owners = declared[arg.name]
                    builtins = [o for o in owners if o.name in BUILTIN]
                    if builtin and (arg.name in args or len(builtins) > 1):
                        raise UsageError(
                            f"pytest-torchperf: invariant {inv.name!r} declares argument {arg.name!r}, "
                            "which another invariant already declares"
                        )
                    owns = arg.name not in args and (len(owners) == 1 or builtins == [inv])
                    if owns:
                        args[arg.name] = (arg, inv)
                        spellings[qualified] = arg.name
                    else:
                        args[qualified] = (dataclasses.replace(arg, name=qualified), inv)
                        spellings[qualified] = qualified
                        if not builtins and arg.name not in args:
                            ambiguous.setdefault(arg.name, []).append(qualified)
            self._spellings, self._ambiguous = spellings, ambiguous
            self._arguments = args
        return self._arguments

    def spelling(self, name: str) -> Optional[str]:
        """The argument key a marker's ``name`` means (None: no argument); a UsageError when ambiguous."""
        arguments = self.arguments()
        if name in arguments:
            return name
        if name in self._spellings:
            return self._spellings[name]
        if name in self._ambiguous:
            both = " or ".join(self._ambiguous[name])
            raise UsageError(f"argument {name!r} is declared by more than one plug-in: spell it {both}")
        return None

    def register(self, invariant: Invariant) -> None:
        _validate(invariant, "register()")
        if invariant.name in self.table():
            raise UsageError(f"pytest-torchperf: an invariant named {invariant.name!r} is already registered")
        self._extra[invariant.name] = invariant
        self._changed()

    def unregister(self, name: str) -> None:
        self._extra.pop(name, None)
        self._changed()

    def _changed(self) -> None:
        """The set of invariants changed: every table built from it is built again when next read."""
        self._all = None
        self._arguments = None


def _validate(invariant: Any, source: str) -> None:
    if not isinstance(invariant, Invariant):
        raise UsageError(
            f"pytest-torchperf: {source} provides {invariant!r}, not a pytest_torchperf.extend.Invariant"
        )
    names = [invariant.name] + [a.name for a in invariant.arguments]
    for name in names:
        if not name.isidentifier() or name in _RESERVED or name.startswith("_"):
            raise UsageError(f"pytest-torchperf: {source}: {name!r} cannot be an argument name")
    if len(set(names)) != len(names):
        raise UsageError(f"pytest-torchperf: {source}: invariant {invariant.name!r} repeats an argument name")
    if QUALIFIER in invariant.name or any(QUALIFIER in a.name for a in invariant.arguments):
        raise UsageError(f"pytest-torchperf: {source}: a name may not contain {QUALIFIER!r} (it spells a namespace)")
    events: dict[str, Any] = {}
    for ref in invariant.probes:
        probe = _resolve_probe(ref, f"{source}: invariant {invariant.name!r}")
        declared = getattr(probe, "events", ()) or ()
        events.update(declared.items() if isinstance(declared, dict) else dict.fromkeys(declared))
    validate_declaration(invariant, source, events)
    _figures.validate(invariant.figures, source, invariant.name)


def _add(found: dict[str, Invariant], invariant: Any, source: str, validate: bool = True) -> None:
    if validate:
        _validate(invariant, source)
    if invariant.name in found or invariant.name == SCOPE.name:
        raise UsageError(
            f"pytest-torchperf: {source} registers the invariant {invariant.name!r}, which is already registered"
        )
    found[invariant.name] = invariant


def _from_entry_points() -> list[tuple[str, Invariant]]:
    """``(source, invariant)`` for each invariant other installed packages register."""
    from importlib import metadata

    try:
        selected: Any = metadata.entry_points(group=ENTRY_POINT_GROUP)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # Python 3.9: a dict of groups
        selected = metadata.entry_points().get(ENTRY_POINT_GROUP, [])  # type: ignore[attr-defined,arg-type,unused-ignore]
    out: list[tuple[str, Invariant]] = []
    for ep in sorted(selected, key=lambda ep: ep.name):
        dist = getattr(getattr(ep, "dist", None), "name", None)
        source = f"entry point {ep.name!r}" + (f" of {dist}" if dist else "") + f" ({ep.value})"
        try:
            loaded = ep.load()
        except Exception as exc:  # noqa: BLE001 - a broken plug-in is named, not an INTERNALERROR
            raise UsageError(f"pytest-torchperf: cannot load {source}: {type(exc).__name__}: {exc}") from None
        if isinstance(loaded, type(sys)):
            loaded = getattr(loaded, "INVARIANT", loaded)
        items: Iterable[Any] = loaded if isinstance(loaded, (list, tuple)) else [loaded]
        out.extend((source, item) for item in items)
    return out


_REGISTRY = _Registry()


def invariants() -> dict[str, Invariant]:
    """Every registered invariant by name, built-in ones first (in report order)."""
    return _REGISTRY.invariants()


def get(name: str) -> Invariant:
    return _REGISTRY.table()[name]


def all_arguments() -> dict[str, tuple[Argument, Optional[Invariant]]]:
    """Every marker argument: name -> (argument, the invariant it belongs to or None for ``scope``)."""
    return _REGISTRY.arguments()


def spelling(name: str) -> Optional[str]:
    """The argument key a marker argument ``name`` means (``inv__setting`` spellings too), None if none."""
    return _REGISTRY.spelling(name)


def setting_keys(invariant: Invariant) -> dict[str, str]:
    """``invariant``'s settings: plain name -> its key among the arguments (plain, or ``inv__setting``)."""
    arguments = all_arguments()
    out: dict[str, str] = {}
    for arg in invariant.arguments:
        owned = arguments.get(arg.name)
        own = owned is not None and owned[1] is invariant
        out[arg.name] = arg.name if own else f"{invariant.name}{QUALIFIER}{arg.name}"
    return out


def register(invariant: Invariant) -> None:
    """Register ``invariant`` for this process (a ``conftest.py`` can; packages use the entry point)."""
    _REGISTRY.register(invariant)


def unregister(name: str) -> None:
    """Forget an invariant added with :func:`register`."""
    _REGISTRY.unregister(name)


def make_checks(run: Any) -> dict[str, Any]:
    """The checks of ``run``: one per invariant its options enable, in registry order.

    Also fills ``run.probes_of`` (what each check depends on, for "not checked"
    verdicts when a probe fails); every invariant depends on the Lightning observer.
    """
    checks: dict[str, Any] = {}
    registered = _REGISTRY.table()
    for name in run.options.enabled_checks:
        invariant = registered[name]
        run._building = name  # ``Check.settings`` inside the check's constructor
        check = invariant.check(run)
        if not isinstance(invariant.check, type) and type(check) not in _VERIFIED:  # a factory's check: made now
            verify_handlers(type(check), f"the check of invariant {name!r}", _probe_events(invariant))
            _VERIFIED.add(type(check))
        if not getattr(check, "name", None):
            try:
                check.name = name
            except AttributeError:  # pragma: no cover - a check class with slots and no name
                pass
        checks[name] = check
        run.probes_of[name] = ("lightning",) + probe_names(invariant)
    return checks


#: Check classes made by factories whose handlers were verified (see :func:`~.declarations.verify_handlers`).
_VERIFIED: set[type] = set()


def _probe_events(invariant: Invariant) -> dict[str, Any]:
    events: dict[str, Any] = {}
    for name in probe_names(invariant):
        declared = getattr(_probe(name), "events", ()) or ()
        events.update(declared.items() if isinstance(declared, dict) else dict.fromkeys(declared))
    return events


def probes_for(names: Iterable[str]) -> list[Any]:
    """The probes the invariants ``names`` need, each once, every probe after the probes it needs."""
    ordered: list[Any] = []
    seen: set[str] = set()

    def visit(ref: Union[str, Any]) -> None:
        probe = _probe(ref)
        if probe.name in seen:
            return
        for needed in probe.needs:
            visit(needed)
        seen.add(probe.name)
        ordered.append(probe)

    registered = _REGISTRY.table()
    for name in names:
        for ref in registered[name].probes:
            visit(ref)
    return ordered


def probe_names(invariant: Invariant) -> tuple[str, ...]:
    """The names of every probe ``invariant`` depends on, directly or through other probes."""
    out: list[str] = []

    def visit(ref: Union[str, Any]) -> None:
        probe = _probe(ref)
        for needed in probe.needs:
            visit(needed)
        if probe.name not in out:
            out.append(probe.name)

    for ref in invariant.probes:
        visit(ref)
    return tuple(out)


def _probe(ref: Union[str, Any]) -> Any:
    """The registered probe ``ref`` names or is: a probe class, or (the older API) a plug-in's own instance."""
    if isinstance(ref, str):
        found = _probes.get(ref)
        if found is None:
            found = _probes[ref] = _builtin_class(ref)
        return found
    registered = _probes.get(ref.name)
    if registered is None or _same_probe(registered, ref):
        # A plug-in's class defined again (its module imported anew) or its instance given again (a new one):
        # the newest is the one its check reads.
        _probes[ref.name] = ref
    return ref


def _same_probe(registered: Any, ref: Any) -> bool:
    """Whether ``ref`` is ``registered`` again: the same class (or one defined by the same code, its module
    imported anew), or another instance of the same class."""
    if isinstance(ref, type) != isinstance(registered, type):
        return False
    if not isinstance(ref, type):
        registered, ref = type(registered), type(ref)
    return registered is ref or (registered.__module__, registered.__qualname__) == (ref.__module__, ref.__qualname__)


def _builtin_class(name: str) -> type:
    """The class of built-in probe ``name``: the one :class:`~.probes.Probe` subclass its module defines so named."""
    module = importlib.import_module(f"pytest_torchperf.probes.{name}")
    found = [
        value for value in vars(module).values()
        if isinstance(value, type) and value.__module__ == module.__name__ and getattr(value, "name", None) == name
        and callable(getattr(value, "install", None))
    ]
    if len(found) != 1:
        raise LookupError(f"pytest_torchperf.probes.{name} defines {len(found)} probe classes named {name!r}")
    return found[0]


@functools.cache
def _builtin_probe_names() -> tuple[str, ...]:
    """The built-in probes' names: the package's modules, listed once per process (a plug-in's probe is no
    module of it)."""
    import pkgutil

    package = importlib.import_module("pytest_torchperf.probes")
    return tuple(sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_")))


def _resolve_probe(ref: Union[str, Any], where: str) -> Any:
    """The probe ``ref`` names, and every probe it needs; a UsageError with "did you mean" for an unknown one."""
    if isinstance(ref, str):
        known = list(_probes) + [n for n in _builtin_probe_names() if n not in _probes]
        if ref not in known:
            raise UsageError(
                f"pytest-torchperf: {where} needs probe {ref!r}, which does not exist{suggest(ref, known)}; "
                f"probes: {', '.join(known)}"
            )
    elif not (isinstance(getattr(ref, "name", None), str) and ref.name and callable(getattr(ref, "install", None))):
        raise UsageError(f"pytest-torchperf: {where} names {ref!r} as a probe: give a Probe subclass or a name")
    else:
        taken = _probes.get(ref.name)
        if taken is None and ref.name in _builtin_probe_names():
            taken = _probe(ref.name)
        if taken is not None and not _same_probe(taken, ref):
            raise UsageError(f"pytest-torchperf: {where} names probe {ref!r}, but the probe name {ref.name!r} is "
                             f"already {taken!r}'s")
    probe = _probe(ref)
    for needed in getattr(probe, "needs", ()):
        _resolve_probe(needed, f"{where} (probe {probe.name!r})")
    return probe


#: Probe name -> its class: the built-in ones as they are first needed (found by module), third-party ones as
#: the invariants that name them are registered. (A plug-in that gives an instance, the older API, has that
#: instance here: every engine then uses it.) Never an instance of a built-in probe: engines make those.
_probes: dict[str, Any] = {}


def probe_class(name: str) -> Any:
    """The class of the probe named ``name`` (built-in, or one a registered invariant brought); for a plug-in
    that gave an instance (the older API), that instance."""
    return _probe(name)


# -- documentation built from the declarations ------------------------------------------


def markdown_table() -> str:
    """The README's argument tables (invariants, then settings), built from the declarations."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| invariant | default | accepts | checks that |", "|---|---|---|---|"]
    settings = ["| setting | tunes | default | accepts | meaning |", "|---|---|---|---|---|"]
    for name, (arg, owner) in all_arguments().items():
        default = f"`{arg.default!r}`"
        if owner is not None and owner.name == name:
            rows.append(f"| `{name}` | {default} | {cell(arg.kind.describe())} | {cell(arg.doc)} |")
        else:
            tunes = f"`{owner.name}`" if owner is not None else "the step checks"
            settings.append(f"| `{name}` | {tunes} | {default} | {cell(arg.kind.describe())} | {cell(arg.doc)} |")
    return "\n".join(rows) + "\n\n" + "\n".join(settings)


def options_schema() -> dict[str, Any]:
    """A JSON Schema (2020-12) of the marker's arguments, as the JSON report's ``options`` hold them."""
    properties: dict[str, Any] = {}
    for name, (arg, owner) in all_arguments().items():
        prop = dict(arg.kind.schema())
        prop["default"] = list(arg.default) if isinstance(arg.default, tuple) else arg.default
        prop["description"] = arg.doc
        if owner is not None and owner.name != name:
            prop["x-invariant"] = owner.name
        properties[name] = prop
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "pytest-torchperf marker arguments",
        "type": "object",
        "properties": properties,
        "additionalProperties": False,
    }
