"""``on_device``: tensors built on the host and copied to the device, caught at their lines on CPU-only CI.

As in ``test_no_host_sync.py``, user code is written to a file so each site is
a known ``path:line``; the report text goes through ``pytester``.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")
np = pytest.importorskip("numpy")

from step_check_helpers import batches, report_of, write_module  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytest_torchperf import UsageError, parse_options, watch  # noqa: E402
from pytest_torchperf.report import Report  # noqa: E402

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

#: Each line builds a tensor on the host and moves it; ``dev`` is the training device, ``out`` a device tensor.
#: The spelling expected in the hint; a pair is (plain loop, Lightning step) where they differ: host data is
#: built once (before the loop, or as a buffer), since ``torch.tensor(data, device=dev)`` in the step is a copy too.
PATTERNS = {
    "randn_to_device": (
        "noise = torch.randn(out.shape).to(dev)",
        "torch.randn",
        "`torch.randn(out.shape, device=dev)`",
    ),
    "tensor_to_x_device": (
        "t = torch.tensor([1.0, 2.0]).to(out.device)",
        "torch.tensor",
        (
            "`t = torch.tensor([1.0, 2.0], device=out.device)`",
            '`self.register_buffer("name", torch.tensor([1.0, 2.0]), persistent=False)`',
        ),
    ),
    "ones_type_as": ("t = torch.ones(4).type_as(out)", "torch.ones", "`out.new_ones(4)`"),
    "zeros_to_tensor": ("t = torch.zeros(4, 1).to(out)", "torch.zeros", "`out.new_zeros(4, 1)`"),
    "rand": ("t = torch.rand(4).to(dev)", "torch.rand", "`torch.rand(4, device=dev)`"),
    "randint": ("t = torch.randint(0, 5, (4,)).to(dev)", "torch.randint", "`torch.randint(0, 5, (4,), device=dev)`"),
    "empty": ("t = torch.empty(4).to(dev)", "torch.empty", "`torch.empty(4, device=dev)`"),
    "full": ("t = torch.full((4,), 0.5).to(dev)", "torch.full", "`torch.full((4,), 0.5, device=dev)`"),
    "eye": ("t = torch.eye(3).to(dev)", "torch.eye", "`torch.eye(3, device=dev)`"),
    "arange_view": ("t = torch.arange(4)[None, :].to(dev)", "torch.arange", "`torch.arange(4, device=dev)`"),
    "linspace": ("t = torch.linspace(0, 1, 5).to(dev)", "torch.linspace", "`torch.linspace(0, 1, 5, device=dev)`"),
    "as_tensor": (
        "t = torch.as_tensor([1, 2]).to(dev)",
        "torch.as_tensor",
        (
            "`t = torch.as_tensor([1, 2], device=dev)`",
            '`self.register_buffer("name", torch.as_tensor([1, 2]), persistent=False)`',
        ),
    ),
    "from_numpy_float": (
        "t = torch.from_numpy(ARRAY).float().to(dev)",
        "torch.from_numpy",
        (
            "`t = torch.as_tensor(ARRAY, device=dev, dtype=torch.float32)`",
            '`self.register_buffer("name", torch.from_numpy(ARRAY), persistent=False)`',
        ),
    ),
    "arange_long_to_dtype": (
        "t = torch.arange(4).to(torch.float32).long().to(dev)",
        "torch.arange",
        "`torch.arange(4, device=dev, dtype=torch.int64)`",
    ),
    "copy_into_device": (
        "buffer = out.detach().clone(); buffer.copy_(torch.randn(4, 1))",
        "torch.randn",
        "`torch.randn(4, 1, device=buffer.device)`",
    ),
    "two_lines": (
        "noise = torch.randn(4)\n                noise = noise.to(dev)",
        "torch.randn",
        "`torch.randn(4, device=dev)`",
    ),
}

#: The right idioms: nothing is built on the host and copied.
CLEAN = [
    "t = torch.randn(out.shape, device=out.device)",
    "t = torch.randn(out.shape, device=dev)",
    "t = torch.ones_like(out) + torch.randn_like(out)",
    "t = out.new_full((2,), 1.5) + out.new_zeros(2)",
    "t = out.new_ones(4) * 2",
    "t = x.to(dev)",  # the batch
    "t = CONSTANT_ON_DEVICE * 2",  # built outside the step and moved once
    "t = torch.zeros(4, device='cpu').to(dev)",  # a host buffer on purpose
    "t = torch.arange(4)",  # built on the host, never moved
    "t = torch.tensor(2.0) * out",  # a host scalar used as a number
]

LOOP = """
import numpy
import torch

