"""Invariant ``max_data_wait=F``: the training loop spends at most this share of its time waiting for batches.

The wait is the time the training process spends inside the DataLoader
iterator's ``__next__`` (:mod:`pytest_torchperf.probes.batches`): the hand-off
from the workers, or, with ``num_workers=0``, the loading and collating itself,
measured with the time in the dataset's ``__getitem__`` and in ``collate_fn``.
The loop's time is the time from one batch's delivery to the next; the first
batch of each pass (a worker pool starting, the sampler's first indices) is
left out of both and reported apart. Only the loaders that feed training are
judged: Lightning's training stage, or, in a plain loop, a loader between
whose batches a ``run.step()`` ran.

A CPU step is much slower than the same step on a GPU, so a loader that keeps
up with it on CPU-only CI may starve the GPU. ``target_step_time="5ms"`` (the
step the user expects on the accelerator) judges the loader's measured rate
against that step: the batches per second it can deliver (with workers: from
the workers' own time per batch, measured in the workers forked while
watched) against the ``1 / step`` the step needs, and the wait that step would
see against ``max_data_wait``. Without it the run is judged against its own
step time, and the report says so.
"""

from __future__ import annotations

from time import perf_counter as _perf_counter
from typing import TYPE_CHECKING, Any, Optional, TypedDict

from ..arguments import Argument
from ..core import Check
from ..durations import Duration, Share, seconds
from ..durations import format_seconds as fmt
from ..probes import cuda_available
from ..probes.batches import LoaderInfo, Pass
from ..registry import Invariant
from ..report import FAILED, NOT_CHECKED, PASSED, CheckResult, Finding
from ..text import plural
from ._data_wait import LoaderWait, percent
from ._loaders import loader_site

if TYPE_CHECKING:
    from ..core import Run

NAME = "max_data_wait"


