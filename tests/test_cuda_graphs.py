"""``cuda_graph_ready`` and ``copy_hygiene``: each blocker and each copy pattern beside its clean twin, on CPU."""

from __future__ import annotations

import json
import random
import textwrap
from typing import Any, Callable

import pytest
import torch
from seed_tips_models import report_of
from torch.utils.data import DataLoader, TensorDataset

from pytest_torchperf.report import FAILED, PASSED

DEV = torch.device("cpu")  # the training device, as a variable: on a GPU machine, "cuda"


def _line(marker: str) -> int:
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text)


def loop(step: Callable[[Any, Any, Any], Any], optimizer: Callable[[Any], Any] = None, drop_last: bool = True,
         pin_memory: bool = False) -> Callable[[Any], None]:
    """A plain loop over a DataLoader of 10 samples in batches of 4, each step marked with ``run.step()``."""

    def body(run: Any) -> None:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 1)
        opt = (optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)))(model.parameters())
        data = DataLoader(TensorDataset(torch.randn(10, 8), torch.randn(10, 1)), batch_size=4, drop_last=drop_last,
                          pin_memory=pin_memory)
        for _ in range(2):
            for x, y in data:
                with run.step():
                    x = step(x.to(DEV), y.to(DEV), model)
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()

    return body


def graphs(body: Callable[[Any], None]) -> Any:
    return report_of(body, cuda_graph_ready=True)["cuda_graph_ready"]


def hygiene(body: Callable[[Any], None]) -> Any:
    return report_of(body, copy_hygiene=True)["copy_hygiene"]


# -- cuda_graph_ready: blockers and their clean twins --------------------------------------------------------

def _item(x: Any, y: Any, model: Any) -> Any:
    if x.sum().item() > 100:  # BLOCK ITEM
        x = x / 2
    return x


def _where_clean(x: Any, y: Any, model: Any) -> Any:
    return torch.where(x.sum() > 100, x / 2, x)


def _mask(x: Any, y: Any, model: Any) -> Any:
    return x - x[x > 0].mean()  # BLOCK MASK


def _mask_clean(x: Any, y: Any, model: Any) -> Any:
    mask = x > 0
    return x - (x * mask).sum() / mask.sum().clamp(min=1)


def _nonzero(x: Any, y: Any, model: Any) -> Any:
    return x + x.nonzero().shape[0]  # BLOCK NONZERO


def _unique(x: Any, y: Any, model: Any) -> Any:
    return x + torch.unique((x > 0).long()).numel()  # BLOCK UNIQUE


def _built(x: Any, y: Any, model: Any) -> Any:
    return x * torch.tensor([0.5, 2.0]).repeat(4).to(DEV)  # BLOCK BUILT


def _built_clean(x: Any, y: Any, model: Any) -> Any:
    return x * torch.full((8,), 2.0, device=x.device)  # no host data: nothing copied


def _randn(x: Any, y: Any, model: Any) -> Any:
    return x + torch.randn(8).to(DEV)  # BLOCK RANDN


def _randn_clean(x: Any, y: Any, model: Any) -> Any:
    return x + torch.randn(8, device=x.device)


def _python_random(x: Any, y: Any, model: Any) -> Any:
    return x * torch.tensor([random.random() for _ in range(8)]).to(DEV)  # BLOCK RANDOM


def _empty_cache(x: Any, y: Any, model: Any) -> Any:
    torch.cuda.empty_cache()  # BLOCK EMPTY
    return x


def _clean(x: Any, y: Any, model: Any) -> Any:
    return x


@pytest.mark.parametrize(
    "step, twin, kind, marker",
    [
        (_item, _where_clean, "host_syncs", "BLOCK ITEM"),
        (_mask, _mask_clean, "dynamic_shapes", "BLOCK MASK"),
        (_nonzero, _mask_clean, "dynamic_shapes", "BLOCK NONZERO"),
        (_unique, _mask_clean, "dynamic_shapes", "BLOCK UNIQUE"),
        (_built, _built_clean, "host_copies", "BLOCK BUILT"),
        (_randn, _randn_clean, "cpu_randomness", "BLOCK RANDN"),
        (_python_random, _randn_clean, "cpu_randomness", "BLOCK RANDOM"),
        (_empty_cache, _clean, "empty_cache_calls", "BLOCK EMPTY"),
    ],
    ids=["item", "mask", "nonzero", "unique", "built", "randn", "python-random", "empty-cache"],
)
def test_each_blocker_fails_at_its_line_and_its_clean_twin_captures(
    step: Any, twin: Any, kind: str, marker: str
) -> None:
    check = graphs(loop(step))
    assert check.status == FAILED, check.summary
    assert f"test_cuda_graphs.py:{_line(marker)}" in check.summary
    assert check.figures[kind] == 4 and check.figures["blockers"] == 4  # every step of 2 epochs x 2 batches
    (finding,) = check.findings
    assert "blocks a capture: " in "\n".join(finding.facts) and finding.hint
    assert finding.sites[0].frame.lineno == _line(marker)
    clean = graphs(loop(twin))
    assert clean.status == PASSED, clean.summary
    assert clean.summary == "every step would capture: no blocker over 4 steps"