ARRAY = numpy.ones((4, 1))

def train(watch, model, batches, **options):
    dev = torch.device("cpu")
    with watch(**options) as run:
        CONSTANT_ON_DEVICE = torch.tensor([1.0, 2.0]).to(dev)
        for x, y in batches:
            with run.step():
                out = model(x)
                {line}  # HERE
    return run
"""

MODULE = """
import numpy
import torch
import pytorch_lightning as pl

ARRAY = numpy.ones((4, 1))

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.register_buffer("scale", torch.tensor([2.0]))
        self.weights = torch.tensor([1.0, 3.0])
        self.lazy = torch.tensor([1.0, 3.0])

    def training_step(self, batch, batch_idx):
        x, y = batch
        dev = self.device
        out = self.layer(x) * self.scale.to(dev)
        loss = torch.nn.functional.mse_loss(out, y)
        self.log("loss", loss, prog_bar=True)
        {line}  # HERE
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
"""


@pytest.fixture(autouse=True)
def quiet_lightning() -> Any:
    logger = logging.getLogger("pytorch_lightning")
    level = logger.level
    logger.setLevel(logging.WARNING)
    yield
    logger.setLevel(level)


def fit(module: Any, steps: int = 2, **options: Any) -> Report:
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)

    def go() -> Any:
        with watch(**options) as run:
            trainer.fit(module.Model(), loader)
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return report_of(go)


def _diagnose(module: Any) -> str:
    from pytest_torchperf import core, stacks
    from pytest_torchperf.watching import installed_probes

    with watch():
        inside = (torch.randn, torch.Tensor.to, installed_probes(), list(core.active_runs()),
                  stacks.classify(module.__file__), stacks.classify._roots)
    return f"before: runs={core.active_runs()} probes={installed_probes()}; inside a watch: {inside}"


def events(report: Report) -> list[dict[str, Any]]:
    return report["on_device"].figures["events"]


def user_events(report: Report) -> list[dict[str, Any]]:
    return [e for e in events(report) if e["code"] == "user"]


# -- every pattern, at its line ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PATTERNS))
def test_each_pattern_is_caught_at_its_line_in_a_plain_loop(tmp_path: Path, name: str) -> None:
    line, factory, spelled = PATTERNS[name]
    spelled = spelled[0] if isinstance(spelled, tuple) else spelled
    module, lineno = write_module(tmp_path, f"place_{name}", LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    check = report["on_device"]
    assert check.status == "failed", _diagnose(module)
    (event,) = events(report)
    created = lineno - 1 if name == "two_lines" else lineno
    assert event["created_at"].endswith(f"place_{name}.py:{created}")
    assert event["moved_at"].endswith(f"place_{name}.py:{lineno}")
    assert event["factory"] == factory
    assert event["kind"] == "built in the step"
    assert event["frequency"] == "1 per step over 3 steps"
    assert spelled in event["hint"], event["hint"]
    assert check.findings[0].hint == event["hint"]


@pytest.mark.parametrize("name", list(PATTERNS))
def test_each_pattern_is_caught_at_its_line_in_a_lightning_training_step(tmp_path: Path, name: str) -> None:
    line, factory, spelled = PATTERNS[name]
    spelled = spelled[1] if isinstance(spelled, tuple) else spelled
    line = line.replace("\n                ", "\n        ")
    module, lineno = write_module(tmp_path, f"lplace_{name}", MODULE.format(line=line))
    report = fit(module, steps=2)
    check = report["on_device"]
    assert check.status == "failed", check.summary
    (event,) = user_events(report)  # Lightning's own logging state is at most a note
    assert event["moved_at"].endswith(f"lplace_{name}.py:{lineno}")
    assert event["function"] == "training_step"
    assert event["factory"] == factory
    assert event["frequency"] == "1 per step over 2 steps"
    assert spelled in event["hint"]


@pytest.mark.parametrize("line", CLEAN)
def test_the_right_idioms_pass_in_a_plain_loop(tmp_path: Path, line: str) -> None:
    module, _ = write_module(tmp_path, "place_clean", LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no host-built tensor copied over 2 steps"


def test_the_right_idioms_pass_in_a_lightning_step(tmp_path: Path) -> None:
    body = "; ".join(line for line in CLEAN if "CONSTANT" not in line)
    module, _ = write_module(tmp_path, "lplace_clean", MODULE.format(line=body))
    report = fit(module, steps=3)
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    assert not user_events(report)
    assert check.summary.startswith("no host-built tensor copied over 3 steps")


def test_lightning_logging_state_is_a_note_not_a_violation(tmp_path: Path) -> None:
    module, _ = write_module(tmp_path, "lplace_log", MODULE.format(line="pass"))
    report = fit(module, steps=3)
    check = report["on_device"]
    assert check.status == "passed"
    notes = [e for e in events(report) if e["code"] == "framework"]
    assert notes, "Lightning builds its logging state with torch.tensor(...) and moves it"
    assert all(e["created_at"].startswith("pytorch_lightning/") for e in notes)
    # Lightning moves its logging state once and stores it back: never "the very same tensor copied again".
    assert {e["kind"] for e in notes} == {"built in the step"}
    assert check.summary.endswith("in pytorch_lightning (noted)")
    assert all(f.title.startswith("note: ") and not f.hint for f in check.findings)
    assert {e["hint"] for e in notes} == {""}  # not spelled out at all (it reads the source): nobody is shown one


def test_a_constant_built_in_init_and_copied_every_step_is_caught(tmp_path: Path) -> None:
    module, lineno = write_module(tmp_path, "lplace_constant", MODULE.format(line="w = self.weights.to(dev)"))
    report = fit(module, steps=3)
    (event,) = user_events(report)
    assert event["kind"] == "built once, copied every step"
    source = (tmp_path / "lplace_constant.py").read_text().splitlines()
    created = next(i for i, text in enumerate(source, 1) if "self.weights = torch.tensor" in text)
    assert event["created_at"].endswith(f"lplace_constant.py:{created}")
    assert event["moved_at"].endswith(f"lplace_constant.py:{lineno}")
    assert event["frequency"] == "1 per step over 3 steps"
    assert 'self.register_buffer("name", torch.tensor([1.0, 3.0]), persistent=False)' in event["hint"]
    finding = report["on_device"].findings[0]
    assert "the very same tensor was copied in 3 steps" in "\n".join(finding.facts)


def test_an_attribute_moved_once_and_stored_back_passes(tmp_path: Path) -> None:
    """``self.lazy = self.lazy.to(dev)``: the first step copies it, later moves are no-ops on the device."""
    module, _ = write_module(tmp_path, "lplace_lazy", MODULE.format(line="self.lazy = self.lazy.to(dev)"))
    report = fit(module, steps=3)
    assert report["on_device"].status == "passed", report["on_device"].render(False)
    assert not user_events(report)


def test_a_registered_buffer_moves_with_its_module(tmp_path: Path) -> None:
    """``self.scale.to(dev)`` in MODULE is a no-op on the device: the buffer moved with the module."""
    module, _ = write_module(tmp_path, "lplace_buffer", MODULE.format(line="s = self.scale.to(dev) * 2"))
    report = fit(module, steps=2)
    assert report["on_device"].status == "passed"


def test_moving_a_model_built_in_the_test_is_not_a_violation() -> None:
    with watch(scope="test") as run:
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        model.to(torch.device("cpu"))
        for x, _ in batches(2):
            with run.step():
                model(x.to("cpu")).sum().backward()
    assert run.report["on_device"].status == "passed"


def test_cuda_on_a_machine_without_cuda_still_names_the_line(tmp_path: Path) -> None:
    """``.cuda()`` raises without CUDA: the test fails with that error, and the report still names the line."""
    if torch.cuda.is_available():
        pytest.skip("CUDA present: the call succeeds")
    module, lineno = write_module(
        tmp_path,
        "place_cuda",
        """
        import torch

        RUNS = []

        def train(watch, model, batches):
            with watch() as run:
                RUNS.append(run)
                for x, y in batches:
                    with run.step():
                        t = torch.rand(4).cuda()  # HERE
        """,
    )
    with pytest.raises(AssertionError, match="not compiled with CUDA"):
        module.train(watch, torch.nn.Linear(8, 1), batches(2))
    (run,) = module.RUNS
    (event,) = events(run.report)
    assert event["moved_at"].endswith(f"place_cuda.py:{lineno}")
    assert event["moved_by"] == "cuda"
    assert '`torch.rand(4, device="cuda")`' in event["hint"]


def test_counts_and_scope(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "place_counts",
        """
        import torch

        def train(watch, model, batches, **options):
            dev = torch.device("cpu")
            with watch(**options) as run:
                for i, (x, y) in enumerate(batches):
                    with run.step():
                        for j in range(2):
                            t = torch.zeros(3).to(dev)  # HERE
                    outside = torch.ones(2).to(dev)
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    (event,) = events(report)
    assert event["frequency"] == "2 per step over 3 steps"
    assert (
        report["on_device"].summary == f"6 host-built tensor copies from {event['created_at']}: 2 per step over 3 steps"
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3), scope="test")
    found = {e["moved_at"].rsplit(":", 1)[1]: e["frequency"] for e in events(report)}
    assert found == {str(lineno): "2 per step over 3 steps", str(lineno + 1): "3 times outside training steps"}


