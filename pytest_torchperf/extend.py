"""The plug-in API: everything a third-party invariant, check or probe uses, from one module.

This is the front door for plug-in authors (users import from
:mod:`pytest_torchperf`). A plug-in package imports only from here::

    from pytest_torchperf.extend import Check, CheckResult, Invariant, Status

- registration: :func:`register`, :func:`unregister` and
  :data:`ENTRY_POINT_GROUP` (the entry-point group a package declares its
  invariants in);
- declarations: :class:`Invariant` (name, value, settings, probes, check), the
  argument kinds (:class:`Flag`, :class:`Integer`, :class:`Number`,
  :class:`Fraction`, :class:`Choice`, :class:`SiteList`) and :class:`Argument`;
- checks: :class:`Check` (one per run; a method per event of :data:`EVENTS`,
  validated when the invariant is registered: an ``on_*`` method that is no
  event is a :class:`UsageError` with "did you mean"), :class:`Run` (what a
  check reads), and the verdict types :class:`CheckResult`, :class:`Finding`,
  :class:`Site`, :class:`Status`;
- events: the typed payloads (:class:`SyncEvent` for ``on_sync``,
  :class:`MoveEvent` for ``on_move``, :class:`Op`, :class:`Birth`) and the
  handler protocols (:class:`OnSync`: what an ``on_sync`` handler returns);
- probes: :class:`Probe` and the reversible :class:`Patcher`, :func:`guard`;
- frames: :func:`locate`, :func:`caller`, :func:`stack_of`,
  :func:`describe_frame`, :func:`capture`, :func:`until_user_frame`,
  :class:`Located`, :class:`Frame`, :class:`Stack`, and the frame kinds.

Settings: each invariant's settings are also a frozen object,
:meth:`Check.settings` (``self.settings.max_forward_copies``). A setting can
always be spelt ``<invariant>__<setting>`` in the marker
(``no_host_to_device_in_forward__max_forward_copies=1``); the plain name works
too unless two plug-ins declare it (then the plain name is refused, naming
both spellings), and a built-in setting's plain name stays the built-in's.

Six names are also in :mod:`pytest_torchperf`, the users' front door:
:class:`Run`, :class:`CheckResult`, :class:`Finding`, :class:`Site`,
:class:`Status` and :class:`UsageError` are the seam between the two (a check
reads a run and builds the results a user reads; both raise or catch a usage
error). Every other name lives in one front door only.

Nothing here imports torch.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

from . import _rejoin_modules

_rejoin_modules()  # before the imports below: after an in-process pytest session, the modules in use, not copies

from .arguments import Argument, ArgumentKind, Choice, Flag, Fraction, Integer, Number, SiteList, UsageError, suggest
from .core import EVENTS, Check, Run, notify
from .frames import Located, caller, describe_frame, kind_of, locate, stack_of
from .patching import Patcher
from .probes import Probe, guard
from .probes._host import Birth
from .probes._host import Move as MoveEvent
from .probes.syncs import Op
from .probes.syncs import Sync as SyncEvent
from .registry import ENTRY_POINT_GROUP, Invariant, register, unregister
from .report import CheckResult, Finding, Site
from .stacks import FRAMEWORK, LIBRARY, TORCH, USER, Frame, Stack, capture, until_user_frame
from .status import Status

__all__ = [
    "Argument",
    "ArgumentKind",
    "Birth",
    "Check",
    "CheckResult",
    "Choice",
    "ENTRY_POINT_GROUP",
    "EVENTS",
    "FRAMEWORK",
    "Finding",
    "Flag",
    "Fraction",
    "Frame",
    "Integer",
    "Invariant",
    "LIBRARY",
    "Located",
    "MoveEvent",
    "Number",
    "OnMove",
    "OnSync",
    "Op",
    "Patcher",
    "Probe",
    "Run",
    "Site",
    "SiteList",
    "Stack",
    "Status",
    "SyncEvent",
    "SyncRecord",
    "TORCH",
    "USER",
    "UsageError",
    "caller",
    "capture",
    "describe_frame",
    "guard",
    "kind_of",
    "locate",
    "notify",
    "register",
    "stack_of",
    "suggest",
    "unregister",
    "until_user_frame",
]


class SyncRecord(Protocol):
    """What an ``on_sync`` handler may return: a record the ``syncs`` probe confirms.

    On a CUDA machine the probe learns afterwards whether the operation really
    synchronised (torch's sync debug mode); it then adds one to ``confirmed``
    of every record the handlers returned for it. Return None to keep nothing.
    """

    confirmed: int


class OnSync(Protocol):
    """The ``on_sync`` handler: called for each synchronising operation inside the scope."""

    def __call__(self, event: SyncEvent) -> Optional[SyncRecord]: ...


class OnMove(Protocol):
    """The ``on_move`` handler: a host-built tensor moved to a device (its return value is ignored)."""

    def __call__(self, event: MoveEvent) -> Any: ...
