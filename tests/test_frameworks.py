"""Framework adapters: loops owned by a library, the Hugging Face Trainer, accelerate and Ignite.

Real runs on CPU, nothing downloaded: a library-style Trainer installed in a temporary site directory,
a tiny LlamaForCausalLM built from a config, an accelerate loop with ``accumulate``, Ignite engines.
The framework imports are slow, so each framework's tests share one pytest subprocess, read through
the JSON report.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
from step_check_helpers import needs_transformers

LIBRARY = '''
import torch


class Trainer:
    """A research repo's trainer: owns the loop, calls the user's callback after each iteration."""

    def __init__(self, model, data, callback=None, periodic=False):
        self.model, self.data, self.callback, self.periodic = model, data, callback, periodic
        self.loss = None

    def run(self):
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01)
        for it, (x, y) in enumerate(self.data):
            loss = torch.nn.functional.mse_loss(self.model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not self.periodic:
                self.loss = loss.item()  # LIBRARY EVERY STEP
            elif it % 10 == 0:
                self.loss = loss.item()  # LIBRARY PERIODIC
            if self.callback is not None:
                self.callback(self, loss)
'''


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if marker in text)


def _results(path: Path) -> dict[str, dict[str, Any]]:
    """Test name -> {"outcome", "checks"} of the first run, from the JSON report."""
    data = json.loads(path.read_text())
    out = {}
    for test in data["tests"]:
        run = test["runs"][0]
        out[test["nodeid"].split("::")[-1]] = {"outcome": test["outcome"], "checks": run["checks"], "run": run}
    return out


def _findings(check: dict[str, Any]) -> list[dict[str, Any]]:
    return list(check["findings"])


def test_a_library_loop_gets_automatic_steps_and_its_own_syncs_are_notes(pytester: pytest.Pytester) -> None:
    site = pytester.path / "site-packages"
    (site / "minitrain").mkdir(parents=True)
    (site / "minitrain" / "__init__.py").write_text(LIBRARY)
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(site)!r})\n")
    pytester.makepyfile(
        test_lib=textwrap.dedent(
            """
            import pytest
            import torch
            from minitrain import Trainer

            def data(n=30):
                torch.manual_seed(0)
                return [(torch.randn(4, 8), torch.randn(4, 1)) for _ in range(n)]

            @pytest.mark.torchperf
            def test_library_sync_is_a_note():
                Trainer(torch.nn.Linear(8, 1), data()).run()

            @pytest.mark.torchperf(fail_on_framework_syncs=True)
            def test_library_sync_fails_when_asked():
                Trainer(torch.nn.Linear(8, 1), data()).run()

            @pytest.mark.torchperf(fail_on_framework_syncs=True)
            def test_library_periodic_sync_is_a_note():
                Trainer(torch.nn.Linear(8, 1), data(), periodic=True).run()

            def log(trainer, loss):
                print(loss.item())  # USER CALLBACK

            @pytest.mark.torchperf
            def test_user_callback_sync_fails():
                Trainer(torch.nn.Linear(8, 1), data(), callback=log, periodic=True).run()
            """
        )
    )
    user_line = _line((pytester.path / "test_lib.py").read_text(), "USER CALLBACK")
    result = pytester.runpytest("--torchperf-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=2)
    every = _line(LIBRARY, "LIBRARY EVERY STEP")
    result.stdout.fnmatch_lines([
        "*made by minitrain, not by your code*failing because fail_on_framework_syncs=True*",
        f"*at minitrain/__init__.py:{every} in run *library code*",
    ])
    tests = _results(pytester.path / "out.json")
    assert tests["test_library_sync_is_a_note"]["outcome"] == "passed"
    note = tests["test_library_sync_is_a_note"]["checks"]["no_host_sync"]
    assert note["status"] == "passed" and "30 in minitrain (noted)" in note["summary"]
    assert tests["test_library_sync_is_a_note"]["run"]["steps_found"] == "found at optimizer.step()"
    assert tests["test_library_sync_is_a_note"]["run"]["steps"] == 30
    assert tests["test_library_sync_fails_when_asked"]["outcome"] == "failed"
    assert tests["test_library_periodic_sync_is_a_note"]["outcome"] == "passed"
    failed = tests["test_user_callback_sync_fails"]["checks"]["no_host_sync"]
    assert failed["status"] == "failed" and f"test_lib.py:{user_line}" in failed["summary"]


IGNITE_AND_ACCELERATE = '''
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

# Imported before any watch: importing torch.distributed.optim (which ignite does) inside a watch fails today
# (torch.jit.script meets a probe's wrapper; a known issue, not the adapters').
import accelerate  # noqa: F401
import ignite.engine  # noqa: F401


def loader(n=32):
    torch.manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 8), torch.randn(n, 1)), batch_size=4)


@pytest.mark.torchperf
def test_ignite_default_output_transform_is_a_note():
    from ignite.engine import create_supervised_trainer

    model = torch.nn.Linear(8, 1)
    trainer = create_supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss())
    trainer.run(loader(), max_epochs=2)


@pytest.mark.torchperf(fail_on_framework_syncs=True)
def test_ignite_default_output_transform_fails_when_asked():
    from ignite.engine import create_supervised_trainer

    model = torch.nn.Linear(8, 1)
    trainer = create_supervised_trainer(model, torch.optim.SGD(model.parameters(), lr=0.01), torch.nn.MSELoss())
    trainer.run(loader(), max_epochs=1)


@pytest.mark.torchperf
def test_ignite_user_item_fails():
    from ignite.engine import Engine

    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step(engine, batch):
        x, y = batch
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.item()  # USER IGNITE

    Engine(train_step).run(loader(), max_epochs=1)


@pytest.mark.torchperf
def test_accelerate_accumulate_user_item_fails():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, data = accelerator.prepare(model, opt, loader())
    for x, y in data:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            print(loss.item())  # USER ACCELERATE


@pytest.mark.torchperf(no_sync_accumulation=True)
def test_accelerate_accumulate_clean():
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt, data = accelerator.prepare(model, opt, loader())
    total = torch.zeros(())
    for x, y in data:
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            opt.zero_grad()
            total += loss.detach()
    print(total.item())
'''


@pytest.mark.slow
def test_ignite_and_accelerate_loops(pytester: pytest.Pytester) -> None:
    pytest.importorskip("ignite")
    pytest.importorskip("accelerate")
    path = pytester.makepyfile(test_loops=IGNITE_AND_ACCELERATE)
    source = path.read_text()
    result = pytester.runpytest_subprocess("--torchperf-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=3)
    tests = _results(pytester.path / "out.json")
    noted = tests["test_ignite_default_output_transform_is_a_note"]
    assert noted["outcome"] == "passed"
    # The process function is the step, and the report says so.
    assert noted["run"]["steps"] == 16 and noted["run"]["steps_found"] == "marked by ignite's Engine.run"
    findings = _findings(noted["checks"]["no_host_sync"])
    ignite = [f for f in findings if any("ignite/engine/__init__.py" in (s["site"] or "") for s in f["sites"])]
    assert ignite and ignite[0]["title"].startswith("note: ") and "output_transform=" in ignite[0]["hint"]
    assert tests["test_ignite_default_output_transform_fails_when_asked"]["outcome"] == "failed"
    user = tests["test_ignite_user_item_fails"]["checks"]["no_host_sync"]
    assert f"test_loops.py:{_line(source, 'USER IGNITE')}" in user["summary"]
    acc = tests["test_accelerate_accumulate_user_item_fails"]
    assert f"test_loops.py:{_line(source, 'USER ACCELERATE')}" in acc["checks"]["no_host_sync"]["summary"]
    assert acc["run"]["steps"] == 4 and acc["run"]["steps_found"] == "found at optimizer.step()"  # 8 batches / 2
    clean = tests["test_accelerate_accumulate_clean"]
    assert clean["outcome"] == "passed" and clean["run"]["steps"] == 4
    assert clean["checks"]["no_sync_accumulation"]["status"] == "not checked"  # one process: no DDP to judge


TRAINER = '''
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

IDS = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(IDS)

    def __getitem__(self, i):
        return {"input_ids": IDS[i], "labels": IDS[i]}


def tiny_llama():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(config)


def arguments(**kwargs):
    # in the session's own directory (pytester's), not a temporary directory left behind
    values = dict(output_dir="trainer-output", per_device_train_batch_size=4, max_steps=12, logging_steps=4,
                  save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True)
    values.update(kwargs)
    return TrainingArguments(**values)


class LoggingTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        self.last = loss.item()  # USER COMPUTE_LOSS
        return loss


@pytest.mark.torchperf
def test_clean_trainer():
    Trainer(model=tiny_llama(), args=arguments(), train_dataset=Tokens()).train()


@pytest.mark.torchperf(fail_on_framework_syncs=True)
def test_trainer_own_syncs_fail_when_asked():
    Trainer(model=tiny_llama(), args=arguments(max_steps=4), train_dataset=Tokens()).train()


@pytest.mark.torchperf
def test_compute_loss_item():
    LoggingTrainer(model=tiny_llama(), args=arguments(), train_dataset=Tokens()).train()


@pytest.mark.torchperf
def test_workers_restarted():
    args = arguments(max_steps=-1, num_train_epochs=2, dataloader_num_workers=2, dataloader_persistent_workers=False)
    Trainer(model=tiny_llama(), args=args, train_dataset=Tokens()).train()


@pytest.mark.torchperf(max_overhead=0.5, no_graph_retention=True, min_workers=1)
def test_max_overhead_is_not_checked():
    Trainer(model=tiny_llama(), args=arguments(max_steps=4), train_dataset=Tokens()).train()
'''


@pytest.mark.slow
def test_hugging_face_trainer(pytester: pytest.Pytester) -> None:
    needs_transformers()
    path = pytester.makepyfile(test_trainer=TRAINER)
    source = path.read_text()
    result = pytester.runpytest_subprocess("--torchperf-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=4)
    tests = _results(pytester.path / "out.json")
    clean = tests["test_clean_trainer"]
    assert clean["outcome"] == "passed"
    assert clean["run"]["steps"] == 12 and clean["run"]["steps_found"] == "marked by transformers' Trainer.train"
    sync = clean["checks"]["no_host_sync"]
    assert "in transformers (noted)" in sync["summary"]
    nan_inf = [f for f in sync["findings"] if "logging_nan_inf_filter=False" in f["hint"]]
    assert nan_inf and nan_inf[0]["title"].startswith("note: ")
    assert nan_inf[0]["sites"][0]["site"].startswith("transformers/trainer.py:")
    strict = tests["test_trainer_own_syncs_fail_when_asked"]["checks"]["no_host_sync"]
    assert strict["status"] == "failed"
    first = strict["findings"][0]
    assert first["sites"][0]["site"].startswith("transformers/trainer.py:") and not first["title"].startswith("note")
    assert "logging_nan_inf_filter=False" in first["hint"]
    user = tests["test_compute_loss_item"]["checks"]["no_host_sync"]
    assert user["status"] == "failed"
    assert f"test_trainer.py:{_line(source, 'USER COMPUTE_LOSS')}" in user["summary"]
    workers = tests["test_workers_restarted"]["checks"]
    assert workers["no_iterator_reset"]["status"] == "failed"
    assert workers["no_host_sync"]["status"] == "passed"
    overhead = tests["test_max_overhead_is_not_checked"]["checks"]
    assert overhead["max_overhead"]["status"] == "not checked"
    assert "transformers Trainer.train() ran" in overhead["max_overhead"]["summary"]
    assert overhead["min_workers"]["status"] == "failed"  # the Trainer's default dataloader_num_workers=0
    assert overhead["no_graph_retention"]["status"] == "passed"


def test_importing_the_plugin_imports_no_framework() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pytest_torchperf, pytest_torchperf.glue.plugin, pytest_torchperf.frameworks, "
        "pytest_torchperf.frameworks.transformers, pytest_torchperf.frameworks.ignite\n"
        "print(sorted(m for m in ('transformers', 'accelerate', 'ignite', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


ACCELERATE_RANKS = '''
import pytest
import torch
import accelerate  # noqa: F401
from accelerate import Accelerator, debug_launcher
from torch.utils.data import DataLoader, TensorDataset


def train(accumulate):
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2 if accumulate else 1)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=4)
    model, opt, data = accelerator.prepare(model, opt, data)
    for i, (x, y) in enumerate(data):
        if accumulate:
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x), y)
                accelerator.backward(loss)
                opt.step()
                opt.zero_grad()
        else:  # accumulating by hand under DDP without no_sync: an all-reduce per micro-batch
            loss = torch.nn.functional.mse_loss(model(x), y) / 2  # HERE
            accelerator.backward(loss)
            if i % 2 == 1:
                opt.step()
                opt.zero_grad()


@pytest.mark.torchperf(no_sync_accumulation=True)
def test_accumulate():
    debug_launcher(train, args=(True,), num_processes=2)


@pytest.mark.torchperf(no_sync_accumulation=True)
def test_by_hand():
    debug_launcher(train, args=(False,), num_processes=2)
'''


@pytest.mark.slow
def test_accelerate_ranks_from_its_launcher_are_watched(pytester: pytest.Pytester) -> None:
    """``accelerate.debug_launcher`` starts its ranks through torch.multiprocessing.start_processes (gloo on CPU)."""
    pytest.importorskip("accelerate")
    path = pytester.makepyfile(test_ranks=ACCELERATE_RANKS)
    line = _line(path.read_text(), "# HERE")
    result = pytester.runpytest_subprocess("--torchperf-json=out.json", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    tests = _results(pytester.path / "out.json")
    clean = tests["test_accumulate"]["checks"]["no_sync_accumulation"]
    assert clean["status"] == "passed" and "rank 0, 1" in clean["summary"]
    assert "over 2 steps" in tests["test_accumulate"]["checks"]["no_host_sync"]["summary"]  # automatic, per rank
    broken = tests["test_by_hand"]["checks"]["no_sync_accumulation"]
    assert broken["status"] == "failed"
    result.stdout.fnmatch_lines([f"*at test_ranks.py:{line} in train*"])


def test_the_attribution_package_list_is_every_adapters_own_and_nothing_else() -> None:
    from pytest_torchperf import frameworks, stacks

    declared = [name for adapter in frameworks.ADAPTERS for name in frameworks.adapter(adapter).PACKAGES]
    assert frameworks.PACKAGES == tuple(declared)
    assert stacks.FRAMEWORK_PACKAGES == frameworks.PACKAGES


def test_every_adapter_declares_the_protocol_and_lightning_alone_provides_replay_and_launchers() -> None:
    from pytest_torchperf import frameworks

    for name in frameworks.ADAPTERS:
        module = frameworks.adapter(name)
        assert module.NAME == name
        for member in ("PACKAGES", "PLUMBING", "SETTINGS", "install", "hint", "stage", "replay", "launchers"):
            assert hasattr(module, member), f"adapter {name} lacks {member}"
    providers = {n for n in frameworks.ADAPTERS if frameworks.adapter(n).replay is not None}
    assert providers == {"lightning"}
    assert {n for n in frameworks.ADAPTERS if frameworks.launchers(n) is not None} == {"lightning"}


def test_no_module_outside_the_adapters_imports_the_lightning_adapter() -> None:
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent / "pytest_torchperf"
    importing = [
        str(path.relative_to(root))
        for path in root.rglob("*.py")
        if path.parent.name != "frameworks"
        and re.search(r"frameworks(\.| import )lightning\b", path.read_text(encoding="utf-8"))
    ]
    assert importing == []
