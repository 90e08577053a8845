"""The arguments of ``@pytest.mark.torchperf(...)`` and ``torchperf.watch(...)``.

One frozen dataclass holds them; :func:`parse_options` is the only way in and
rejects anything it does not know, naming the argument and what it accepts.
Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any, Mapping, Optional

__all__ = ["SCOPES", "Options", "UsageError", "parse_options", "describe_options"]

#: Where the step checks apply.
SCOPES = ("training_step", "batch", "test")

#: Invariants that take a number and are off while it is None.
_NUMBER_INVARIANTS = ("max_overhead", "min_workers")

#: ``overhead_rounds``: default, and the range it accepts (fewer than 4 rounds cannot bound a median).
OVERHEAD_ROUNDS = 10
OVERHEAD_MIN_ROUNDS = 4
OVERHEAD_MAX_ROUNDS = 1000
#: ``overhead_inconclusive``: what a ``max_overhead`` verdict that is neither a pass nor a fail does to the test.
OVERHEAD_INCONCLUSIVE = ("fail", "skip", "warn")


class UsageError(ValueError):
    """A torchperf marker, fixture or option was given an argument it does not accept."""


def _field(default: Any, doc: str) -> Any:
    return dataclasses.field(default=default, metadata={"doc": doc})


def _setting(default: Any, doc: str) -> Any:
    """An argument that tunes a check rather than being an invariant of its own."""
    return dataclasses.field(default=default, metadata={"doc": doc, "setting": True})


@dataclasses.dataclass(frozen=True)
class Options:
    """What one watched run checks. Build it with :func:`parse_options`."""

    no_host_sync: bool = _field(True, "no GPU->CPU synchronisation inside the scope")
    on_device: bool = _field(True, "tensors are created on the device, not built on the host and copied")
    no_iterator_reset: bool = _field(
        True, "each DataLoader with workers starts its worker pool at most once"
    )
    max_overhead: Optional[float] = _field(
        None, "epoch time within this fraction of a vanilla PyTorch loop (e.g. 0.10)"
    )
    min_workers: Optional[int] = _field(
        None, "every training DataLoader has at least this many worker processes (num_workers)"
    )
    pin_memory: bool = _field(
        False, "on a CUDA run, every training DataLoader pins its batches (not applicable on CPU)"
    )
    no_empty_cache: bool = _field(False, "no torch.cuda.empty_cache() call by your code in the run")
    no_data_parallel: bool = _field(
        True, "no torch.nn.DataParallel in the run (use DistributedDataParallel)"
    )
    grads_set_to_none: bool = _field(
        False, "gradients are cleared by setting them to None: no zero_grad(set_to_none=False), no .grad.zero_()"
    )
    no_recompiles: bool = _field(
        False, "torch.compile'd code is not compiled again after warm-up (the first epoch)"
    )
    mixed_precision: bool = _field(
        False, "on a GPU, training steps run under autocast or in 16-bit (not applicable on CPU)"
    )
    scope: str = _field(
        "training_step",
        "where step checks apply: 'training_step', 'batch' (batch start to batch end) or 'test'",
    )
    allowed_syncs: tuple[str, ...] = _setting(
        (),
        "no_host_sync accepts syncs at these sites ('file.py:LINE', 'file.py') or in these "
        "functions ('log_images', 'MyModule.on_train_batch_end')",
    )
    fail_on_framework_syncs: bool = _setting(
        False, "no_host_sync also fails on syncs made by Lightning, torchmetrics or other libraries"
    )
    allowed_copies: tuple[str, ...] = _setting(
        (),
        "on_device accepts host-built tensors created or moved at these sites or in these "
        "functions (same forms as allowed_syncs)",
    )
    overhead_rounds: int = _setting(
        OVERHEAD_ROUNDS,
        "max_overhead times at most this many rounds (one fit epoch and one vanilla epoch each, "
        f"after a warm-up); it stops after {OVERHEAD_MIN_ROUNDS} once the 95% interval is clear of the threshold",
    )
    overhead_inconclusive: str = _setting(
        "fail",
        "what max_overhead does when its interval still straddles the threshold after overhead_rounds: "
        "'fail' the test, 'skip' it, or 'warn' (pass with a warning)",
    )
    max_syncs_per_step: Optional[int] = _setting(
        None,
        "no_host_sync passes while no training step makes more than N syncs in your code "
        "(for code that syncs on purpose; syncs outside steps always count)",
    )
    max_copies_per_step: Optional[int] = _setting(
        None,
        "on_device passes while no training step makes more than N copies of host-built tensors",
    )
    recompile_warmup_steps: Optional[int] = _setting(
        None,
        "no_recompiles counts recompiles during the first N training steps as warm-up "
        "(default: the first epoch)",
    )

    @property
    def enabled_checks(self) -> tuple[str, ...]:
        """Names of the invariants this run was asked to check, in declaration order."""
        names = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "scope" or f.metadata.get("setting"):
                continue
            if value is True or (f.name in _NUMBER_INVARIANTS and value is not None):
                names.append(f.name)
        return tuple(names)


_FIELDS = {f.name: f for f in dataclasses.fields(Options)}
_BOOL_FIELDS = tuple(name for name, f in _FIELDS.items() if f.type in ("bool", bool))


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(value: Any) -> str:
    return type(value).__name__


#: Arguments holding a list of sites and functions (see :func:`_parse_site_list`).
_SITE_LIST_FIELDS = ("allowed_syncs", "allowed_copies")
_SITE_FORMS = (
    "a site 'path/to/file.py:LINE', a file 'file.py' or a function name "
    "('log_images', 'MyModule.on_train_batch_end')"
)
_SITE_RE = re.compile(r"^(?P<path>[^:]+\.py):(?P<line>-?\d+)$")
_FUNC_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _parse_site_list(where: str, name: str, value: Any) -> tuple[str, ...]:
    """A str or a list/tuple of str, each a site, a file or a function name; returned as a tuple."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise UsageError(
            f"{where}: {name} must be a list of strings, each {_SITE_FORMS}; "
            f"got {value!r} ({_type_name(value)})"
        )
    entries = []
    for entry in value:
        if not isinstance(entry, str):
            raise UsageError(
                f"{where}: {name} entries must be strings, each {_SITE_FORMS}; "
                f"got {entry!r} ({_type_name(entry)})"
            )
        text = entry.strip()
        site = _SITE_RE.match(text)
        if site:
            if int(site.group("line")) < 1:
                raise UsageError(f"{where}: {name} entry {entry!r} has line {site.group('line')}; lines start at 1")
        elif not (text.endswith(".py") and ":" not in text) and not _FUNC_RE.match(text):
            raise UsageError(f"{where}: {name} entry {entry!r} is not {_SITE_FORMS}")
        entries.append(text)
    return tuple(entries)


