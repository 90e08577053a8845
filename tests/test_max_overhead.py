"""``max_overhead``, ``parity()`` and ``vanilla_fit()``: statistics, the derived loop, real Lightning fits on CPU.

The two heavy tests time real fits of a 4x512 MLP (about 15 ms of matrix work
per step on one thread) through the marker; everything else uses tiny models
or synthetic epoch times so the file stays fast on two cores.
"""

from __future__ import annotations

import json
import math
import os
import random
import subprocess
import sys
import textwrap
import time
import unittest
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover - the lightning package only
    pl = pytest.importorskip("lightning.pytorch")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytest_torchperf import InvariantViolation, NotMirrored, ParityResult, UsageError, parity, vanilla_fit, watch  # noqa: E402
from pytest_torchperf.glue.results import merge_checks  # noqa: E402
from pytest_torchperf.options import Options, parse_options  # noqa: E402
from pytest_torchperf.overhead.replay import LIGHTNING_WARMUP_BATCHES  # noqa: E402
from pytest_torchperf.report import Inconclusive, InconclusiveWarning  # noqa: E402
from pytest_torchperf.timing import (  # noqa: E402
    LOCK_ENV,
    MIN_ROUNDS,
    THREAD_TIME,
    LoadMeter,
    Rounds,
    Stopwatch,
    cpu_wait,
    estimate,
    median,
    t_quantile,
    timing_lock,
    verdict,
)
from pytest_torchperf.timing.clock import EpochWatch, whole_epoch  # noqa: E402
from pytest_torchperf.timing.vanilla import VanillaLoop  # noqa: E402

#: Every other invariant off (those on by default), so only max_overhead is checked and paid for.
ONLY_OVERHEAD = {name: False for name in Options().enabled_checks}


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread: steadier timings on a small shared machine (restored after each test)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# -- tiny models for the mechanics ------------------------------------------------------------


def tiny_loader(n: int = 32, batch_size: int = 8, width: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)), batch_size=batch_size
    )


