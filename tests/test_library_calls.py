"""A library the user calls from their own step (a metric object) is judged at the user's calling line."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pytest_torchperf import InvariantViolation, watch  # noqa: E402
from pytest_torchperf.report import Report  # noqa: E402

#: A metric library installed in a site directory: its ``update`` checks its inputs with a host read.
METRICS = '''
import torch


class RunningAccuracy:
    def __init__(self, validate=True):
        self.validate = validate
        self.correct = torch.zeros(())
        self.total = 0

    def update(self, logits, target):
        if self.validate:
            self._check(logits)
        self.correct += (logits.argmax(1) == target).sum()
        self.total += len(target)

    def _check(self, logits):
        if bool((logits != logits).any()):  # a host read of a device value: a sync every call
            raise ValueError("NaN logits")
'''


@pytest.fixture
def metrics(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    site = tmp_path / "site-packages"
    (site / "acme_metrics").mkdir(parents=True)
    (site / "acme_metrics" / "__init__.py").write_text(textwrap.dedent(METRICS))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(__import__("sys").modules, "acme_metrics", raising=False)
    import acme_metrics

    return acme_metrics


def _loop(metric: Any) -> Report:
    model = torch.nn.Linear(8, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 8)
    try:
        with watch() as run:
            for _ in range(4):
                out = model(x)
                loss = out.logsumexp(1).mean()
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                metric.update(out.detach(), out.detach().argmax(1))  # the user's calling line
        return run.report
    except InvariantViolation as exc:
        return exc.report


def test_a_metric_updated_every_step_fails_at_the_users_calling_line(metrics: Any) -> None:
    report = _loop(metrics.RunningAccuracy())
    check = report.checks["no_host_sync"]
    assert check.status == "failed", check.summary
    (finding,) = check.findings
    site = finding.sites[0]
    assert site.frame.source == "metric.update(out.detach(), out.detach().argmax(1))  # the user's calling line"
    assert "inside `acme_metrics's RunningAccuracy.update`" in finding.title
    assert "turn off the library's input checks" in finding.hint


def test_the_same_metric_without_its_validation_passes(metrics: Any) -> None:
    report = _loop(metrics.RunningAccuracy(validate=False))
    assert report.checks["no_host_sync"].status == "passed", report.checks["no_host_sync"].summary
