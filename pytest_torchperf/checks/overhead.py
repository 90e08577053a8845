"""Invariant ``max_overhead``: its check lives in :mod:`pytest_torchperf.overhead` (verdict, replay, attribution)."""

from __future__ import annotations

from ..overhead import NAME, OverheadCheck

__all__ = ["NAME", "OverheadCheck"]