def test_a_periodic_sync_is_a_blocker_too() -> None:
    def every_third(x: Any, y: Any, model: Any, seen: list = []) -> Any:  # noqa: B006 - a step counter
        seen.append(1)
        if len(seen) % 3 == 0:
            print(float(x.sum()))  # PERIODIC
        return x

    check = graphs(loop(every_third))
    assert check.status == FAILED and f"test_cuda_graphs.py:{_line('PERIODIC')}" in check.summary
    assert check.figures["host_syncs"] == 1


def test_a_ragged_last_batch_fails_at_the_loader_and_drop_last_captures() -> None:
    check = graphs(loop(_clean, drop_last=False))
    assert check.status == FAILED, check.summary
    assert check.figures["shape_changes"] == 2  # the 2-sample batch, in each epoch
    (finding,) = check.findings
    assert finding.title == "input shapes change between steps: batches of 2x8, 2x1 after 4x8, 4x1"
    assert "(a ragged last batch)" in "\n".join(finding.facts)
    assert "drop_last=True" in finding.hint
    assert finding.sites[0].frame.function == "body"
    assert graphs(loop(_clean, drop_last=True)).status == PASSED


def test_adam_without_capturable_fails_at_its_step_and_sgd_captures() -> None:
    check = graphs(loop(_clean, optimizer=lambda p: torch.optim.AdamW(p, lr=0.01)))
    assert check.status == FAILED, check.summary
    assert check.figures["non_capturable_optimizers"] == 4  # each step
    (finding,) = check.findings
    assert finding.title.startswith("optimizer not capturable: `AdamW.step()` (capturable=False)")
    assert "capturable=True" in finding.hint
    assert finding.sites[0].frame.source == "opt.step()"
    assert graphs(loop(_clean, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))).status == PASSED


def test_a_run_without_steps_is_not_checked() -> None:
    check = graphs(lambda run: torch.nn.Linear(2, 2)(torch.randn(3, 2)))
    assert check.status == "not checked"


# -- copy_hygiene: patterns and their clean twins -------------------------------------------------------------

def _unpinned(run: Any, pin_memory: bool) -> None:
    model = torch.nn.Linear(8, 1)
    data = DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4, pin_memory=pin_memory)
    for x, y in data:
        with run.step():
            x = x.to(DEV, non_blocking=True)  # NON_BLOCKING
            torch.nn.functional.mse_loss(model(x), y).backward()


def test_non_blocking_from_a_loader_that_does_not_pin_fails_and_a_pinning_loader_passes() -> None:
    check = hygiene(lambda run: _unpinned(run, pin_memory=False))
    assert check.status == FAILED, check.summary
    assert check.summary.startswith("non_blocking=True copy from memory that is not pinned at ")
    assert check.summary.endswith(f"test_cuda_graphs.py:{_line('NON_BLOCKING')}")
    (finding,) = check.findings
    assert "pin_memory=False" in finding.facts[0] and "pin_memory=True" in finding.hint
    with pytest.warns(UserWarning, match="pin_memory"):  # torch: nothing to pin with on this machine
        clean = hygiene(lambda run: _unpinned(run, pin_memory=True))
    assert clean.status == PASSED, clean.summary
    assert clean.figures["non_blocking_copies"] == 2


def _read_back(run: Any, sync: bool) -> list:
    model = torch.nn.Linear(8, 1)
    out = []
    for x, y in DataLoader(TensorDataset(torch.randn(8, 8), torch.randn(8, 1)), batch_size=4):
        with run.step():
            loss = torch.nn.functional.mse_loss(model(x.to(DEV)), y.to(DEV))
            loss.backward()
            host = loss.detach().to("cpu", non_blocking=True)
            if sync:
                torch.get_device_module(DEV).synchronize()
            out.append(host.tolist())  # READ EARLY
    return out