def parse_options(
    kwargs: Mapping[str, Any],
    *,
    args: tuple[Any, ...] = (),
    where: str = "torchperf",
) -> Options:
    """Validate ``kwargs`` and return the :class:`Options` they describe.

    ``where`` names the caller in error messages (``@pytest.mark.torchperf``,
    ``torchperf.watch()``). Raises :class:`UsageError` naming the first bad
    argument, what it accepts and, for a misspelt name, the closest valid one.
    """
    allowed = ", ".join(_FIELDS)
    if args:
        raise UsageError(
            f"{where} takes keyword arguments only, got positional {args[0]!r}; "
            f"allowed arguments: {allowed}"
        )
    for name in kwargs:
        if name not in _FIELDS:
            raise UsageError(
                f"{where} got an unknown argument {name!r}{_suggest(name, list(_FIELDS))}; "
                f"allowed arguments: {allowed}"
            )
    for name in _BOOL_FIELDS:
        if name in kwargs and not isinstance(kwargs[name], bool):
            raise UsageError(
                f"{where}: {name} must be True or False, got {kwargs[name]!r} ({_type_name(kwargs[name])})"
            )
    if "max_overhead" in kwargs:
        value = kwargs["max_overhead"]
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(
                    f"{where}: max_overhead must be a number > 0 (a fraction: 0.10 means 10%) or None, "
                    f"got {value!r} ({_type_name(value)})"
                )
            if not math.isfinite(value) or value <= 0:
                raise UsageError(
                    f"{where}: max_overhead must be a finite number > 0 (a fraction: 0.10 means 10%), "
                    f"got {value!r}"
                )
    if "overhead_rounds" in kwargs:
        value = kwargs["overhead_rounds"]
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not OVERHEAD_MIN_ROUNDS <= value <= OVERHEAD_MAX_ROUNDS
        ):
            raise UsageError(
                f"{where}: overhead_rounds must be an integer from {OVERHEAD_MIN_ROUNDS} to "
                f"{OVERHEAD_MAX_ROUNDS} (timed rounds of max_overhead), got {value!r} ({_type_name(value)})"
            )
    for name, lowest, meaning in (
        ("min_workers", 1, "the fewest DataLoader worker processes each training loader may have"),
        ("recompile_warmup_steps", 0, "training steps whose recompiles count as warm-up"),
        ("max_syncs_per_step", 0, "the most syncs in your code any training step may make"),
        ("max_copies_per_step", 0, "the most copies of host-built tensors any training step may make"),
    ):
        value = kwargs.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < lowest):
            raise UsageError(
                f"{where}: {name} must be an integer >= {lowest} ({meaning}) or None, "
                f"got {value!r} ({_type_name(value)})"
            )
    for name, choices in (("overhead_inconclusive", OVERHEAD_INCONCLUSIVE),):
        if name in kwargs:
            value = kwargs[name]
            if not isinstance(value, str) or value not in choices:
                hint = _suggest(value, choices) if isinstance(value, str) else ""
                raise UsageError(
                    f"{where}: {name} must be one of {', '.join(repr(c) for c in choices)}, got {value!r}{hint}"
                )
    if "scope" in kwargs:
        value = kwargs["scope"]
        if not isinstance(value, str) or value not in SCOPES:
            hint = _suggest(value, SCOPES) if isinstance(value, str) else ""
            raise UsageError(
                f"{where}: scope must be one of {', '.join(repr(s) for s in SCOPES)}, "
                f"got {value!r}{hint}"
            )
    values = dict(kwargs)
    for name in _SITE_LIST_FIELDS:
        if name in kwargs:
            values[name] = _parse_site_list(where, name, kwargs[name])
    if values.get("max_overhead") is not None:
        values["max_overhead"] = float(values["max_overhead"])
    return Options(**values)


def describe_options() -> str:
    """The marker's signature for ``pytest --markers``, built from the dataclass itself."""
    parts = []
    for name, f in _FIELDS.items():
        parts.append(f"{name}={f.default!r}")
    return ", ".join(parts)


def option_docs() -> list[tuple[str, Any, str]]:
    """``(name, default, doc)`` for every argument, for help texts and the README."""
    return [(name, f.default, f.metadata["doc"]) for name, f in _FIELDS.items()]
