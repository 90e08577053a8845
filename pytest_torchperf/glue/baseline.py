"""The baseline ratchet: findings a suite already has are *known* and do not fail; new ones do.

pytest-free. A watched run's :class:`~pytest_torchperf.report.Report` becomes a
list of :class:`Observation` (one per broken invariant and *site*); a baseline
file holds, per test, the observations that were accepted. :func:`compare`
matches one test's observations against its baseline entries:

- **known**: same test, invariant and site, and a figure not higher than the
  baseline's (the per-step rate for the invariants whose cost is a rate, the
  count for the others);
- **higher**: the same site, a higher rate or count: fails, naming both figures;
- **new**: a site (or a broken invariant) the baseline does not have: fails;
- **stale**: a baseline entry nothing matched: the finding went away.

A *site* is the finding's first site, the frame the report points at: its file
as reports show it (relative to pytest's rootdir for your code, to
site-packages for a library), its function and its source line, with comments
and extra spaces dropped. The line number is only a hint: it picks between two
entries with the same source text in one function, so unrelated edits that
move a line do not churn the file. A finding without a site (an overhead
verdict) is keyed by its invariant alone.

The file is JSON, sorted, with no timestamp, so a refresh that changes nothing
rewrites nothing and a review diff shows exactly what was accepted::

    {
      "schema": "pytest-torchperf baseline",
      "schema_version": 1,
      "tests": {
        "tests/test_fit.py::test_fit": [
          {"invariant": "no_host_sync", "file": "tests/models.py", "function": "training_step",
           "source": "if loss.item() > 100:", "line": 53, "label": "`.item()`",
           "count": 24, "per_step": 1.0}
        ]
      }
    }
"""

from __future__ import annotations

import io
import json
import os
import tokenize
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..report import FAILED, Finding, InvariantViolation, Report

__all__ = [
    "SCHEMA",
    "SCHEMA_VERSION",
    "RATE_FIGURES",
    "BaselineError",
    "Observation",
    "Entry",
    "Match",
    "Comparison",
    "Baseline",
    "KnownFindingsViolation",
    "observe",
    "compare",
    "merge_observations",
    "normalise_source",
]

SCHEMA = "pytest-torchperf baseline"
SCHEMA_VERSION = 1

#: Invariants whose figure is a rate: the site's count divided by this figure of the check
#: (``steps`` is the checked unit: training steps, or batches for ``scope="batch"``).
RATE_FIGURES = {
    "no_host_sync": "steps",
    "on_device": "steps",
    "no_empty_cache": "steps",
    "grads_set_to_none": "optimizer_steps",
}

#: A check's figure holding entries it counted itself (``max_ops_per_step``, ``max_collectives_per_step`` with
#: ``"baseline"``): one per op and device, or per collective and site, each with its count per step. Those
#: entries are the check's observations, whatever its findings say.
COUNTED_FIGURE = "baseline_counts"

#: Findings with these title prefixes are notes on a failed check, not what failed it (``where the extra``:
#: max_overhead's breakdown of the time its verdict finding reports, which has no site of its own).
_NOT_FAILING = ("note: ", "allowed: ", "where the extra ")
#: Two rates closer than this are equal (they are ratios of small integers).
_EPSILON = 1e-9


class BaselineError(ValueError):
    """The baseline file cannot be read: missing, not JSON, or not a torchperf baseline."""


def normalise_source(source: str) -> str:
    """A source line as matching sees it: no trailing comment, single spaces."""
    text = source.strip()
    if "#" in text:
        try:
            for token in tokenize.generate_tokens(io.StringIO(text + "\n").readline):
                if token.type == tokenize.COMMENT:
                    text = text[: token.start[1]]
                    break
        except (tokenize.TokenError, IndentationError, SyntaxError):
            pass  # half a statement (an open bracket or string): keep it whole
    return " ".join(text.split())


