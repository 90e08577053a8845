"""``max_overhead``'s early look and its load term: a clear case on a quiet machine stops after two rounds,
nothing close to the threshold or timed on a loaded machine does, and the error stays within 5% either way.

Pure statistics (torch-free): rounds drawn from the measured noise model.
"""

from __future__ import annotations

import math
import random

import pytest

from pytest_torchperf.timing.parity import ParityResult
from pytest_torchperf.timing.stats import EARLY_ROUNDS, LOAD_SHIFT_PER_WAIT, Rounds, estimate


def _round(rounds: Rounds, ratio: float, wait_share: float = 0.0) -> None:
    """One round of candidate ``ratio`` x baseline 1 s, each side waiting ``wait_share`` of its wall time."""
    c, b = ratio, 1.0
    k = 1 - wait_share
    rounds.add(c / k, b / k, c * wait_share / k, b * wait_share / k)


def test_a_clear_case_on_a_quiet_machine_stops_after_one_round_of_each_order() -> None:
    for ratio, decided in ((1.86, "failed"), (1.05, "passed")):
        rounds = Rounds(max_overhead=0.5, rounds=10)
        _round(rounds, ratio)
        assert not rounds.done()
        _round(rounds, ratio * 0.98)
        assert rounds.done() and len(rounds) == EARLY_ROUNDS and rounds.verdict == decided
        assert "after 2 rounds (one of each order, on a quiet machine)" in rounds.stop_reason
        result = ParityResult.from_rounds(rounds, ("a", "b"), 1)
        assert result.verdict == decided and result.interval == rounds.estimate().interval
        assert result.level == pytest.approx(1 - 0.05 / 4)


def test_the_early_look_spends_a_quarter_of_the_error_and_the_later_looks_share_the_rest() -> None:
    rounds = Rounds(max_overhead=0.5, rounds=10)
    _round(rounds, 1.55)
    _round(rounds, 1.45)
    assert not rounds.done()  # too close to the threshold for two rounds
    spent = 0.05 / 4 + sum(1 - level for level in rounds.levels.values())
    assert spent == pytest.approx(0.05)


@pytest.mark.parametrize("waits", [None, 0.2])
def test_no_early_look_unless_the_machine_was_measured_quiet(waits: float | None) -> None:
    rounds = Rounds(max_overhead=0.5, rounds=10)
    for ratio in (1.86, 1.84):
        if waits is None:
            rounds.add(ratio, 1.0)  # no scheduler figures: nothing says the machine was quiet
        else:
            _round(rounds, ratio, waits)
        assert not rounds.done()
    assert rounds.levels[4] == pytest.approx(0.975)  # nothing spent on a look not taken


def test_two_rounds_that_disagree_widen_the_early_interval() -> None:
    rounds = Rounds(max_overhead=0.5, rounds=10)
    _round(rounds, 2.4)
    _round(rounds, 1.5)  # the two orders differ by 47%: far more than the assumed spread
    assert not rounds.done()


def test_load_widens_the_interval_by_its_systematic_term() -> None:
    quiet, loaded = Rounds(max_overhead=0.5, rounds=10), Rounds(max_overhead=0.5, rounds=10)
    for ratio in (1.2, 1.25, 1.22, 1.18):
        _round(quiet, ratio, 0.0)
        _round(loaded, ratio, 0.6)
    assert quiet.ratios == pytest.approx(loaded.ratios)
    assert loaded.shift == pytest.approx(LOAD_SHIFT_PER_WAIT * 0.6)
    (qlo, qhi), (llo, lhi) = quiet.estimate().interval, loaded.estimate().interval
    assert math.log1p(lhi) - math.log1p(qhi) == pytest.approx(loaded.shift)
    assert math.log1p(qlo) - math.log1p(llo) == pytest.approx(loaded.shift)
    result = ParityResult.from_rounds(loaded, ("a", "b"), 1)
    assert result.interval == loaded.estimate().interval
    assert any("widened by 12.0% (log scale)" in line for line in result.facts())
    assert estimate(quiet.ratios, shift=0.0).interval == pytest.approx(estimate(quiet.ratios).interval)


def _timed(rng: random.Random, true: float, wait_share: float = 0.0) -> Rounds:
    rounds = Rounds(max_overhead=0.5, rounds=10)
    while True:
        first = len(rounds) % 2 == 0
        noise = rng.gauss(0, 0.02) * (3.0 if rng.random() < 0.1 else 1.0)
        c = true * math.exp(noise + (0.02 if first else -0.02))
        rounds.add(c / (1 - wait_share), 1.0 / (1 - wait_share), c * wait_share / (1 - wait_share),
                   wait_share / (1 - wait_share), candidate_first=first)
        if rounds.done():
            return rounds


def test_with_the_early_look_verdicts_at_the_threshold_stay_within_5_percent() -> None:
    rng = random.Random(11)
    trials = 400
    runs = [_timed(rng, 1.5) for _ in range(trials)]
    wrong = sum(r.verdict in ("passed", "failed") for r in runs)
    covered = sum(r.estimate().interval[0] <= 0.5 <= r.estimate().interval[1] for r in runs)
    assert wrong <= 0.05 * trials and covered >= 0.95 * trials


def test_a_far_case_stops_early_when_quiet_and_never_passes_when_loaded() -> None:
    rng = random.Random(5)
    quiet = [_timed(rng, 1.86) for _ in range(100)]
    assert sum(len(r) == EARLY_ROUNDS for r in quiet) >= 90 and all(r.verdict == "failed" for r in quiet)
    loaded = [_timed(rng, 1.86, 0.6) for _ in range(100)]
    assert all(len(r) >= 4 for r in loaded) and not any(r.verdict == "passed" for r in loaded)


def test_an_epoch_that_waited_through_most_of_its_wall_time_is_still_taken_out_and_counts_as_load() -> None:
    rounds = Rounds(max_overhead=0.5, rounds=10)
    rounds.add(2.0, 10.0, 0.15, 9.1)  # the baseline's 0.9 s of work waited 9.1 s for a CPU
    rounds.add(10.0, 1.9, 8.0, 0.9)
    assert rounds.ratios == pytest.approx([1.85 / 0.9, 2.0 / 1.0])
    assert rounds.wait_share is not None and rounds.wait_share > 0.5
    assert not rounds.done()  # no early look on a loaded machine
