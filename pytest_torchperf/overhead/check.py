"""The ``max_overhead`` verdict: per-run state, one outcome per observed fit, the check's result.

Events from the framework adapters record each fit of a framework whose adapter can replay it
(Lightning's ``Trainer.fit``)
(:class:`~.replay.ObservedFit`); after the run, :meth:`OverheadCheck.result`
replays each fit that the vanilla loop can mirror and compares the two.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from .. import frameworks
from ..clocks import perf_counter
from ..report import FAILED, INCONCLUSIVE, NOT_CHECKED, PASSED, CheckResult, Finding, Site
from ..stacks import Frame, Stack, capture
from ..timing import NotMirrored, ParityResult
from ..timing.stats import fmt_pct
from ..timing.stats import fmt_seconds as _seconds
from .attribution import attribution, where_finding
from .replay import (
    ObservedFit,
    config_refusals,
    copy_callbacks,
    mirrored_config,
    root_device,
    run_replay,
    snapshot,
)

if TYPE_CHECKING:
    from ..core import Run
    from ..frameworks._calls import FrameworkCall

NAME = "max_overhead"


class OverheadCheck:
    """Per-run state and verdict of ``max_overhead``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        self.run = run
        self.fits: list[ObservedFit] = []
        #: Training calls of other frameworks (``Trainer.train``...), which have no vanilla loop to time against.
        self.other_calls: list[str] = []

    # -- events -------------------------------------------------------------------
    def on_framework_call(self, call: FrameworkCall) -> None:
        replay = frameworks.adapter(call.framework).replay
        if replay is None:
            self.other_calls.append(f"{call.framework} {call.kind}()")
            return
        trainer, model = call.trainer, call.model
        if call.kind != "fit" or model is None:
            return
        fit = ObservedFit(
            index=len(self.fits) + 1,
            module_name=type(model).__name__,
            stack=capture(),
            trainer=trainer,
            package=call.package,
            call_args=call.args,
            call_kwargs=dict(call.kwargs),
            init=replay.init_args(trainer),
        )
        if fit.init is None:
            fit.refusals.append(
                "the Trainer was built before torchperf started watching (in a fixture or at module level?), "
                "so it cannot be rebuilt for the timing replay; build it inside the watched test body or "
                "`torchperf.watch()` block"
            )
        elif not replay.rebuildable(trainer):
            fit.refusals.append(
                f"the Trainer is a {type(trainer).__name__} with its own __init__; the timing replay can only "
                "rebuild it from Trainer's own arguments"
            )
        try:
            fit.snapshot = snapshot(model, trainer)
        except Exception as exc:  # noqa: BLE001 - any failure to copy is a reason to refuse, not to crash
            fit.refusals.append(
                f"the module could not be deep-copied before the fit ({type(exc).__name__}: {exc}), "
                "so neither loop can start from its initial weights"
            )
        if fit.init is not None:
            fit.callbacks = copy_callbacks(fit.init, trainer, model)
        self.fits.append(fit)

    def on_framework_call_end(self, call: FrameworkCall) -> None:
        trainer, model = call.trainer, call.model
        if call.kind != "fit" or frameworks.adapter(call.framework).replay is None:
            return
        fit = next((f for f in reversed(self.fits) if f.trainer is trainer and not f.ended), None)
        if fit is None:
            return
        fit.ended = True
        status = getattr(getattr(trainer, "state", None), "status", None)
        fit.finished = str(getattr(status, "value", status)) == "finished"
        fit.refusals.extend(config_refusals(trainer, model))
        fit.mirror = mirrored_config(trainer)
        max_steps = getattr(trainer, "max_steps", None)
        per_epoch = getattr(trainer, "num_training_batches", None)
        if isinstance(per_epoch, int):
            fit.epoch_batches = per_epoch
        if isinstance(max_steps, int) and max_steps > 0 and isinstance(per_epoch, int) and max_steps < per_epoch:
            fit.batches_cap = fit.epoch_batches = max_steps  # the user's fit never ran a full epoch: time its length
        fit.device = root_device(trainer)

    # -- verdict --------------------------------------------------------------------
    def result(self) -> CheckResult:
        try:
            return self._result()
        finally:
            for fit in self.fits:
                fit.release()

    def _result(self) -> CheckResult:
        if sys.exc_info()[1] is not None:
            # Called while the watched block's own exception propagates: that is the test's failure.
            return CheckResult(NAME, NOT_CHECKED, "not timed: the watched block raised", figures={"fits": []})
        if not self.fits and self.other_calls:
            return CheckResult(NAME, NOT_CHECKED, (
                f"{self.other_calls[0]} ran, and max_overhead times only Lightning's Trainer.fit against its "
                "vanilla loop; to time a loop of your own, use torchperf.parity(candidate, baseline, max_overhead=...)"
            ), figures={"fits": []})
        if not self.fits:
            finding = Finding(
                "max_overhead compares a Lightning Trainer.fit with its vanilla loop, and no fit ran while watching",
                hint="call trainer.fit(...) inside the test body (or the `torchperf.watch()` block); "
                "to compare loops of your own, use torchperf.parity(candidate, baseline, max_overhead=...)",
            )
            return CheckResult(NAME, FAILED, "no Trainer.fit to compare", 1, [finding], {"fits": []})
        outcomes = [self._check_fit(fit) for fit in self.fits]
        figures: dict[str, Any] = {"fits": [o.figures for o in outcomes]}
        exceeded = [o for o in outcomes if o.status == "exceeded"]
        refused = [o for o in outcomes if o.status == "refused"]
        unsure = [o for o in outcomes if o.status == INCONCLUSIVE]
        timed = [o for o in outcomes if o.parity is not None]
        if timed:
            worst = max(timed, key=lambda o: o.parity.overhead)  # type: ignore[union-attr]
            figures.update(
                {
                    "overhead": worst.parity.overhead,  # type: ignore[union-attr]
                    "interval": list(worst.parity.interval),  # type: ignore[union-attr]
                    "max_overhead": self.run.options.max_overhead,
                }
            )
        many = len(outcomes) > 1
        findings = [f for o in outcomes for f in o.findings]
        if exceeded or refused:
            first = (exceeded or refused)[0]
            summary = first.summary + (f" ({first.fit.label} #{first.fit.index} of {len(outcomes)})" if many else "")
            return CheckResult(NAME, FAILED, summary, len(exceeded) + len(refused), findings, figures)
        if unsure:
            first = unsure[0]
            summary = first.summary + (f" ({first.fit.label} #{first.fit.index} of {len(outcomes)})" if many else "")
            return CheckResult(NAME, INCONCLUSIVE, summary, 0, findings, figures)
        summary = worst.summary if timed else "no fit was timed"  # type: ignore[possibly-undefined,unused-ignore]
        if many:
            summary += f" (worst of {len(outcomes)} fits)"
        return CheckResult(NAME, PASSED, summary, 0, [], figures)

    def _check_fit(self, fit: ObservedFit) -> _Outcome:
        site = Site(f"{fit.label} called", fit.stack)
        base = {"fit": fit.index, "module": fit.module_name, "site": site.frame.location() if site.frame else None}
        if not fit.finished:
            fit.refusals.insert(
                0, "the fit did not finish (it raised or was interrupted), so there is nothing to replay"
            )
        if fit.refusals:
            return _refusal(fit, site, fit.refusals, base)
        options = self.run.options
        started = perf_counter()
        try:
            replay = run_replay(fit, options.max_overhead, options.overhead_rounds)
        except NotMirrored as exc:
            return _refusal(fit, site, [str(exc)], base)
        except Exception as exc:  # noqa: BLE001 - the replay runs the user's code: report, don't crash
            frames = _traceback_stack(exc)
            sites = [site] + ([Site(f"{type(exc).__name__} raised here", frames)] if frames else [])
            reason = f"the timing replay of the fit raised {type(exc).__name__}: {exc}"
            return _refusal(fit, site, [reason], base, sites=sites)
        seconds = perf_counter() - started
        parity = replay.parity
        hooks = attribution(replay)
        figures = dict(base)
        figures.update(parity.to_dict())
        figures.update(
            {
                "status": parity.verdict,
                "batches_per_epoch": replay.batches,
                "timed_batches": replay.timed_batches,
                "hooks": [h.to_dict() for h in hooks],
                "check_seconds": seconds,
            }
        )
        summary = parity.summary()
        if parity.verdict == PASSED:
            return _Outcome(fit, "passed", summary, [], figures, parity)
        facts = parity.facts() + [
            f"the timed fit replays yours from the same initial weights, with {', '.join(replay.excluded)} off "
            "(the vanilla loop has none of them)",
        ]
        took = (
            f"{fit.label}: a Lightning epoch took {_seconds(parity.candidate.median)} against "
            f"{_seconds(parity.baseline.median)} for the vanilla loop derived from {fit.module_name}: "
            f"{parity.overhead:+.1%}"
        )
        if parity.verdict == FAILED:
            title = f"{took}, more than max_overhead={parity.max_overhead:.0%}"
            findings = [Finding(title, facts, [site]), where_finding(replay, hooks)]
            return _Outcome(fit, "exceeded", summary, findings, figures, parity)
        lo, hi = parity.interval
        title = (
            f"{took}; its 95% interval {fmt_pct(lo)}..{fmt_pct(hi)} includes max_overhead={parity.max_overhead:.0%}, "
            "so it neither passes nor fails: inconclusive"
        )
        findings = [Finding(title, facts, [site], parity.inconclusive_hint()), where_finding(replay, hooks)]
        return _Outcome(fit, INCONCLUSIVE, summary, findings, figures, parity)


@dataclass
class _Outcome:
    fit: ObservedFit
    status: str  # "passed", "exceeded", "inconclusive", "refused"
    summary: str
    findings: list[Finding]
    figures: dict[str, Any]
    parity: Optional[ParityResult] = None


def _refusal(
    fit: ObservedFit, site: Site, reasons: list[str], base: dict[str, Any], sites: Optional[list[Site]] = None
) -> _Outcome:
    title = f"{fit.label} cannot be compared with a vanilla loop, so max_overhead was not measured"
    facts = [f"- {r}" for r in reasons]
    hint = (
        "time a configuration the vanilla loop mirrors in this test (one device, one optimizer, automatic "
        "optimization), or compare two loops of your own with torchperf.parity(candidate, baseline, max_overhead=...)"
    )
    figures = dict(base)
    figures.update({"status": "cannot compare", "reasons": list(reasons)})
    summary = f"cannot compare: {reasons[0]}"
    return _Outcome(fit, "refused", summary, [Finding(title, facts, sites or [site], hint)], figures)



def _traceback_stack(exc: BaseException) -> Stack:
    return tuple(Frame(fs.filename, fs.lineno or 0, fs.name) for fs in traceback.extract_tb(exc.__traceback__))