class DataWaitCheck(Check):
    """Per-run state and verdict of ``max_data_wait``."""

    name = NAME

    def __init__(self, run: Run) -> None:
        super().__init__(run)
        self.limit = float(run.options.max_data_wait)
        self.target_text: Optional[str] = run.options.target_step_time
        self.target = seconds(self.target_text)
        self.batches = run.probe("batches")
        self.log = run.probe("loaders").log_for(run, batches=True)
        self.seen = self.batches.every_batch_for(run)
        self.started = _perf_counter()

    # -- which passes count -------------------------------------------------------------
    def _training(self) -> tuple[dict[int, tuple[LoaderInfo, list[Pass]]], bool]:
        """Loader id -> (its info, its training passes); and whether no step was seen (all loaders judged)."""
        chosen: dict[int, tuple[LoaderInfo, list[Pass]]] = {}
        for info, p in self.seen:
            if p.sanity:
                continue
            if p.label.startswith("pass "):  # outside Lightning: the loader fed run.step() blocks
                rec = self.log.records.get(info.key)
                if rec is None or not rec.feeds_steps:
                    continue
            elif not p.training:
                continue
            chosen.setdefault(info.key, (info, []))[1].append(p)
        if chosen:
            return chosen, False
        for info, p in self.seen:  # no step marked: every loader iterated, if any delivered batches
            if not p.sanity and p.batches:
                chosen.setdefault(info.key, (info, []))[1].append(p)
        return chosen, True

    def _wait(self, info: LoaderInfo, passes: list[Pass]) -> tuple[LoaderWait, list[Any]]:
        rec = self.log.records.get(info.key)
        sites = loader_site(rec) if rec is not None else []
        mine = [f for f in (rec.site if rec is not None else None) or () if f.is_user]
        where = mine[-1].location() if mine else None
        fields = f"num_workers={info.num_workers}"
        if info.num_workers:
            fields += f", persistent_workers={info.persistent}"
        description = (
            f"{info.loader_type}(dataset={info.dataset_type}, batch_size={info.batch_size!r}, {fields})"
            + (f" (built at {where})" if rec is not None and rec.created is not None and where else
               f" (first iterated at {where})" if where else "")
        )
        return LoaderWait(info, passes, description, where, self.batches), sites

    # -- verdict --------------------------------------------------------------------------
    def _judge(self, w: LoaderWait) -> tuple[bool, Optional[float], str]:
        """(broken, the share judged, why it is not checked or ``""``)."""
        if self.target is None:
            return w.share > self.limit, w.share, ""
        rate, how = w.rate()
        predicted = w.predicted(self.target)
        if rate is None:
            return False, None, "no batch after the first was timed"
        if predicted is None:
            return False, None, (
                f"{w.untimed}: their time per batch was not measured, and the loader only had to keep up with "
                f"this run's step (at least {rate:.0f} batches/s delivered; {1 / self.target:.0f}/s needed)"
            )
        return rate * self.target < 1 or predicted > self.limit, predicted, ""

    def _facts(self, w: LoaderWait, judged: Optional[float]) -> list[str]:
        passes = plural(len(w.passes), "pass", "passes")
        firsts = w.first_batch
        first = f"; first batch of each pass: {fmt(firsts)} (median), not counted" if firsts is not None else ""
        facts = [f"measured over {plural(w.batches, 'batch', 'batches')} in {passes}{first}"]
        facts.extend(w.where_it_went())
        rate, how = w.rate()
        if w.workers and w.worker_s is not None:
            facts.append(f"each of its {plural(w.workers, 'worker')} takes {fmt(w.worker_s)} per batch "
                         f"(measured in the workers, {plural(w.worker_batches, 'batch', 'batches')})")
        elif w.workers:
            facts.append(f"its workers' own time per batch was not measured ({w.untimed})")
        step = f"{fmt(w.step)} per batch"
        if self.target is None:
            facts.append(
                f"judged against this run's own step ({step} between batches, on this machine): a faster step "
                "on an accelerator waits longer; target_step_time='5ms' judges the loader against the step you "
                "expect there"
            )
        elif rate is not None:
            need = 1 / self.target
            bound = "input-bound" if rate < need else "keeps up"
            at_least = "at least " if how == "at least" else ""
            facts.append(
                f"this loader delivers {at_least}{rate:.0f} batches/s; a {fmt(self.target)} step needs {need:.0f}/s: "
                f"{bound} (target_step_time={self.target_text!r}; this run's own step: {step})"
            )
            if judged is not None:
                facts.append(f"with that step the loop would wait {percent(judged)} of its time")
        return facts

    def _title(self, w: LoaderWait, share: Optional[float]) -> str:
        if self.target is None:
            return (
                f"{w.description} kept the training loop waiting {percent(w.share)} of its time "
                f"(max_data_wait={self.limit:g}): {fmt(w.wait)} per batch"
            )
        rate, _ = w.rate()
        need = 1 / self.target
        would = f"with a {fmt(self.target)} step the loop would wait {percent(share or 0.0)} of its time"
        if rate is not None and rate < need:
            return (
                f"{w.description} cannot feed a {fmt(self.target)} step (target_step_time={self.target_text!r}): "
                f"it delivers {rate:.0f} batches/s, the step needs {need:.0f}/s; {would} "
                f"(max_data_wait={self.limit:g})"
            )
        return f"{w.description}: {would} (max_data_wait={self.limit:g}), {fmt(w.wait)} per batch"

    def result(self) -> CheckResult:
        chosen, unmarked = self._training()
        waits = [self._wait(info, passes) for info, passes in chosen.values()]
        waits = [(w, s) for w, s in waits if w.batches > 0]
        figures: Figures = {
            "max_data_wait": self.limit,
            "target_step_s": self.target,
            "data_wait": None,
            "first_batch_s": None,
            "batches_per_s": None,
            "loaders": [w.to_dict(self.target) for w, _ in waits],
        }
        if not waits:
            why = (
                "no DataLoader fed a training step with more than one batch in a pass"
                if chosen or not unmarked else "no DataLoader was iterated for more than one batch in a pass"
            )
            return CheckResult(NAME, NOT_CHECKED, why, figures=figures)
        judged = [(w, s) + self._judge(w) for w, s in waits]
        worst = max(judged, key=lambda j: (j[2], j[3] if j[3] is not None else -1.0))
        w = worst[0]
        rate, _ = w.rate()
        figures.update({
            "data_wait": round(w.share, 4),
            "first_batch_s": round(w.first_batch, 4) if w.first_batch is not None else None,
            "batches_per_s": round(rate, 1) if rate is not None else None,
        })
        if unmarked:
            figures["judged"] = "every loader iterated (no training step was marked)"
        cuda = cuda_available()
        broken = [j for j in judged if j[2]]
        against = f"a {fmt(self.target)} step" if self.target is not None else "this run's step"
        if broken:
            findings = []
            for lw, sites, _, share, _ in broken:
                judged_share = share if share is not None else lw.share
                hint = lw.hint(cuda, judged_share, self.target)
                findings.append(Finding(self._title(lw, share), self._facts(lw, share), sites, hint))
            first_broken = broken[0][0]
            share = broken[0][3] if broken[0][3] is not None else first_broken.share
            delivered, _ = first_broken.rate()
            if self.target is None:
                detail = f"{fmt(first_broken.wait)} per batch" + (
                    f", {delivered:.0f} batches/s" if delivered is not None else "")
            else:
                detail = (f"{delivered:.0f} batches/s delivered, " if delivered is not None else "") + (
                    f"{1 / self.target:.0f}/s needed")
            summary = (
                f"{plural(len(broken), 'training DataLoader')} kept the loop waiting: {percent(share)} > "
                f"{percent(self.limit)} against {against} ({detail})"
            )
            return CheckResult(NAME, FAILED, summary, len(broken), findings, figures)
        unchecked = [j for j in judged if j[4]]
        if unchecked and len(unchecked) == len(judged):
            return CheckResult(NAME, NOT_CHECKED, unchecked[0][4], figures=figures)
        share = worst[3] if worst[3] is not None else w.share
        first = f", first batch {fmt(w.first_batch)}" if w.first_batch is not None else ""
        summary = (
            f"data wait {percent(share)} of the loop against {against} (max {percent(self.limit)}): "
            f"{fmt(w.wait)} per batch{first}" + (f", {rate:.0f} batches/s" if rate is not None else "")
        )
        return CheckResult(NAME, PASSED, summary, 0, [], figures)


class Figures(TypedDict, total=False):
    """The figures of a max_data_wait verdict (see :mod:`pytest_torchperf.figures`)."""

    max_data_wait: float
    target_step_s: Optional[float]
    data_wait: Optional[float]
    first_batch_s: Optional[float]
    batches_per_s: Optional[float]
    loaders: list[dict[str, Any]]
    judged: str


INVARIANT = Invariant(
    name=NAME,
    doc="the training loop waits for its DataLoader's next batch at most this share of its time (e.g. 0.2)",
    check=DataWaitCheck,
    figures=Figures,
    kind=Share(optional=True),
    default=None,
    arguments=(
        Argument(
            "target_step_time",
            Duration(),
            None,
            "the step time expected on the accelerator ('5ms'): the loader's measured rate is judged against it "
            "instead of this run's own (CPU) step",
            meaning="the training step's expected duration",
        ),
    ),
    probes=("loaders", "batches"),
    meaning="a share of the training loop's time: 0.2 means 20%",
)