@dataclass
class Observation:
    """One broken invariant at one site of one watched run: what the baseline stores and compares."""

    invariant: str
    file: str = ""
    function: str = ""
    source: str = ""
    line: int = 0
    label: str = ""
    count: int = 0
    per_step: Optional[float] = None
    #: The finding's title, for messages (not stored in the baseline).
    title: str = ""
    #: The innermost frame of your code that led there, for annotations: (absolute file, line, function).
    user_frame: Optional[tuple[str, int, str]] = None

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.invariant, self.file, self.function, normalise_source(self.source))

    @property
    def counted(self) -> bool:
        """A counted thing with no site of its own (an op on a device): keyed by ``function`` and ``source``."""
        return not self.file and bool(self.function)

    @property
    def where(self) -> str:
        if self.counted:
            return f"{self.function} on {self.source}"
        if not self.file:
            return "(no site)"
        return f"{self.file}:{self.line} in {self.function}"

    def figure(self) -> str:
        if self.per_step is not None:
            return f"{_number(self.per_step)} per step"
        return f"{self.count}x"

    def describe(self) -> str:
        if self.counted:
            origin = f", {self.label}" if self.label else ""
            return f"{self.invariant}: {self.where}: {self.figure()}{origin}"
        what = self.label or self.title or self.invariant
        return f"{self.invariant}: {what} at {self.where}, {self.figure()}"

    def to_entry(self) -> dict[str, Any]:
        entry: dict[str, Any] = {
            "invariant": self.invariant,
            "file": self.file,
            "function": self.function,
            "source": self.source,
            "line": self.line,
            "label": self.label,
            "count": self.count,
        }
        if self.per_step is not None:
            entry["per_step"] = self.per_step
        return entry

    def to_dict(self) -> dict[str, Any]:
        data = self.to_entry()
        data["title"] = self.title
        data["user_frame"] = list(self.user_frame) if self.user_frame else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Observation:
        frame = data.get("user_frame")
        per_step = data.get("per_step")
        return cls(
            invariant=str(data["invariant"]),
            file=str(data.get("file") or ""),
            function=str(data.get("function") or ""),
            source=str(data.get("source") or ""),
            line=int(data.get("line") or 0),
            label=str(data.get("label") or ""),
            count=int(data.get("count") or 0),
            per_step=float(per_step) if per_step is not None else None,
            title=str(data.get("title") or ""),
            user_frame=(str(frame[0]), int(frame[1]), str(frame[2])) if frame else None,
        )


#: A baseline entry has the fields of an observation (without title and user frame).
Entry = Observation


def _number(value: float) -> str:
    return f"{value:.3f}".rstrip("0").rstrip(".") if value != int(value) else str(int(value))


def _split_location(location: Optional[str]) -> tuple[str, int]:
    if not location:
        return "", 0
    path, _, line = location.rpartition(":")
    if not path or not line.isdigit():
        return location, 0
    return path, int(line)


def observe(report: Report) -> list[Observation]:
    """The findings that broke ``report``'s invariants, one :class:`Observation` per invariant and site.

    Findings of one check at the same site add up (two loaders built by one
    helper line are one site seen twice). A failed check without a finding
    with a site is one observation keyed by the invariant alone.
    """
    observations: list[Observation] = []
    for name, check in report.checks.items():
        if check.status != FAILED:
            continue
        counted = check.figures.get(COUNTED_FIGURE)
        if isinstance(counted, list):
            observations.extend(Observation.from_dict(entry) for entry in counted if isinstance(entry, dict))
            continue
        steps = check.figures.get(RATE_FIGURES.get(name, ""), None)
        steps = steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else None
        by_key: dict[tuple[Any, ...], Observation] = {}
        for finding in check.findings:
            if finding.title.startswith(_NOT_FAILING):
                continue
            site = finding.sites[0] if finding.sites else None
            frame = site.frame if site is not None else None
            if frame is None or site is None:
                obs = Observation(name, title=finding.title, count=check.count)
            else:
                path, line = _split_location(frame.location())
                user = frame if frame.is_user else next((f for f in reversed(site.stack) if f.is_user), None)
                obs = Observation(
                    name,
                    file=path,
                    function=frame.function,
                    source=frame.source,
                    line=line,
                    label=site.label,
                    count=site.count,
                    title=finding.title,
                    user_frame=(user.filename, user.lineno, user.function) if user is not None else None,
                )
            key = (obs.key, obs.line)
            if key in by_key:
                by_key[key].count += obs.count
            else:
                by_key[key] = obs
        if not by_key:
            by_key[("",)] = Observation(name, title=check.summary, count=check.count)
        for obs in by_key.values():
            if steps is not None and obs.file:
                obs.per_step = round(obs.count / steps, 6)
            observations.append(obs)
    return observations


def merge_observations(observations: Iterable[Observation]) -> list[Observation]:
    """One observation per site over a test's runs: the highest count and rate of any run."""
    merged: dict[tuple[Any, ...], Observation] = {}
    for obs in observations:
        key = (obs.key, obs.line)
        current = merged.get(key)
        if current is None:
            merged[key] = Observation(**{f: getattr(obs, f) for f in obs.__dataclass_fields__})
            continue
        current.count = max(current.count, obs.count)
        if obs.per_step is not None:
            current.per_step = max(current.per_step or 0.0, obs.per_step)
    return sorted(merged.values(), key=lambda o: (o.key, o.line))


