"""The seams: every invariant on alone and all together, under the output modes users combine.

One pytester subprocess per output mode (JUnit XML, JSON, annotations and trace; report-only with a
baseline update; the baseline compared under ``-n 2`` with JUnit XML and JSON) runs one generated file:
a plain loop whose DataLoader has workers and a Lightning fit, each once with all the invariants on; the
first mode also once per invariant switched on alone (all together, every invariant's figures still go
through every mode). What must hold whatever the verdicts: no INTERNALERROR, no error in setup or
teardown, the exit code of a
session whose tests failed (or passed, report-only), and every figure in the JSON declared by its
invariant with the declared type.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_torchperf import figures, registry
from pytest_torchperf.arguments import Flag

#: A value that switches on each built-in invariant that is not a flag.
VALUES: dict[str, Any] = {
    "max_overhead": 0.5,
    "min_workers": 1,
    "max_memory_growth": 0,
    "gpu_settings": True,
    "max_ops_per_step": 100000,
    "max_collectives_per_step": 0,
    "max_data_wait": 0.9,
}
#: Replays and times the fit (minutes of rounds): its own tests cover it (tests/test_max_overhead.py);
#: over the plain loop it is checked here (no fit to compare: a failure, never an error).
NOT_ON_A_FIT = ("max_overhead",)


def _switches() -> dict[str, Any]:
    out = {}
    for name in registry.BUILTIN:
        invariant = registry.get(name)
        out[name] = True if isinstance(invariant.kind, Flag) else VALUES[name]
    return out


def _suite(alone: bool) -> str:
    switches = _switches()
    fit = {k: v for k, v in switches.items() if k not in NOT_ON_A_FIT}
    return f'''
import pytest
import torch
from torchperf_models import TinyModule, make_loader, make_trainer

ALONE = {switches!r}
FIT = {fit!r}


def _each(switches):
    params = [pytest.param(name, marks=pytest.mark.torchperf(**{{name: value}}), id=name)
              for name, value in switches.items()] if {alone!r} else []
    return params + [pytest.param("all", marks=pytest.mark.torchperf(**switches), id="all")]


@pytest.mark.parametrize("invariant", _each(ALONE))
def test_loop(invariant):
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = make_loader(num_workers=2, persistent_workers=True)
    for epoch in range(2):
        for x, y in loader:
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()


@pytest.mark.parametrize("invariant", _each(FIT))
def test_fit(invariant, tmp_path):
    trainer = make_trainer(tmp_path, max_epochs=1, limit_train_batches=3, num_sanity_val_steps=0,
                           limit_val_batches=0)
    # Workers where all the invariants are on (the loop has them in every case): a fit's worker start-up is
    # most of its time, and each invariant alone meets workers in the loop.
    workers = 2 if invariant == "all" else 0
    trainer.fit(TinyModule(), make_loader(num_workers=workers, persistent_workers=workers > 0))
'''


def _conforms(value: Any, schema: dict[str, Any]) -> bool:
    kinds = schema.get("type")
    if kinds is None:
        return True
    kinds = kinds if isinstance(kinds, list) else [kinds]
    checks = {
        "null": lambda v: v is None,
        "boolean": lambda v: isinstance(v, bool),
        "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "string": lambda v: isinstance(v, str),
        "array": lambda v: isinstance(v, list),
        "object": lambda v: isinstance(v, dict),
    }
    return any(checks[k](value) for k in kinds)


def _figures_as_declared(doc: dict[str, Any]) -> list[str]:
    """Every figure of every verdict in the JSON report that its invariant does not declare, or of another type."""
    wrong = []
    for test in doc["tests"]:
        for run in test["runs"]:
            for name, check in run["checks"].items():
                schema = figures.schema(registry.get(name).figures)["properties"]
                for key, value in check["figures"].items():
                    if key not in schema:
                        wrong.append(f"{test['nodeid']}: {name}.{key} is not declared")
                    elif not _conforms(value, schema[key]):
                        wrong.append(f"{test['nodeid']}: {name}.{key} = {value!r} is not {schema[key]}")
    return wrong


def _run(pytester: pytest.Pytester, *args: str, alone: str = "") -> pytest.RunResult:
    """The generated suite in a subprocess; ``alone``: only that test function (``test_loop``, ``test_fit``),
    once per invariant on alone and once with all of them."""
    pytester.makepyfile(test_seam=_suite(bool(alone)))
    select = ("-k", alone) if alone else ()
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q", *select, *args)
    text = result.stdout.str() + result.stderr.str()
    assert "INTERNALERROR" not in text, text[-4000:]
    outcomes = result.parseoutcomes()
    assert not outcomes.get("errors") and not outcomes.get("error"), text[-4000:]  # setup and teardown included
    if not alone:
        expected = 2
    else:
        expected = len(_switches()) + 1 - (len(NOT_ON_A_FIT) if alone == "test_fit" else 0)
    assert outcomes.get("passed", 0) + outcomes.get("failed", 0) == expected, outcomes
    return result


# One test per function of the generated suite, so that xdist can run the two halves side by side.
@pytest.mark.parametrize("function", ["test_loop", "test_fit"])
def test_each_invariant_alone_and_all_together_with_junit_json_annotations_and_trace(
    user_models: pytest.Pytester, function: str
) -> None:
    result = _run(
        user_models, "--junitxml=junit.xml", "--torchperf-json=report.json", "--torchperf-annotations=on",
        "--torchperf-trace=traces", alone=function,
    )
    assert result.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    doc = json.loads((user_models.path / "report.json").read_text())
    assert _figures_as_declared(doc) == []
    tests = ET.parse(user_models.path / "junit.xml").getroot().iter("testcase")
    names = {p.get("name") for case in tests for p in case.iter("property")}
    assert "torchperf.no_oversubscription.status" in names
    if function == "test_loop":  # the loop's workers: the count that once met the engine's own merge key
        assert "torchperf.no_oversubscription.ranks" in names


def test_report_only_with_a_baseline_update_then_the_baseline_compared_under_xdist(
    user_models: pytest.Pytester,
) -> None:
    update = _run(
        user_models, "--torchperf-report-only", "--torchperf-baseline=baseline.json", "--torchperf-baseline-update",
    )
    assert update.ret == pytest.ExitCode.OK
    assert Path(user_models.path / "baseline.json").exists()
    xdist = ("-n", "2") if _has_xdist() else ()
    compared = _run(
        user_models, *xdist, "--torchperf-baseline=baseline.json", "--junitxml=junit.xml",
        "--torchperf-json=report.json",
    )
    assert compared.ret in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
    assert _figures_as_declared(json.loads((user_models.path / "report.json").read_text())) == []


def _has_xdist() -> bool:
    try:
        import xdist  # noqa: F401
    except ImportError:
        return False
    return True