class CountingSGD(torch.optim.SGD):
    """SGD that counts its steps and remembers the gradient norm it saw at each one."""

    def __init__(self, params: Any, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.steps = 0
        self.grad_norms: list[float] = []

    def step(self, closure: Any = None) -> Any:
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.grad_norms.append(
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        )
        self.steps += 1
        return super().step(closure)


class Tiny(pl.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(width, 1)
        self.optimizer: Any = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        self.optimizer = CountingSGD(self.parameters(), lr=0.01)
        return self.optimizer


def tiny_trainer(tmp_path: Any, **kwargs: Any) -> Any:
    options = dict(
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    options.update(kwargs)
    return pl.Trainer(**options)


# -- statistics ----------------------------------------------------------------------------------


def test_t_quantiles_match_the_published_tables() -> None:
    for p, df, table in [
        (0.975, 1, 12.706),
        (0.975, 2, 4.303),
        (0.975, 30, 2.042),
        (0.995, 4, 4.604),
        (0.9999, 3, 22.204),
    ]:
        assert t_quantile(p, df) == pytest.approx(table, abs=1e-3)
    assert t_quantile(0.025, 2) == pytest.approx(-4.303, abs=1e-3)


def test_estimate_balances_the_order_of_rounds() -> None:
    # A-first rounds measure 1.2, B-first ones 1.1: the overhead is their geometric mean, the order effect shown.
    est = estimate([1.2, 1.1, 1.2, 1.1, 1.2, 1.1])
    assert est.overhead == pytest.approx(math.sqrt(1.2 * 1.1) - 1)
    assert est.order_effect == pytest.approx(1.2 / 1.1 - 1) and est.sd == pytest.approx(0.0)
    lo, hi = est.interval  # no spread between rounds: only the run-to-run part is left
    assert lo < est.overhead < hi and hi - lo < 0.04
    assert estimate([1.2, 1.1, 1.2, 1.1]) == estimate([1.2, 1.1, 1.2, 1.1])  # pure: same rounds, same interval
    # Rounds of one order only: a plain mean, no order effect.
    one_order = estimate([1.2, 1.1, 1.2, 1.1], candidate_first=[True] * 4)
    assert one_order.order_effect == 0.0 and one_order.sd > 0.04
    assert estimate([1.3, 1.3]).interval == (-1.0, math.inf)  # too few rounds for an interval


def test_interval_narrows_with_rounds_and_widens_with_spread() -> None:
    rng = random.Random(1)
    noisy = [1.3 * math.exp(rng.gauss(0, 0.05)) for _ in range(40)]
    widths = [estimate(noisy[:n]).width for n in (4, 10, 40)]
    assert widths[0] > widths[1] > widths[2]
    quieter = [1.3 * (r / 1.3) ** 0.2 for r in noisy[:10]]
    assert estimate(quieter).width < widths[1]


def test_three_verdicts_from_fixed_samples() -> None:
    assert verdict(estimate([1.50, 1.52, 1.49, 1.51]), 0.3) == "failed"
    assert verdict(estimate([1.05, 1.04, 1.06, 1.05]), 0.3) == "passed"
    straddling = estimate([1.1, 1.5, 1.5, 1.1, 1.1, 1.5])
    lo, hi = straddling.interval
    assert lo < 0.3 < hi and verdict(straddling, 0.3) == "inconclusive"
    assert verdict(straddling, None) is None


def test_rounds_look_at_complete_pairs_and_stop_once_the_interval_is_clear() -> None:
    clear = Rounds(max_overhead=0.3, rounds=10)
    assert clear.looks == [4, 6, 8, 10]
    assert [clear.levels[n] for n in clear.looks] == pytest.approx([0.975, 1 - 0.025 / 3, 1 - 0.025 / 3, 1 - 0.025 / 3])
    for c in (2.0, 2.1, 1.9, 2.05):
        assert not clear.done()
        clear.add(c, 1.0)
    assert clear.done() and len(clear) == MIN_ROUNDS
    assert "entirely above" in clear.stop_reason and clear.verdict == "failed"

    straddling = Rounds(max_overhead=0.3, rounds=6)
    for c in (1.1, 1.5, 1.5, 1.1, 1.1, 1.5):
        straddling.add(c, 1.0)
        if len(straddling) < 6:
            assert not straddling.done()
    assert straddling.done() and "budget of 6" in straddling.stop_reason
    assert straddling.verdict == "inconclusive"


def test_verdicts_hold_at_95_percent_however_many_looks_they_take() -> None:
    """A fit exactly at its threshold, timed again and again: wrong verdicts stay within 5%, both sides together.

    Rounds drawn from the measured noise model (2% per round, heavy-tailed, an order effect of 4%).
    """
    rng = random.Random(7)
    decided = {"passed": 0, "failed": 0, "inconclusive": 0}
    covered = 0
    trials = 300
    for _ in range(trials):
        rounds = Rounds(max_overhead=0.5, rounds=10)
        while True:
            first = len(rounds) % 2 == 0
            noise = rng.gauss(0, 0.02) * (3.0 if rng.random() < 0.1 else 1.0)
            rounds.add(1.5 * math.exp(noise + (0.02 if first else -0.02)), 1.0, candidate_first=first)
            if rounds.done():
                break
        decided[rounds.verdict] += 1  # type: ignore[index]
        lo, hi = rounds.estimate().interval
        covered += lo <= 0.5 <= hi
    assert decided["passed"] + decided["failed"] <= 0.05 * trials, decided
    assert covered >= 0.95 * trials


def test_rounds_take_the_wait_for_a_cpu_out_of_both_sides() -> None:
    rounds = Rounds(max_overhead=0.3, rounds=10)
    rounds.add(1.5, 1.0, 0.5, 0.0)  # the candidate's epoch was stretched by another process
    rounds.add(1.0, 1.25, 0.0, 0.25)
    assert rounds.ratios == [1.0, 1.0]
    stats = ParityResult.from_rounds(rounds, ("a", "b"), 1)
    assert stats.candidate.wait_share == pytest.approx(0.5 / 2.5) and stats.baseline.wait_share == pytest.approx(
        0.25 / 2.25
    )
    assert "waited for a CPU (Linux run-queue delay): 20.0% of a's wall time, 11.1% of b's" in str(stats)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or cpu_wait() is None, reason="Linux scheduler statistics")
def test_stopwatch_measures_the_time_another_process_held_our_cpu() -> None:
    cpu = min(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    hog = subprocess.Popen(
        [sys.executable, "-c", f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"]
    )
    try:
        os.sched_setaffinity(0, {cpu})  # this thread and the hog now share one CPU
        time.sleep(0.2)
        watch = Stopwatch()
        watch.start()
        busy(0.4)
        wall, waited = watch.stop()
    finally:
        os.sched_setaffinity(0, before)
        hog.kill()
        hog.wait()
    assert waited is not None and 0.1 < waited < wall


def spin(seconds: float) -> None:
    """``seconds`` of this thread's CPU time, however long other processes hold the CPU."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_an_epoch_cut_short_counts_as_the_whole_epoch_with_its_per_epoch_cost_once() -> None:
    watch = EpochWatch(None, left=6, apart=5)  # an epoch of 12 batches cut to its first 6
    watch.start()
    spin(0.05)  # the epoch's own cost (its hooks, a new iterator...)
    for index in range(6):
        watch.batch_start(index)
        spin(0.005)
    seconds, wait = watch.stop()
    # The whole epoch: the per-epoch cost once and 12 batches, 0.11 s (the window scaled by 12/6 would be 0.22 s).
    assert seconds - (wait or 0.0) == pytest.approx(0.11, rel=0.1)


def test_the_whole_epochs_wait_for_a_cpu_is_extrapolated_like_its_seconds() -> None:
    # A window of 1 s (0.1 s of it waiting), read at 0.2 s and 0.5 s, 3 batches apart; 6 batches left.
    assert whole_epoch((1.0, 0.1), (0.2, 0.02), (0.5, 0.05), 3, 6) == pytest.approx((1.6, 0.16))
    assert whole_epoch((1.0, None), (0.2, None), (0.5, None), 3, 6) == (pytest.approx(1.6), None)
    with pytest.raises(RuntimeError, match="read at 1 of batches"):
        watch = EpochWatch(None, left=6, apart=5)
        watch.start()
        watch.batch_start(0)
        watch.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stopwatch_times_a_gpu_with_cuda_events() -> None:
    from pytest_torchperf.timing import CUDA_EVENT_TIME

    device = torch.device("cuda")
    x = torch.randn(2048, 2048, device=device)
    watch = Stopwatch(device)
    assert watch.unit == CUDA_EVENT_TIME
    watch.start()
    for _ in range(20):
        x = x @ x / 2048
    seconds, waited = watch.stop()
    assert waited is None and 0 < seconds < 10


# -- parity(): the callable form -----------------------------------------------------------------


def fixed(times: list[float], calls: list[str], name: str) -> Any:
    it = iter(times)

    def epoch() -> float:
        calls.append(name)
        return next(it)

    return epoch


def test_parity_fails_a_slower_candidate_with_a_report() -> None:
    calls: list[str] = []
    jitter = [1.0, 1.02, 0.98, 1.01, 0.99, 1.03, 1.0, 0.97] * 3
    candidate = fixed([1.5 * j for j in jitter], calls, "c")
    baseline = fixed(jitter, calls, "b")
    with pytest.raises(InvariantViolation) as info:
        parity(candidate, baseline, max_overhead=0.3, names=("my loop", "plain loop"))
    check = info.value.report["max_overhead"]
    assert check.status == "failed"
    assert check.figures["overhead"] == pytest.approx(0.5, abs=0.06)
    assert check.figures["rounds"] == MIN_ROUNDS and check.figures["decisive"] is True
    text = info.value.report.render()
    assert "max_overhead" in text and "my loop" in text and "plain loop" in text
    assert "entirely above the threshold 30%" in text
    # A B, then B A, ...: one warm-up round, then MIN_ROUNDS timed ones.
    assert calls == ["c", "b", "b", "c", "c", "b", "b", "c", "c", "b"]


def test_parity_passes_within_the_threshold_and_returns_its_measurement() -> None:
    calls: list[str] = []
    result = parity(fixed([1.05] * 30, calls, "c"), fixed([1.0] * 30, calls, "b"), max_overhead=0.2)
    assert result.passed and not result.exceeded and result.decisive
    assert result.overhead == pytest.approx(0.05)
    assert result.summary().startswith("+5.0% over baseline") and result.summary().endswith("< 20%")
    figures = result.to_dict()
    assert figures["candidate"]["median_s"] == pytest.approx(1.05)
    assert figures["baseline"]["times_s"] == [1.0] * MIN_ROUNDS
    assert set(figures["load"]) >= {"cpus", "loaded", "cpu_wait_fraction"}


def test_parity_without_a_threshold_measures_and_check_false_never_raises() -> None:
    calls: list[str] = []
    measured = parity(fixed([2.0] * 30, calls, "c"), fixed([1.0] * 30, calls, "b"))
    assert measured.exceeded is None and measured.passed and measured.overhead == pytest.approx(1.0)
    quiet = parity(fixed([2.0] * 30, calls, "c"), fixed([1.0] * 30, calls, "b"), max_overhead=0.1, check=False)
    assert quiet.exceeded is True and quiet.report()["max_overhead"].status == "failed"


def straddling(calls: list[str]) -> Any:
    """Candidate epochs whose ratios to 1.0 s straddle 30% (after one warm-up round), for ``rounds=4``."""
    return fixed([1.0, 1.1, 1.5, 1.5, 1.1], calls, "c"), fixed([1.0] * 5, calls, "b")


def test_an_inconclusive_comparison_fails_skips_or_warns_as_asked() -> None:
    with pytest.raises(InvariantViolation) as info:
        parity(*straddling([]), max_overhead=0.3, rounds=4)
    check = info.value.report["max_overhead"]
    assert check.status == "inconclusive" and check.figures["verdict"] == "inconclusive"
    lo, hi = check.figures["interval"]
    assert lo < 0.3 < hi and check.figures["rounds"] == 4
    text = info.value.report.render()
    assert text.startswith("torchperf: inconclusive: max_overhead (+") and "straddles 30%" in text
    assert "so this run can neither pass nor fail it" in text
    assert "time more rounds for a narrower interval (rounds=4)" in text and "overhead_inconclusive='skip'" in text

    with pytest.raises(Inconclusive) as skipped:
        parity(*straddling([]), max_overhead=0.3, rounds=4, inconclusive="skip")
    assert isinstance(skipped.value, unittest.SkipTest) and "inconclusive: max_overhead" in str(skipped.value)
    with pytest.warns(InconclusiveWarning, match="passed with a warning"):
        result = parity(*straddling([]), max_overhead=0.3, rounds=4, inconclusive="warn")
    assert result.inconclusive and not result.passed and result.exceeded is False and not result.decisive
    quiet = parity(*straddling([]), max_overhead=0.3, rounds=4, check=False)
    assert quiet.verdict == "inconclusive" and quiet.report()["max_overhead"].status == "inconclusive"


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def work(n: int) -> None:
    """A fixed amount of CPU work (busy(s) spins until a deadline, however much of it another process took)."""
    total = 0
    for i in range(n):
        total += i


def test_parity_times_real_calls_and_pins_torch_threads() -> None:
    def candidate() -> None:
        torch.set_num_threads(2)  # a callable that changes the thread count is set back before each call
        work(200_000)

    seen: list[int] = []

    def baseline() -> None:
        seen.append(torch.get_num_threads())
        work(100_000)

    result = parity(candidate, baseline, max_overhead=0.3, check=False)
    assert result.exceeded and 0.6 < result.overhead < 1.6, result
    assert result.threads == 1 and set(seen) == {1}
    assert any("thread count" in note for note in result.notes)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_overhead": -0.1}, "max_overhead must be a finite number > 0"),
        ({"max_overhead": "ten%"}, "max_overhead must be a number > 0"),
        ({"rounds": 3}, "rounds must be an integer from 4 to 1000, got 3"),
        ({"rounds": True}, "rounds must be an integer"),
        ({"warmup": -1}, "warmup must be an integer from 0"),
        ({"names": ("only one",)}, "names must be two non-empty strings"),
        (
            {"inconclusive": "skp"},
            "inconclusive must be one of 'fail', 'skip', 'warn', got 'skp' \\(did you mean 'skip'\\?\\)",
        ),
        ({"inconclusive": None}, "inconclusive must be one of"),
    ],
)
def test_parity_refuses_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parity(lambda: 1.0, lambda: 1.0, **kwargs)


def test_parity_refuses_what_is_not_a_callable_or_an_epoch_time() -> None:
    with pytest.raises(UsageError, match="candidate must be a callable"):
        parity(1.0, lambda: 1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="the baseline callable returned 'fast'"):
        parity(lambda: 1.0, lambda: "fast")
    with pytest.raises(ValueError, match="not positive"):
        parity(lambda: [1.0, -2.0], lambda: 1.0)


def test_overhead_rounds_is_a_validated_setting() -> None:
    assert parse_options({}).overhead_rounds == 10
    assert "max_overhead" in parse_options({"max_overhead": 0.2, "overhead_rounds": 4}).enabled_checks
    assert "overhead_rounds" not in parse_options({"overhead_rounds": 20}).enabled_checks
    for bad in (3, 1001, True, 5.0, "6"):
        with pytest.raises(UsageError, match="overhead_rounds must be an integer from 4 to 1000"):
            parse_options({"overhead_rounds": bad}, where="@pytest.mark.torchperf")


def test_overhead_inconclusive_is_a_validated_setting() -> None:
    assert parse_options({}).overhead_inconclusive == "fail"
    assert parse_options({"overhead_inconclusive": "warn"}).enabled_checks == parse_options({}).enabled_checks
    with pytest.raises(
        UsageError,
        match=r"overhead_inconclusive must be one of 'fail', 'skip', 'warn', got 'wran' \(did you mean 'warn'\?\)",
    ):
        parse_options({"overhead_inconclusive": "wran"}, where="@pytest.mark.torchperf")
    with pytest.raises(UsageError, match="overhead_inconclusive must be one of .* got True"):
        parse_options({"overhead_inconclusive": True})


def test_a_tests_verdict_is_the_most_doubtful_of_its_runs() -> None:
    def runs(*statuses: str) -> list[dict[str, Any]]:
        return [{"checks": {"max_overhead": {"status": status, "run": i}}} for i, status in enumerate(statuses)]

    assert merge_checks(runs("passed", "inconclusive", "passed"))["max_overhead"]["status"] == "inconclusive"
    assert merge_checks(runs("inconclusive", "failed"))["max_overhead"]["status"] == "failed"
    assert merge_checks(runs("not checked", "passed"))["max_overhead"]["status"] == "passed"


# -- the machine: lock and load ------------------------------------------------------------------


@pytest.mark.skipif(sys.platform == "win32", reason="fcntl locks")
def test_timing_lock_keeps_other_processes_out(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "timing.lock")
    monkeypatch.setenv(LOCK_ENV, path)
    probe = textwrap.dedent(
        f"""
        import fcntl, os, sys
        fd = os.open({path!r}, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(3)
        """
    )
    with timing_lock() as info:
        assert info.path == path and info.waited_s >= 0
        with timing_lock() as inner:  # re-entrant in one thread
            assert inner.path == path
        assert subprocess.run([sys.executable, "-c", probe]).returncode == 3
    assert subprocess.run([sys.executable, "-c", probe]).returncode == 0
    monkeypatch.delenv(LOCK_ENV)
    with timing_lock() as info:
        assert info.path is None


def test_load_meter_says_how_long_our_threads_waited_for_a_cpu() -> None:
    with LoadMeter() as meter:
        busy(0.05)
    figures = meter.figures
    assert figures["cpus"] >= 1 and "loaded" in figures
    if sys.platform == "linux":
        assert 0.0 <= figures["cpu_wait_fraction"] <= 1.0
        assert "waited for a CPU" in figures["text"]


# -- vanilla_fit(): the derived loop -------------------------------------------------------------


def test_vanilla_fit_runs_the_loop_the_module_describes() -> None:
    module = Tiny()
    before = module.layer.weight.detach().clone()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # self.log without a Trainer must stay silent
        times = vanilla_fit(module, tiny_loader(), max_epochs=3)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert module.optimizer.steps == 12  # 4 batches x 3 epochs
    assert not torch.equal(module.layer.weight, before)
    capped = Tiny()
    vanilla_fit(capped, tiny_loader(), max_epochs=3, max_steps=5)
    assert capped.optimizer.steps == 5
    limited = Tiny()
    vanilla_fit(limited, tiny_loader(), max_epochs=2, limit_train_batches=0.5)
    assert limited.optimizer.steps == 4


def test_vanilla_fit_mirrors_schedulers_accumulation_and_clipping() -> None:
    class Scheduled(Tiny):
        def configure_optimizers(self) -> Any:
            self.optimizer = CountingSGD(self.parameters(), lr=1.0)
            scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)
            return {"optimizer": self.optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    module = Scheduled()
    vanilla_fit(module, tiny_loader(), max_epochs=1, accumulate_grad_batches=2, gradient_clip_val=1e-3)
    assert module.optimizer.steps == 2  # 4 batches, a step every 2
    assert module.optimizer.param_groups[0]["lr"] == pytest.approx(0.25)  # stepped after each optimizer step
    assert max(module.optimizer.grad_norms) <= 1e-3 * 1.0001  # clipped before each step

    class Epochly(Tiny):
        def configure_optimizers(self) -> Any:
            self.optimizer = CountingSGD(self.parameters(), lr=1.0)
            return [self.optimizer], [torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=1, gamma=0.5)]

    epochly = Epochly()
    vanilla_fit(epochly, tiny_loader(), max_epochs=3)
    assert epochly.optimizer.param_groups[0]["lr"] == pytest.approx(0.125)


def test_vanilla_fit_runs_the_step_under_autocast_for_mixed_precision() -> None:
    seen: list[bool] = []

    class Watching(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            try:
                seen.append(torch.is_autocast_enabled("cpu"))
            except TypeError:  # torch < 2.4
                seen.append(torch.is_autocast_cpu_enabled())
            return {"loss": super().training_step(batch, batch_idx)}

    vanilla_fit(Watching(), tiny_loader(), precision="bf16-mixed")
    assert seen and all(seen)


class Manual(Tiny):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class TwoOptimizers(Tiny):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.Adam(self.parameters())]


class NoLoss(Tiny):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return {"value": super().training_step(batch, batch_idx)}


@pytest.mark.parametrize(
    ("module", "loaders", "kwargs", "message"),
    [
        (Manual, tiny_loader, {}, "manual optimization"),
        (TwoOptimizers, tiny_loader, {}, "returned 2 optimizers"),
        (Tiny, lambda: [tiny_loader(), tiny_loader()], {}, "2 dataloaders at once"),
        (Tiny, tiny_loader, {"precision": "64-true"}, "precision='64-true' is not mirrored"),
        (NoLoss, tiny_loader, {}, "without a 'loss' key"),
    ],
)
def test_vanilla_fit_refuses_what_it_cannot_mirror(
    module: Any, loaders: Any, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(NotMirrored, match=message):
        vanilla_fit(module(), loaders(), **kwargs)


def test_a_vanilla_epoch_says_when_each_batch_begins() -> None:
    loop = VanillaLoop(Tiny(), tiny_loader(n=48))
    begun: list[int] = []
    loop.run_epoch(5, begun.append)
    assert begun == [0, 1, 2, 3, 4] and loop.batches == 5


def test_vanilla_fit_refuses_bad_arguments() -> None:
    with pytest.raises(UsageError, match="max_epochs must be an integer"):
        vanilla_fit(Tiny(), tiny_loader(), max_epochs=0)
    with pytest.raises(UsageError, match="limit_train_batches must be a batch count"):
        vanilla_fit(Tiny(), tiny_loader(), limit_train_batches=1.5)


# -- the max_overhead check on real (tiny) fits -------------------------------------------------


class Counter(pl.Callback):
    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.batches += 1


def test_check_times_copies_and_leaves_the_users_objects_alone(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    lock = str(tmp_path / "lock")
    monkeypatch.setenv(LOCK_ENV, lock)
    counter = Counter()
    model = Tiny()
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        trainer = tiny_trainer(tmp_path, callbacks=[counter], accumulate_grad_batches=2, gradient_clip_val=0.5)
        trainer.fit(model, tiny_loader())
        weights = model.layer.weight.detach().clone()
        rng = torch.get_rng_state()
    check = run.report["max_overhead"]
    assert check.status == "passed", check.summary
    fit = check.figures["fits"][0]
    assert fit["module"] == "Tiny" and fit["site"].endswith(
        f"test_max_overhead.py:{_line_of('trainer.fit(model, tiny_loader())')}"
    )
    assert fit["rounds"] >= 2 and fit["batches_per_epoch"] == 4 and fit["lock"] == lock  # 2: the early look
    assert check.figures["overhead"] == fit["overhead"] and len(fit["interval"]) == 2
    # The replay trained copies: the user's module, callback and random generator are as the fit left them.
    assert torch.equal(model.layer.weight, weights)
    assert counter.batches == 8
    assert torch.equal(torch.get_rng_state(), rng)
    assert model.optimizer.steps == 4  # accumulate_grad_batches=2 in the user's own fit


class Recorded(Tiny):
    """Every ``training_step`` and ``on_train_batch_start`` of the module and of the replay's copies (class-level
    lists).
    """

    steps: list[tuple[str, int, int]] = []
    starts: list[tuple[int, bool]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        # Lightning's copy has a trainer; the vanilla loop's runs training_step without one (pytorch-lightning
        # 1.x keeps it as ``trainer``).
        lightning = vars(self).get("_trainer", vars(self).get("trainer")) is not None
        type(self).steps.append(("L" if lightning else "V", self.current_epoch if lightning else -1, batch_idx))
        return super().training_step(batch, batch_idx)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        type(self).starts.append((self.current_epoch, "pytest_torchperf" in sys._getframe(1).f_code.co_filename))


def _replayed_epochs(steps: list[tuple[str, int, int]]) -> list[tuple[str, int]]:
    """(side, batches) of each epoch of the replay, in order (a vanilla epoch begins at batch 0)."""
    epochs: list[tuple[str, int]] = []
    key = None
    for side, epoch, batch_idx in steps:
        if (side, epoch) != key or batch_idx == 0:
            epochs.append((side, 0))
            key = (side, epoch)
        epochs[-1] = (side, epochs[-1][1] + 1)
    return epochs


@pytest.mark.parametrize("accumulate, warmup, timed", [(1, 4, 11), (3, 6, 12)])
def test_the_replays_warm_up_epoch_ends_after_a_few_batches_and_the_timed_epochs_after_about_half(
    tmp_path: Any, accumulate: int, warmup: int, timed: int
) -> None:
    Recorded.steps.clear()
    Recorded.starts.clear()
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path, accumulate_grad_batches=accumulate).fit(Recorded(), tiny_loader(n=8 * 21))
        assert len(Recorded.steps) == 42  # the user's own fit: 2 whole epochs of 21 batches
        Recorded.steps.clear()
        Recorded.starts.clear()
    fit = run.report["max_overhead"].figures["fits"][0]
    assert fit["verdict"] == "passed" and fit["batches_per_epoch"] == 21 and fit["timed_batches"] == timed
    epochs = _replayed_epochs(Recorded.steps)
    # The warm-up epoch trains `warmup` batches (whole accumulation windows), the vanilla loop warms up on 3;
    # then every timed epoch, the first round's vanilla one (run before its Lightning epoch) included, trains
    # about half of the 21 batches, in whole accumulation windows.
    assert epochs[:2] == [("L", warmup), ("V", 3)], epochs
    assert epochs[2:] and all(batches == timed for _, batches in epochs[2:]), epochs
    assert sum(side == "L" for side, _ in epochs[2:]) == fit["rounds"] == sum(side == "V" for side, _ in epochs[2:])
    # Lightning fetched one more batch of the warm-up (its hook ran) and trained none of it; torchperf's wrapper
    # of the hook is gone from the second epoch on.
    assert [wrapped for epoch, wrapped in Recorded.starts if epoch == 0] == [True] * (warmup + 1)
    assert {wrapped for epoch, wrapped in Recorded.starts if epoch > 0} == {False}


class BatchEndHook(Tiny):
    def on_train_batch_end(self, *args: Any) -> None:
        pass  # a hook the vanilla loop has no counterpart of: the profile counts its calls


def test_the_warm_ups_profile_leaves_out_its_first_batch_with_the_new_trainers_one_time_costs(tmp_path: Any) -> None:
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path).fit(BatchEndHook(), tiny_loader(n=8 * 21))
    fit = run.report["max_overhead"].figures["fits"][0]
    hooks = {h["name"]: h for h in fit["hooks"]}
    hook = next(h for name, h in hooks.items() if name.endswith("on_train_batch_end"))
    assert hook["calls"] == LIGHTNING_WARMUP_BATCHES - 1, hooks  # batches 2..4 of the warm-up


class EpochStartCost(Tiny):
    def on_train_epoch_start(self) -> None:
        spin(0.2)  # a per-epoch cost the vanilla loop has no counterpart of


def test_a_per_epoch_cost_counts_once_in_an_epoch_timed_over_half_its_batches(tmp_path: Any) -> None:
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path).fit(EpochStartCost(), tiny_loader(n=8 * 16))
    fit = run.report["max_overhead"].figures["fits"][0]
    assert (fit["timed_batches"], fit["batches_per_epoch"]) == (8, 16)
    # A Lightning epoch: the hook's 0.2 s once, plus 16 tiny batches; per batch it would be twice that and more.
    assert 0.19 < fit["candidate"]["median_s"] < 0.32, fit["candidate"]
    assert any(note.startswith("each timed epoch trained 8 of its 16 batches") for note in fit["notes"])


def test_a_warm_up_epoch_of_unknown_length_is_whole(tmp_path: Any) -> None:
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            g = torch.Generator().manual_seed(0)
            for _ in range(12):
                yield torch.randn(8, generator=g), torch.randn(1, generator=g)

    Recorded.steps.clear()
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path).fit(Recorded(), DataLoader(Stream(), batch_size=1))
        Recorded.steps.clear()
    assert run.report["max_overhead"].figures["fits"][0]["verdict"] == "passed"
    assert _replayed_epochs(Recorded.steps)[:2] == [("L", 12), ("V", 3)]


def test_a_cpu_fit_is_timed_with_one_thread_in_a_unit_load_cannot_inflate(tmp_path: Any) -> None:
    torch.set_num_threads(2)  # the user's fit runs with two threads (the autouse fixture restores the count)
    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path).fit(Tiny(), tiny_loader())
    fit = run.report["max_overhead"].figures["fits"][0]
    assert fit["threads"] == 1 and torch.get_num_threads() == 2
    assert fit["unit"] == (THREAD_TIME if cpu_wait() is not None else "wall time")
    assert any(
        note.startswith("your fit ran with 2 torch threads; both loops were timed with 1") for note in fit["notes"]
    )
    assert fit["verdict"] == "passed" and fit["status"] == "passed"


def _line_of(text: str) -> int:
    with open(__file__) as f:
        for number, line in enumerate(f, 1):
            if text in line and "_line_of" not in line:
                return number
    raise AssertionError(text)


def test_validation_is_left_out_of_the_timed_epochs(tmp_path: Any) -> None:
    class SlowValidation(Tiny):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            busy(0.15)  # ten times a tiny training epoch: it would dominate a timed epoch

    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        trainer = tiny_trainer(tmp_path, limit_val_batches=1, num_sanity_val_steps=0)
        trainer.fit(SlowValidation(), tiny_loader(), tiny_loader())
    fit = run.report["max_overhead"].figures["fits"][0]
    assert fit["candidate"]["median_s"] < 0.1, fit["candidate"]


def test_nested_runs_do_not_record_the_replay(tmp_path: Any) -> None:
    with watch(**ONLY_OVERHEAD) as outer:
        with watch(max_overhead="10000%", **ONLY_OVERHEAD) as inner:
            tiny_trainer(tmp_path).fit(Tiny(), tiny_loader())
        assert inner.report["max_overhead"].status == "passed"
    assert outer.steps == inner.steps == 8
    assert any("another torchperf run" in n for n in inner.report["max_overhead"].figures["fits"][0]["notes"])


def _refusal(run: Any) -> str:
    check = run.report["max_overhead"]
    assert check.status == "failed" and check.summary.startswith("cannot compare")
    return run.report.render()


def test_manual_optimization_is_refused_not_compared(tmp_path: Any) -> None:
    class ManualStep(Manual):
        def training_step(self, batch: Any, batch_idx: int) -> None:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(super().training_step(batch, batch_idx))
            opt.step()

    with pytest.raises(InvariantViolation) as info:
        with watch(max_overhead=0.5, **ONLY_OVERHEAD):
            tiny_trainer(tmp_path, max_epochs=1).fit(ManualStep(), tiny_loader())
    text = _refusal(info.value)
    assert "Trainer.fit(ManualStep) cannot be compared with a vanilla loop" in text
    assert "manual optimization" in text and "torchperf.parity(" in text


def test_trainer_built_outside_the_watch_is_refused(tmp_path: Any) -> None:
    trainer = tiny_trainer(tmp_path, max_epochs=1)
    with pytest.raises(InvariantViolation) as info:
        with watch(max_overhead=0.5, **ONLY_OVERHEAD):
            trainer.fit(Tiny(), tiny_loader())
    assert "built before torchperf started watching" in _refusal(info.value)


def test_fast_dev_run_is_refused(tmp_path: Any) -> None:
    with pytest.raises(InvariantViolation) as info:
        with watch(max_overhead=0.5, **ONLY_OVERHEAD):
            tiny_trainer(tmp_path, fast_dev_run=True).fit(Tiny(), tiny_loader())
    assert "fast_dev_run" in _refusal(info.value)


def test_two_training_dataloaders_are_refused_by_the_replay(tmp_path: Any) -> None:
    class TwoLoaders(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return super().training_step(batch[0], batch_idx)

    with pytest.raises(InvariantViolation) as info:
        with watch(max_overhead=0.5, **ONLY_OVERHEAD):
            tiny_trainer(tmp_path, max_epochs=1).fit(TwoLoaders(), [tiny_loader(), tiny_loader()])
    assert "the fit trains on 2 dataloaders at once" in _refusal(info.value)


def test_plateau_scheduler_is_noted_not_stepped(tmp_path: Any) -> None:
    class Plateau(Tiny):
        def configure_optimizers(self) -> Any:
            opt = torch.optim.SGD(self.parameters(), lr=0.01)
            plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": plateau, "monitor": "train_loss"}}

    with watch(max_overhead="10000%", **ONLY_OVERHEAD) as run:
        tiny_trainer(tmp_path).fit(Plateau(), tiny_loader())
    notes = run.report["max_overhead"].figures["fits"][0]["notes"]
    assert any(note.startswith("ReduceLROnPlateau is not stepped by the vanilla loop") for note in notes)


def test_no_fit_means_nothing_to_compare() -> None:
    with pytest.raises(InvariantViolation) as info:
        with watch(max_overhead=0.5, **ONLY_OVERHEAD):
            pass
    check = info.value.report["max_overhead"]
    assert check.summary == "no Trainer.fit to compare"
    assert "torchperf.parity(" in info.value.report.render()


def test_a_block_that_raises_is_not_timed(tmp_path: Any) -> None:
    class Broken(Tiny):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            raise ValueError("boom")

    started = time.perf_counter()
    with pytest.raises(ValueError, match="boom"):
        with watch(max_overhead=0.5, **ONLY_OVERHEAD) as run:
            tiny_trainer(tmp_path).fit(Broken(), tiny_loader())
    assert run.report["max_overhead"].status == "not checked"
    assert time.perf_counter() - started < 30


# -- through pytest, on the heavy workload -------------------------------------------------------

HEAVY = """
import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl

WIDTH, BATCH, BATCHES = 512, 256, 8  # about 15 ms of matrix work per step on one thread


def make_loader():
    g = torch.Generator().manual_seed(0)
    n = BATCH * BATCHES
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    return DataLoader(data, batch_size=BATCH)


class HeavyModule(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(4)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class SlowHookModule(HeavyModule):
    def on_train_batch_end(self, outputs, batch, batch_idx, *args):
        x, y = batch  # the step's matrix work once more: this hook is as slow as the step
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        torch.autograd.grad(loss, list(self.net.parameters()))


def make_trainer(tmp_path):
    return pl.Trainer(
        max_epochs=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
"""


@pytest.fixture
def heavy(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(overhead_models=HEAVY)
    pytester.syspathinsert()
    return pytester


def marked(source: str) -> str:
    """``source`` with ``OTHERS_OFF`` in its marker replaced by every other invariant switched off."""
    return textwrap.dedent(source).replace("OTHERS_OFF", ", ".join(f"{k}={v}" for k, v in ONLY_OVERHEAD.items()))


@pytest.mark.slow
def test_clean_heavy_fit_passes_a_generous_threshold(heavy: pytest.Pytester) -> None:
    source = """
        import pytest
        from overhead_models import HeavyModule, make_loader, make_trainer

        @pytest.mark.torchperf(max_overhead=1.0, OTHERS_OFF)
        def test_fit(tmp_path):
            make_trainer(tmp_path).fit(HeavyModule(), make_loader())
        """
    heavy.makepyfile(marked(source))
    result = heavy.runpytest("-v")  # a clean test is listed with its verdicts only under -v
    result.assert_outcomes(passed=1)
    result.stdout.re_match_lines([r".*max_overhead: passed \([+-]\d+\.\d% over vanilla loop \(95% CI .*\) < 100%\)"])


@pytest.mark.slow
def test_slow_hook_fails_at_30_percent_and_is_named_in_the_report(heavy: pytest.Pytester) -> None:
    source = """
        import pytest
        from overhead_models import SlowHookModule, make_loader, make_trainer

        @pytest.mark.torchperf(max_overhead=0.3, OTHERS_OFF)
        def test_fit(tmp_path):
            make_trainer(tmp_path).fit(SlowHookModule(), make_loader())
        """
    heavy.makepyfile(marked(source))
    result = heavy.runpytest()
    result.assert_outcomes(failed=1)
    hook_line = (
        HEAVY.strip().splitlines().index("    def on_train_batch_end(self, outputs, batch, batch_idx, *args):") + 1
    )
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: max_overhead (+*% over vanilla loop (95% CI *) > 30%)*",
            "*Trainer.fit(SlowHookModule): a Lightning epoch took * against * for the vanilla loop derived "
            "from SlowHookModule: +*%, more than max_overhead=30%",
            "*overhead +*% (the geometric mean of * rounds*), 95% interval *: entirely above the threshold 30%",
            "*Trainer.fit(SlowHookModule) called at "
            "test_slow_hook_fails_at_30_percent_and_is_named_in_the_report.py:6*",
            "where the extra * per batch went (8 batches per epoch*",
            "* per batch  SlowHookModule.on_train_batch_end (LightningModule hook)",
            f"*at overhead_models.py:{hook_line} ?your code?",
            "*hint: SlowHookModule.on_train_batch_end runs in the fit and has no counterpart in the vanilla loop*",
        ]
    )


def test_epochs_timed_over_half_their_batches_say_so_in_the_report_and_the_json(
    user_models: pytest.Pytester,
) -> None:
    source = """
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer


        @pytest.mark.torchperf(max_overhead=0.01, OTHERS_OFF)  # Lightning adds far more than 1% to its tiny step
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(TinyModule(), make_loader(num_workers=0, n=8 * 20))
        """
    pytester = user_models
    pytester.makepyfile(test_cut=marked(source))
    result = pytester.runpytest("--torchperf-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*each timed epoch trained 10 of its 20 batches and counts as the whole epoch: its time plus the other "
            "10 batches at the per-batch rate of its own batches 1 to 9 (both loops alike), so that per-epoch costs*",
        ]
    )
    doc = json.loads((pytester.path / "out.json").read_text())
    (fit,) = doc["tests"][0]["checks"]["max_overhead"]["figures"]["fits"]
    assert (fit["timed_batches"], fit["batches_per_epoch"]) == (10, 20)


def test_marker_rejects_a_bad_round_budget(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.torchperf(max_overhead=0.1, overhead_rounds=2)
        def test_fit():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*overhead_rounds must be an integer from 4 to 1000*got 2*"])


def test_callable_form_fails_the_test_with_the_torchperf_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        from pytest_torchperf import parity

        def test_loops():
            parity(lambda: 0.013, lambda: 0.010, max_overhead=0.2, names=("framework loop", "plain loop"))
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: max_overhead (+30.0% over plain loop (95% CI +28.3%..+31.8%, 4 rounds) > "
            "20%)*",
            "*framework loop took 13.0 ms per epoch vs 10.0 ms for plain loop: +30.0% (max_overhead 20%)*",
        ]
    )


def test_importing_the_package_does_not_import_torch() -> None:
    code = ("import sys, pytest_torchperf; pytest_torchperf.parity; pytest_torchperf.vanilla_fit; print('torch' in "
            "sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_math_helpers_agree_with_numpy_conventions() -> None:
    from pytest_torchperf.timing import quantile

    assert quantile([1, 2, 3, 4], 0.5) == 2.5
    assert quantile([1, 2, 3, 4], 0.25) == 1.75
    assert math.isclose(median([3.0, 1.0, 2.0]), 2.0)


def test_fixture_parity_fails_the_test_and_is_recorded(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_fixture_parity="""
        import time

        def test_slower(torchperf):
            torchperf.parity(lambda: time.sleep(0.02), lambda: time.sleep(0.01), max_overhead=0.2,
                             rounds=4, names=("my loop", "reference loop"))

        def test_within(torchperf):
            result = torchperf.parity(lambda: time.sleep(0.01), lambda: time.sleep(0.01), max_overhead=0.5, rounds=4)
            assert result.passed and result.rounds >= 2  # 2: the early look of a quiet machine
        """
    )
    result = pytester.runpytest("--torchperf-json=out.json")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: max_overhead (+*% over reference loop (95% CI *, * rounds) > 20%)*",
            "*- torchperf: max_overhead -*",
            "my loop took * per epoch vs * for reference loop: +*",
            "FAILED  test_fixture_parity.py::test_slower: max_overhead failed (+*% over reference loop*",
        ]
    )
    import json

    doc = json.loads((pytester.path / "out.json").read_text())
    runs = {t["nodeid"].split("::")[1]: t["runs"] for t in doc["tests"]}
    assert runs["test_slower"][0]["source"] == "parity"
    assert runs["test_slower"][0]["options"]["max_overhead"] == 0.2
    rounds = runs["test_slower"][0]["checks"]["max_overhead"]["figures"]["rounds"]
    assert rounds in (2, 4)  # 2: the early look on a quiet machine
    assert runs["test_within"][0]["checks"]["max_overhead"]["passed"] is True


STRADDLING = """
import itertools


def straddling():
    \"\"\"Epoch times whose ratios to 1.0 s straddle 30% after one warm-up round (for rounds=4).\"\"\"
    times = itertools.cycle([1.0, 1.1, 1.5, 1.5, 1.1])
    return lambda: next(times)


def test_session_default(torchperf):
    torchperf.parity(straddling(), lambda: 1.0, max_overhead=0.3, rounds=4)


def test_own_choice(torchperf):
    torchperf.parity(straddling(), lambda: 1.0, max_overhead=0.3, rounds=4, inconclusive="fail")
"""


def test_inconclusive_action_comes_from_the_command_line_over_the_ini_file(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_straddling=STRADDLING)
    pytester.makeini("[pytest]\ntorchperf_overhead_inconclusive = skip\n")
    skipped = pytester.runpytest("-rs", "--torchperf-json=out.json")
    skipped.assert_outcomes(skipped=1, failed=1)
    skipped.stdout.fnmatch_lines(
        [
            "*torchperf: inconclusive: max_overhead (+*% over baseline (95% CI *, 4 rounds) straddles 30%)*",
            "torchperf: 2 watched tests (1 skipped), no broken invariant; inconclusive: max_overhead in 2",
            "SKIPPED ?1? test_straddling.py:10: torchperf: inconclusive: max_overhead*",
        ]
    )
    import json

    doc = json.loads((pytester.path / "out.json").read_text())
    assert doc["summary"]["checks_inconclusive"] == {"max_overhead": 2} and doc["summary"]["checks_failed"] == {}
    outcomes = {t["nodeid"].split("::")[1]: (t["outcome"], t["checks"]["max_overhead"]["status"]) for t in doc["tests"]}
    assert outcomes == {
        "test_session_default": ("skipped", "inconclusive"),
        "test_own_choice": ("failed", "inconclusive"),
    }

    warned = pytester.runpytest("--torchperf-overhead-inconclusive=warn")
    warned.assert_outcomes(passed=1, failed=1, warnings=1)
    warned.stdout.fnmatch_lines(["*InconclusiveWarning: torchperf: inconclusive: max_overhead*passed with a warning*"])


@pytest.mark.parametrize(
    ("args", "ini", "message"),
    [
        (
            ["--torchperf-overhead-inconclusive=skp"],
            "",
            "*--torchperf-overhead-inconclusive: must be one of fail, skip, warn, got 'skp' (did you mean 'skip'?)*",
        ),
        (
            [],
            "torchperf_overhead_inconclusive = pass\n",
            "*ini option torchperf_overhead_inconclusive must be one of fail, skip, warn, got 'pass'*",
        ),
    ],
)
def test_a_wrong_inconclusive_action_is_a_usage_error(
    pytester: pytest.Pytester, args: list[str], ini: str, message: str
) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini("[pytest]\n" + ini)
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([message])


NOISY = '''
import itertools

import torch
from torch.utils.data import DataLoader, TensorDataset

try:
    import pytorch_lightning as pl
except ImportError:  # pragma: no cover
    import lightning.pytorch as pl

BATCHES = itertools.count()


def work(n):
    for _ in range(n):
        pass


class NoisyModule(pl.LightningModule):
    """Each batch does 1 or 20 units of work in a fixed pseudo-random pattern: epochs differ far more than
    Lightning adds (a fixed amount of work, so the pattern holds however loaded the machine is)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        work(400_000 if (next(BATCHES) * 2654435761) % 7 < 3 else 20_000)
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path):
    # Every fit replays the same pattern from its first batch: how many batches the tests before it ran
    # (their rounds end early once conclusive) does not change which of its epochs are heavy.
    global BATCHES
    BATCHES = itertools.count()
    g = torch.Generator().manual_seed(0)
    loader = DataLoader(TensorDataset(torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)), batch_size=8)
    trainer = pl.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(NoisyModule(), loader)
'''


@pytest.mark.slow
def test_a_real_fit_with_a_tiny_round_budget_is_inconclusive_and_the_marker_says_what_that_does(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(noisy_models=NOISY)
    pytester.syspathinsert()
    source = """
        import pytest
        from noisy_models import fit

        @pytest.mark.torchperf(max_overhead=0.5, overhead_rounds=4, OTHERS_OFF)
        def test_session_default(tmp_path):
            fit(tmp_path)

        @pytest.mark.torchperf(max_overhead=0.5, overhead_rounds=4, overhead_inconclusive="fail", OTHERS_OFF)
        def test_fail(tmp_path):
            fit(tmp_path)

        @pytest.mark.torchperf(max_overhead=0.5, overhead_rounds=4, overhead_inconclusive="warn", OTHERS_OFF)
        def test_warn(tmp_path):
            fit(tmp_path)
        """
    pytester.makepyfile(marked(source))
    pytester.makeini("[pytest]\ntorchperf_overhead_inconclusive = skip\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1, failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: inconclusive: max_overhead (+*% over vanilla loop (95% CI *, 4 rounds) straddles 50%)*",
            "Trainer.fit(NoisyModule): a Lightning epoch took * against * for the vanilla loop derived from "
            "NoisyModule: *; its 95% interval * includes max_overhead=50%, "
            "so it neither passes nor fails: inconclusive",
            "*hint: after 4 rounds the interval * still includes 50%: time more rounds for a narrower interval "
            "(overhead_rounds=4), set the threshold with a margin*",
            "where the extra * per batch went*",
            "*InconclusiveWarning: torchperf: inconclusive: max_overhead*",
            "SKIPPED*torchperf: inconclusive: max_overhead*",
        ]
    )