@dataclass
class Match:
    """An observation and the baseline entry it matched (None: new)."""

    observation: Observation
    entry: Optional[Entry]

    @property
    def status(self) -> str:
        if self.entry is None:
            return "new"
        return "higher" if _higher(self.observation, self.entry) else "known"

    def describe(self) -> str:
        obs, entry = self.observation, self.entry
        status = self.status
        if status == "new":
            if obs.counted:
                origin = f", {obs.label}" if obs.label else ""
                return f"new: {obs.invariant}: {obs.where}: 0 -> {obs.figure()}{origin} (not in the baseline)"
            return f"new: {obs.describe()} (not in the baseline)"
        assert entry is not None
        moved = f", was line {entry.line}" if entry.line != obs.line and obs.file else ""
        if obs.counted:
            origin = f", {obs.label}" if obs.label else ""
            before = _number(entry.per_step) if entry.per_step is not None else entry.figure()
            change = f"{before} -> {obs.figure()}"
            word = status if status != "known" or not self.lower else "lower"
            tail = " (--torchperf-baseline-update lowers the baseline)" if word == "lower" else ""
            return f"{word}: {obs.invariant}: {obs.where}: {change}{origin}{tail}"
        if status == "higher":
            return f"higher: {obs.describe()} (baseline: {entry.figure()}{moved})"
        return f"known: {obs.describe()} (baseline: {entry.figure()}{moved})"

    @property
    def growth(self) -> float:
        """How much a counted figure grew against the baseline (a new one: all of it); 0 when not counted."""
        obs, entry = self.observation, self.entry
        if obs.per_step is None:
            return 0.0
        before = entry.per_step if entry is not None and entry.per_step is not None else 0.0
        return obs.per_step - before

    @property
    def lower(self) -> bool:
        """Matched, with a figure below the baseline's: the update would lower the entry."""
        obs, entry = self.observation, self.entry
        if entry is None or obs.per_step is None or entry.per_step is None or not obs.counted:
            return False
        return obs.per_step < entry.per_step - _EPSILON


def _higher(obs: Observation, entry: Entry) -> bool:
    if obs.per_step is not None and entry.per_step is not None:
        return obs.per_step > entry.per_step + _EPSILON
    return obs.count > entry.count


@dataclass
class Comparison:
    """One test's observations against its baseline entries."""

    matches: list[Match] = field(default_factory=list)
    stale: list[Entry] = field(default_factory=list)

    @property
    def failing(self) -> list[Match]:
        """What the baseline does not know; a counted invariant's (an op's count) by how much each grew, the
        largest first, so that the headline leads with what changed (not with the most frequent op)."""
        failing = [m for m in self.matches if m.status != "known"]
        first: dict[str, int] = {}
        for i, m in enumerate(failing):
            first.setdefault(m.observation.invariant, i)
        return sorted(failing, key=lambda m: (first[m.observation.invariant], -m.growth))

    def rank_findings(self, report: Report) -> None:
        """Rank the findings of ``report``'s counted checks (``max_ops_per_step``'s ops) by what changed against
        the baseline: those whose count grew or is new, the largest growth first, each title saying the
        baseline's figure; those the baseline knows at their count are left out (the baseline's lines list
        them as known)."""
        changed: dict[tuple[str, str, str], Match] = {}
        for m in self.failing:
            obs = m.observation
            if obs.counted:
                changed.setdefault((obs.invariant, obs.function, obs.source), m)
        for name, check in report.checks.items():
            if not isinstance(check.figures.get(COUNTED_FIGURE), list):
                continue
            ranked: list[tuple[float, int, Finding]] = []
            for i, finding in enumerate(check.findings):
                title = finding.title
                match = next(
                    (m for (inv, op, device), m in changed.items()
                     if inv == name and title.startswith(f"{op}: ") and title.endswith(f" on {device}")),
                    None,
                )
                if match is None:
                    continue
                entry = match.entry
                finding.title += f" (baseline: {entry.figure()})" if entry is not None else " (not in the baseline)"
                ranked.append((-match.growth, i, finding))
            if ranked:
                check.findings = [f for _, _, f in sorted(ranked, key=lambda t: (t[0], t[1]))]

    @property
    def known(self) -> list[Match]:
        return [m for m in self.matches if m.status == "known"]

    def summary_line(self) -> str:
        failing = self.failing
        parts = []
        for m in failing:
            obs = m.observation
            what = f"{obs.invariant} at {obs.where}"
            if m.status == "higher":
                assert m.entry is not None
                what += f" ({obs.figure()}, baseline {m.entry.figure()})"
            parts.append(what)
        noun = "finding" if len(failing) == 1 else "findings"
        line = f"torchperf: {len(failing)} {noun} not in the baseline: " + "; ".join(parts)
        if self.known:
            line += f" ({len(self.known)} known)"
        return line

    def lines(self) -> list[str]:
        return [m.describe() for m in self.failing] + [m.describe() for m in self.known]


