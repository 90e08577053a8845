"""What ``min_workers`` and ``pin_memory`` share: where a training DataLoader was built, for the report."""

from __future__ import annotations

from ..probes.loaders import LoaderRecord
from ..report import Site

__all__ = ["loader_site"]


def loader_site(rec: LoaderRecord) -> list[Site]:
    if rec.created is not None:
        return [Site("created", rec.created)]
    if rec.first_iterated is not None:
        return [Site("first iterated (it was created before the run started)", rec.first_iterated)]
    return []