def test_on_device_false_turns_the_check_off(tmp_path: Path) -> None:
    module, _ = write_module(tmp_path, "place_off", LOOP.format(line="t = torch.rand(4).to(dev)"))
    run = module.train(watch, torch.nn.Linear(8, 1), batches(2), on_device=False)
    assert "on_device" not in run.report.checks


# -- allowed_copies --------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["site", "creation_site", "function", "file"])
def test_allowed_copies_accepts_a_known_copy(tmp_path: Path, how: str) -> None:
    module, lineno = write_module(
        tmp_path,
        "place_allow",
        """
        import torch

        def make_noise(n):
            return torch.randn(n)

        def train(watch, model, batches, **options):
            dev = torch.device("cpu")
            with watch(**options) as run:
                for x, y in batches:
                    with run.step():
                        t = make_noise(4).to(dev)  # HERE
            return run
        """,
    )
    allowed = {
        "site": f"place_allow.py:{lineno}",
        "creation_site": f"place_allow.py:{lineno - 7}",
        "function": "make_noise",
        "file": "place_allow.py",
    }[how]
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2), allowed_copies=[allowed])
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no host-built tensor copied over 2 steps; 2 allowed"
    (event,) = events(report)
    assert event["allowed_by"] == allowed


def test_allowed_copies_is_validated() -> None:
    with pytest.raises(UsageError, match="allowed_copies entry 'x.py:-1' has line -1"):
        parse_options({"allowed_copies": ["x.py:-1"]})
    with pytest.raises(UsageError, match=r"allowed_copies must be a list of strings.*got \{'a': 1\} \(dict\)"):
        parse_options({"allowed_copies": {"a": 1}})
    assert parse_options({"allowed_copies": ("a.py", "Model.training_step")}).allowed_copies == (
        "a.py", "Model.training_step",
    )


