"""``pytest_torchperf.step()``: mark a training step of a plain loop for every run watching it.

``with run.step():`` needs the run; a loop that runs where no run object is at
hand (a function started by ``torch.multiprocessing.spawn`` or torchrun inside
a watched test, a helper called from a test under the marker) marks its steps
with ``with pytest_torchperf.step():`` instead. Outside any watch it does
nothing and costs one list check.
"""

from __future__ import annotations

from typing import Any

from . import core

__all__ = ["step"]


class step:
    """``with step(): ...``: one training step for every active run (nothing when none is active)."""

    __slots__ = ("_blocks",)

    def __init__(self) -> None:
        self._blocks: list[Any] = []

    def __enter__(self) -> step:
        for run in core.active_runs():
            if run.active:
                block = run.step()
                block.__enter__()
                self._blocks.append(block)
        return self

    def __exit__(self, *exc_info: Any) -> None:
        while self._blocks:
            self._blocks.pop().__exit__(*exc_info)