def _pair_in_order(a: Sequence[int], b: Sequence[int]) -> list[tuple[int, int]]:
    """Match every item of the shorter sorted list to one of the longer, keeping their order, nearest overall."""
    if len(a) > len(b):
        return [(i, j) for j, i in _pair_in_order(b, a)]
    n, m = len(a), len(b)
    inf = float("inf")
    # cost[i][j]: the first i of a matched within the first j of b.
    cost = [[0.0] * (m + 1)] + [[inf] * (m + 1) for _ in range(n)]
    for i in range(1, n + 1):
        for j in range(i, m + 1):
            cost[i][j] = min(cost[i][j - 1], cost[i - 1][j - 1] + abs(a[i - 1] - b[j - 1]))
    pairs = []
    i, j = n, m
    while i > 0:
        if j > i and cost[i][j] == cost[i][j - 1]:
            j -= 1
        else:
            pairs.append((i - 1, j - 1))
            i, j = i - 1, j - 1
    return pairs[::-1]


def compare(observations: Sequence[Observation], entries: Sequence[Entry]) -> Comparison:
    """Match a test's observations to its baseline entries by site; among equal sites, by line, in order."""
    groups: dict[tuple[Any, ...], tuple[list[int], list[int]]] = {}
    for i, obs in enumerate(observations):
        groups.setdefault(obs.key, ([], []))[0].append(i)
    for j, entry in enumerate(entries):
        if entry.key in groups:
            groups[entry.key][1].append(j)
    matched: dict[int, int] = {}
    for obs_ids, entry_ids in groups.values():
        obs_ids.sort(key=lambda i: observations[i].line)
        entry_ids.sort(key=lambda j: entries[j].line)
        lines_o = [observations[i].line for i in obs_ids]
        lines_e = [entries[j].line for j in entry_ids]
        for a, b in _pair_in_order(lines_o, lines_e):
            matched[obs_ids[a]] = entry_ids[b]
    used = set(matched.values())
    matches = [Match(obs, entries[matched[i]] if i in matched else None) for i, obs in enumerate(observations)]
    stale = [entry for j, entry in enumerate(entries) if j not in used]
    return Comparison(matches, stale)


class KnownFindingsViolation(InvariantViolation):
    """A watched run broke invariants and some of its findings are not in the baseline."""

    def __init__(self, report: Report, comparison: Comparison) -> None:
        super().__init__(report)
        self.comparison = comparison

    def __str__(self) -> str:
        return "\n".join([self.comparison.summary_line(), *self.comparison.lines(), "", self.report.render()])


# -- the file ----------------------------------------------------------------------------------------


