"""What the deterministic count checks share (``max_ops_per_step``, ``max_collectives_per_step``).

- :class:`CountOrBaseline`: their value, a budget per step or ``"baseline"`` (the ratchet decides);
- :class:`StepWindows`: the training steps they count, whatever the ``scope`` option: a Lightning train
  batch from ``on_train_batch_start`` to ``on_train_batch_end`` (the step, its backward and the optimizer
  step), a ``with run.step():`` block, else a ``training_step`` call; the first ``warmup`` of them excluded;
- :func:`counted_entry`: a baseline entry of one counted thing (an op on a device, a collective at a site),
  carried in a check's figures under :data:`BASELINE_FIGURE` (see :mod:`pytest_torchperf.glue.baseline`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from ..arguments import ArgumentKind, UsageError, suggest

if TYPE_CHECKING:
    from ..core import Run

__all__ = ["BASELINE", "BASELINE_FIGURE", "CountOrBaseline", "StepWindows", "counted_entry", "per_step"]

#: The value that hands the verdict to the baseline ratchet.
BASELINE = "baseline"
#: The figure holding a check's counted baseline entries (dicts as ``Observation.to_entry`` writes them).
BASELINE_FIGURE = "baseline_counts"


class CountOrBaseline(ArgumentKind):
    """An ``int >= 0`` (a budget per step), ``"baseline"`` or ``None`` (off)."""

    json_type = ["integer", "string", "null"]

    def validate(self, value: Any, where: str, name: str, meaning: str) -> Any:
        if value is None:
            return None
        if isinstance(value, str):
            if value == BASELINE:
                return value
            raise UsageError(
                f"{where}: {name} must be {self.describe(meaning)}, got {value!r}{suggest(value, (BASELINE,))}"
            )
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
        raise self.error(where, name, value, meaning)

    def describe(self, meaning: str = "") -> str:
        about = f" ({meaning})" if meaning else ""
        return f"an integer >= 0{about}, 'baseline' (compare with the baseline file) or None"

    def schema(self) -> dict[str, Any]:
        return {"anyOf": [{"type": "integer", "minimum": 0}, {"const": BASELINE}, {"type": "null"}]}


def per_step(total: int, steps: int) -> float:
    """A per-step figure as the baseline stores it (rounded: the same counts give the same text)."""
    return round(total / steps, 3) if steps else 0.0


def counted_entry(
    invariant: str, *, function: str, source: str, count: int, per_step: float, label: str = "",
    file: str = "", line: int = 0,
) -> dict[str, Any]:
    """One baseline entry of a counted thing (``file`` empty: keyed by ``function`` and ``source`` alone)."""
    return {
        "invariant": invariant, "file": file, "function": function, "source": source, "line": line,
        "label": label, "count": count, "per_step": per_step,
    }


class StepWindows:
    """The counted steps of a run, from its step and batch events (a mix-in of a check: it receives them).

    Subclasses define :meth:`window_opened` (``counted``: past warm-up) and :meth:`window_closed`.
    """

    def __init__(self, run: Run, warmup: int) -> None:
        run.wants_batches = True  # Lightning's batch boundaries, whatever the scope
        self._run = run
        self.warmup = warmup
        #: Steps seen (warm-up included) and counted.
        self.windows = 0
        self.counted = 0
        self.open = False
        self.in_counted = False

    def _open(self) -> None:
        if self.open:
            return
        self.open = True
        self.windows += 1
        self.in_counted = self.windows > self.warmup
        if self.in_counted:
            self.counted += 1
        self.window_opened(self.in_counted)

    def _close(self) -> None:
        if not self.open:
            return
        self.open = False
        counted, self.in_counted = self.in_counted, False
        self.window_closed(counted)

    def on_batch_start(self) -> None:
        self._open()

    def on_batch_end(self) -> None:
        self._close()

    def on_step_start(self) -> None:
        self._open()

    def on_step_end(self) -> None:
        if self._run._batch_depth == 0:  # a training_step inside a Lightning batch: the batch closes it
            self._close()

    def on_run_end(self) -> None:
        self._close()

    def window_opened(self, counted: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def window_closed(self, counted: bool) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def step(self) -> Optional[int]:
        """The counted step now (1-based), None outside counted steps."""
        return self.counted if self.in_counted else None