# -- the report, through pytest -------------------------------------------------------------------


def test_failure_report_names_both_sites_and_the_device_side_spelling(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_noise="""
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Noisy(TinyModule):
            def training_step(self, batch, batch_idx):
                x, y = batch
                noise = torch.randn(x.shape)
                x = x + noise.to(self.device)
                return super().training_step((x, y), batch_idx)

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(Noisy(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: on_device (8 host-built tensor copies from test_noise.py:8: "
            "1 per step over 8 steps)*",
            "*- torchperf: on_device -*",
            "torch.randn(...) built on the host, then copied with .to(...) in training_step: 1 per step over 8 steps",
            "  created at test_noise.py:8: noise = torch.randn(x.shape)",
            "  moved at test_noise.py:9: x = x + noise.to(self.device)",
            "  tensor: shape (8, 8), float32",
            "  on this CPU-only run the move is a no-op; on a GPU it is a host-to-device copy each time",
            "  created by torch.randn (8x) at test_noise.py:8 in training_step [[]your code[]]",
            "*> test_noise.py:8 in training_step",
            "  copied by .to(...) (8x) at test_noise.py:9 in training_step [[]your code[]]",
            "*> test_noise.py:9 in training_step",
            "  hint: create it on the device: `torch.randn(x.shape, device=self.device)`",
        ]
    )


# -- CUDA: real copies -------------------------------------------------------------------------------


@cuda
def test_cuda_randn_then_cuda_is_a_real_copy() -> None:
    with pytest.raises(Exception) as excinfo:
        with watch(no_host_sync=False) as run:
            for _ in range(2):
                with run.step():
                    torch.rand(4).cuda()
    report = excinfo.value.report  # type: ignore[attr-defined]
    (event,) = events(report)
    assert event["moved_by"] == "cuda" and event["count"] == 2


@cuda
def test_cuda_real_copies_of_tensors_not_from_the_loader_are_reported() -> None:
    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4)
    table = torch.randn(100, 4)  # built before the watch: not a host-born tensor of the step
    with pytest.raises(Exception) as excinfo:
        with watch(no_host_sync=False) as run:
            for (x,) in loader:
                with run.step():
                    x = x.to("cuda")  # the batch: fine
                    pinned = torch.zeros(4, pin_memory=True).to("cuda", non_blocking=True)  # on purpose: fine
                    rows = table[:4].to("cuda")  # a real copy every step
    report = excinfo.value.report  # type: ignore[attr-defined]
    (event,) = events(report)
    assert event["kind"] == "copied from the host"
    assert event["real_copy"] is True
    assert event["moved_source"].startswith("rows = table[:4].to")
    del pinned, rows


HELPER_LOOP = """
import torch


def class_weights():
    return torch.Tensor([1, 2, 3])


def train(watch, model, batches, **options):
    dev = torch.device("cpu")
    with watch(**options) as run:
        for x, y in batches:
            with run.step():
                out = model(x)
                {line}  # HERE
    return run
"""


@pytest.mark.parametrize(
    ("name", "line", "factory"),
    [
        ("indexed", "w = torch.arange(10).float()[torch.tensor([1, 3, 5])].to(dev)", "torch.arange"),
        ("helper", "w = class_weights().to(dev)", "torch.Tensor"),
    ],
)
def test_a_host_value_reached_through_indexing_or_a_helper_and_moved_every_step_fails(
    tmp_path: Path, name: str, line: str, factory: str
) -> None:
    module, lineno = write_module(tmp_path, f"reached_{name}", HELPER_LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    check = report["on_device"]
    assert check.status == "failed", check.summary
    (event,) = events(report)
    assert event["moved_at"].endswith(f"reached_{name}.py:{lineno}")
    assert event["factory"] == factory
    assert event["frequency"] == "1 per step over 3 steps"


def test_a_device_factory_indexed_and_moved_passes(tmp_path: Path) -> None:
    line = "w = torch.arange(10, device=dev).float()[out.argmax(0)].to(dev)"
    module, _ = write_module(tmp_path, "reached_device", HELPER_LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    assert report["on_device"].status == "passed", report["on_device"].summary


#: A tokenizer's padded batch, written here (transformers is not in the test environment): a ``UserDict`` of
#: tensors built on the host from text, with its own ``.to(device)`` (what ``transformers.BatchEncoding`` is).
ENCODING_LOOP = """
from collections import UserDict

import torch


class Encoding(UserDict):
    def to(self, device):
        self.data = {key: value.to(device) for key, value in self.data.items()}
        return self


def tokenize(texts):
    longest = max(len(text.split()) for text in texts)
    ids = [[len(word) for word in text.split()] + [0] * (longest - len(text.split())) for text in texts]
    return Encoding(input_ids=torch.tensor(ids), attention_mask=torch.tensor(ids).gt(0).long())


TEXTS = ["a tiny batch", "of text", "padded to one length", "each step"]


def train(watch, model, batches, collate=False):
    dev = torch.device("cpu")
    loader = torch.utils.data.DataLoader(TEXTS, batch_size=2, collate_fn=tokenize)
    with watch() as run:
        for step in range(3):
            with run.step():
                batch = next(iter(loader)) if collate else tokenize(TEXTS[:2])
                batch = batch.to(dev)  # HERE
                model(batch["input_ids"].float()[:, :1]).sum().backward()
    return run
"""


@pytest.mark.parametrize("collate", [False, True], ids=["built_in_the_step", "from_a_collate_fn"])
def test_a_tokenizers_padded_batch_moved_by_its_own_to_is_input_data(tmp_path: Path, collate: bool) -> None:
    module, _ = write_module(tmp_path, f"encoding_{collate}", ENCODING_LOOP)
    report = report_of(module.train, watch, torch.nn.Linear(1, 1), None, collate)
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    assert check.summary == "no host-built tensor copied over 3 steps"