def test_a_device_to_host_result_read_before_a_synchronisation_fails_and_one_read_after_passes() -> None:
    check = hygiene(lambda run: _read_back(run, sync=False))
    assert check.status == FAILED, check.summary
    assert f"test_cuda_graphs.py:{_line('READ EARLY')}" in check.summary
    (finding,) = check.findings
    facts = "\n".join(finding.facts)
    assert "copied with non_blocking=True at test_cuda_graphs.py:" in facts and "`.tolist()`" in facts
    assert check.figures["unsynchronised_reads"] == 2
    assert hygiene(lambda run: _read_back(run, sync=True)).status == PASSED


def test_a_read_of_a_device_value_in_between_synchronises() -> None:
    model = torch.nn.Linear(4, 1)

    def body(run: Any) -> None:
        for x in DataLoader(torch.randn(8, 4), batch_size=4):
            with run.step():
                out = model(x.to(DEV))
                host = out.detach().sum().to("cpu", non_blocking=True)
                print(out.max().item())  # waits for the stream: the copy has landed
                print(host.item())

    assert hygiene(body).status == PASSED


def test_pin_memory_in_the_step_fails_before_torch_refuses_it_here() -> None:
    def body(run: Any) -> None:
        for x in [torch.randn(4), torch.randn(4)]:
            with run.step():
                try:
                    x = x.pin_memory()  # PIN
                except RuntimeError:  # no accelerator here: torch has nothing to pin with
                    pass

    check = hygiene(body)
    assert check.status == FAILED and f"test_cuda_graphs.py:{_line('# PIN')}" in check.summary
    assert check.figures["pin_memory_in_step"] == 2


# -- through pytest: the marker, a Lightning fit, the JSON, the baseline, -n 2 ---------------------------------

SUITE = '''
import pytest
import torch
from torchperf_models import TinyModule, make_loader, make_trainer


class Syncs(TinyModule):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        if loss.item() > 1e6:  # LIGHTNING ITEM
            raise RuntimeError
        return loss


class Clean(TinyModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.torchperf(cuda_graph_ready=True, copy_hygiene=True, no_host_sync=False)
def test_fit_with_item(tmp_path):
    make_trainer(tmp_path, max_epochs=1).fit(Syncs(), make_loader(num_workers=0))


@pytest.mark.torchperf(cuda_graph_ready=True, copy_hygiene=True, no_host_sync=False)
def test_clean_fit(tmp_path):
    make_trainer(tmp_path, max_epochs=1).fit(Clean(), make_loader(num_workers=0))
'''


def _suite(pytester: pytest.Pytester) -> int:
    pytester.makepyfile(test_suite=SUITE)
    return next(i for i, t in enumerate(textwrap.dedent(SUITE).splitlines(), 1) if "LIGHTNING ITEM" in t) - 1


@pytest.mark.slow
def test_a_lightning_fit_under_the_marker_the_json_the_baseline_and_xdist(user_models: pytest.Pytester) -> None:
    line = _suite(user_models)
    result = user_models.runpytest_subprocess("-p", "no:cacheprovider", "--torchperf-json=out.json",
                                              "--torchperf-baseline=b.json", "--torchperf-baseline-update")
    result.assert_outcomes(passed=2)  # the update accepts the finding
    entries = json.loads((user_models.path / "b.json").read_text())["tests"]
    (entry,) = entries["test_suite.py::test_fit_with_item"]
    assert entry["invariant"] == "cuda_graph_ready" and "loss.item()" in entry["source"]
    tests = {t["nodeid"].split("::")[-1]: t for t in json.loads((user_models.path / "out.json").read_text())["tests"]}
    checks = tests["test_fit_with_item"]["runs"][0]["checks"]
    assert checks["cuda_graph_ready"]["status"] == FAILED
    assert f"test_suite.py:{line}" in checks["cuda_graph_ready"]["summary"]
    assert checks["cuda_graph_ready"]["figures"]["host_syncs"] == 4
    clean = tests["test_clean_fit"]["runs"][0]["checks"]
    assert clean["cuda_graph_ready"]["status"] == PASSED, clean["cuda_graph_ready"]["summary"]
    assert clean["copy_hygiene"]["status"] == PASSED
    parallel = user_models.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2", "--torchperf-baseline=b.json")
    parallel.assert_outcomes(passed=2)  # known through the ratchet
    plain = user_models.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    plain.assert_outcomes(passed=1, failed=1)
    plain.stdout.fnmatch_lines([f"*cuda_graph_ready*host sync (`.item()`) at test_suite.py:{line}*"])