class Baseline:
    """A baseline file's entries, by test node id."""

    def __init__(self, tests: Optional[dict[str, list[Entry]]] = None, path: Optional[str] = None) -> None:
        self.tests: dict[str, list[Entry]] = tests or {}
        self.path = path

    @classmethod
    def load(cls, path: str, missing_ok: bool = False) -> Baseline:
        if not os.path.exists(path):
            if missing_ok:
                return cls({}, path)
            raise BaselineError(f"no baseline file at {path} (write one with --torchperf-baseline-update)")
        try:
            with open(path, encoding="utf-8") as fh:
                doc = json.load(fh)
        except (OSError, ValueError) as exc:
            raise BaselineError(f"cannot read the baseline file {path}: {exc}") from None
        return cls.from_document(doc, path)

    @classmethod
    def from_document(cls, doc: Any, path: Optional[str] = None) -> Baseline:
        where = path or "the baseline"
        if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
            raise BaselineError(f"{where} is not a pytest-torchperf baseline (no \"schema\": \"{SCHEMA}\")")
        if doc.get("schema_version") != SCHEMA_VERSION:
            raise BaselineError(
                f"{where} has schema_version {doc.get('schema_version')!r}; this pytest-torchperf "
                f"reads {SCHEMA_VERSION}: refresh it with --torchperf-baseline-update"
            )
        tests: dict[str, list[Entry]] = {}
        raw = doc.get("tests")
        if not isinstance(raw, dict):
            raise BaselineError(f"{where}: \"tests\" must be an object of test ids")
        for nodeid, entries in raw.items():
            if not isinstance(entries, list):
                raise BaselineError(f"{where}: the entries of {nodeid} must be a list")
            try:
                tests[nodeid] = [Observation.from_dict(e) for e in entries]
            except (KeyError, TypeError, ValueError, IndexError) as exc:
                raise BaselineError(f"{where}: a malformed entry of {nodeid}: {exc!r}") from None
        return cls(tests, path)

    def entries(self, nodeid: str) -> list[Entry]:
        return self.tests.get(nodeid, [])

    def judge(self, nodeid: str, report: Report) -> Comparison:
        return compare(observe(report), self.entries(nodeid))

    def to_document(self) -> dict[str, Any]:
        tests = {
            nodeid: [e.to_entry() for e in merge_observations(entries)]
            for nodeid, entries in sorted(self.tests.items())
            if entries
        }
        return {"schema": SCHEMA, "schema_version": SCHEMA_VERSION, "tests": tests}

    def dumps(self) -> str:
        return json.dumps(self.to_document(), indent=2, sort_keys=False) + "\n"

    def write(self, path: str) -> bool:
        """Write the file (atomically) unless it already says the same; True when written."""
        text = self.dumps()
        try:
            with open(path, encoding="utf-8") as fh:
                if fh.read() == text:
                    return False
        except OSError:
            pass
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
        return True


# -- a session against the baseline ----------------------------------------------------------------


@dataclass
class Stale:
    """A baseline entry (or a whole test's entries) the session showed to be out of date."""

    nodeid: str
    entry: Optional[Entry]  # None: every entry of a test that no longer exists
    reason: str

    def describe(self) -> str:
        if self.entry is None:
            return f"stale: {self.nodeid}: {self.reason}"
        return f"stale: {self.nodeid}: {self.entry.describe()}: {self.reason}"


class Session:
    """What one pytest session saw, against a baseline: known, new and stale findings, and the refreshed file.

    Fed on the xdist controller (or the only process) with each test's
    observations; ``exists`` tells whether a file still exists (relative paths
    are the test ids' own, relative to pytest's rootdir).
    """

    def __init__(self, baseline: Baseline) -> None:
        self.baseline = baseline
        #: Tests that ran to a verdict: their observations (merged over runs).
        self.compared: dict[str, list[Observation]] = {}
        #: Tests collected (before deselection), and the files named with a ``::`` selector.
        self.collected: set[str] = set()
        self.narrowed_files: set[str] = set()

    def record(self, nodeid: str, observations: Iterable[Observation]) -> None:
        self.compared.setdefault(nodeid, []).extend(observations)

    def comparisons(self) -> dict[str, Comparison]:
        return {
            nodeid: compare(merge_observations(obs), self.baseline.entries(nodeid))
            for nodeid, obs in sorted(self.compared.items())
        }

    def _gone(self, nodeid: str, exists: Callable[[str], bool]) -> Optional[str]:
        """Why a test that did not run no longer exists, or None when it may just not have been selected."""
        if nodeid in self.collected:
            return None
        path = nodeid.split("::", 1)[0]
        if not exists(path):
            return f"{path} no longer exists"
        collected_files = {n.split("::", 1)[0] for n in self.collected}
        if path in collected_files and path not in self.narrowed_files:
            return "the test no longer exists"
        return None

    def stale(self, exists: Callable[[str], bool]) -> list[Stale]:
        out: list[Stale] = []
        for nodeid, comparison in self.comparisons().items():
            for entry in comparison.stale:
                out.append(Stale(nodeid, entry, "no longer found"))
        for nodeid in sorted(self.baseline.tests):
            if nodeid in self.compared or not self.baseline.tests[nodeid]:
                continue
            reason = self._gone(nodeid, exists)
            if reason:
                out.append(Stale(nodeid, None, reason))
        return out

    def refreshed(self, exists: Callable[[str], bool]) -> Baseline:
        """The baseline this session would write: current findings for the tests that ran, the rest kept."""
        tests: dict[str, list[Entry]] = {}
        for nodeid, entries in self.baseline.tests.items():
            if nodeid not in self.compared and not self._gone(nodeid, exists):
                tests[nodeid] = list(entries)
        for nodeid, observations in self.compared.items():
            merged = merge_observations(observations)
            if merged:
                tests[nodeid] = merged
        return Baseline(tests, self.baseline.path)
