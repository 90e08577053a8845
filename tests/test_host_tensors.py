"""Host tensors: provenance through cheap operations, legacy constructors, explicit host targets, data on the device.

As in ``test_on_device.py``, user code is written to a file so each site is a
known ``path:line``.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

from step_check_helpers import batches, report_of, write_module  # noqa: E402
from test_on_device import LOOP, PATTERNS  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pytest_torchperf import watch  # noqa: E402
from pytest_torchperf.report import Report  # noqa: E402

STEP = """
import torch

def train(watch, model, batches, **options):
    dev = torch.device("cpu")
    with watch(**options) as run:
        for x, y in batches:
            with run.step():
                out = model(x)
                {line}  # HERE
    return run
"""


def run_line(tmp_path: Path, name: str, line: str, steps: int = 3, **options: Any) -> tuple[Report, int]:
    module, lineno = write_module(tmp_path, name, STEP.format(line=line))
    return report_of(module.train, watch, torch.nn.Linear(8, 1), batches(steps), **options), lineno


def user_events(report: Report, check: str = "on_device") -> list[dict[str, Any]]:
    return [e for e in report[check].figures["events"] if e["code"] == "user"]


# -- provenance through a few cheap operations ------------------------------------------------

MASK = """
import torch

def causal_mask(n):
    mask = torch.triu(torch.ones(n, n), diagonal=1)  # BORN
    return mask.float().masked_fill(mask == 1, float("-inf")).masked_fill(mask == 0, 0.0)

def train(watch, model, batches):
    with watch() as run:
        for x, y in batches:
            with run.step():
                out = model(x)
                m = causal_mask(4).to(out.device)  # HERE
    return run
"""


def test_a_mask_built_from_a_host_factory_and_moved_every_step_is_caught(tmp_path: Path) -> None:
    """The square subsequent mask of Lightning's transformer demo, built on the host every step and moved."""
    module, lineno = write_module(tmp_path, "mask", MASK)
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    check = report["on_device"]
    assert check.status == "failed", check.summary
    (event,) = user_events(report)
    assert event["factory"] == "torch.ones"
    assert event["created_at"].endswith("mask.py:5") and event["moved_at"].endswith(f"mask.py:{lineno}")
    assert event["path"] == ["triu", "masked_fill"]
    assert event["frequency"] == "1 per step over 3 steps"
    assert "`torch.ones(n, n, device=out.device)` (then triu, masked_fill run on the device too)" in event["hint"]
    assert "build it once before the loop, `t = causal_mask(4).to(device)`" in event["hint"]
    assert check.findings[0].title.startswith("torch.ones(...).triu().masked_fill() built on the host")


def test_a_helper_called_once_at_one_line_and_every_step_at_another_shows_each_callers_stack(tmp_path: Path) -> None:
    """Lightning's transformer demo builds its mask with one helper, once for a cached mask and every step for
    another: the per-step copy's creation stack goes through the per-step line, not the first call's."""
    module, lineno = write_module(
        tmp_path,
        "two_callers",
        """
        import torch

        def causal_mask(n):
            return torch.ones(n, n).triu(1)

        def train(watch, model, batches):
            cached = None
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        out = model(x)
                        if cached is None:
                            cached = causal_mask(4).to(out.device)  # ONCE
                        m = causal_mask(4).to(out.device)  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(4))
    check = report["on_device"]
    assert check.status == "failed", check.summary
    (failing,) = [f for f in check.findings if not f.title.startswith("note:")]
    created = failing.sites[0]
    text = "\n".join(f"{frame.function}:{frame.lineno}" for frame in created.stack)
    assert f"train:{lineno}" in text and f"train:{lineno - 2}" not in text, text


@pytest.mark.parametrize(
    "line",
    [
        # nanoGPT's get_batch: `ix = torch.randint(...)`, then `data[i:i + block_size] for i in ix`
        "ix = torch.randint(90, (4,)); rows = [data[i:i + 8] for i in ix]",
        "ix = torch.randint(90, (4,)); rows = [data[int(i + 8)] for i in ix]",
        "ix = torch.randint(90, (4,)); rows = [data[-ix[k] - 1] for k in range(4)]",
    ],
)
def test_arithmetic_on_an_element_of_a_host_tensor_stays_on_the_host(tmp_path: Path, line: str) -> None:
    """The elements of a host tensor (iteration, indexing) are views of it; numbers added to them are host
    values too, so reading them is no sync."""
    report, _ = run_line(
        tmp_path, f"elements_{abs(hash(line)) % 10000}", "import numpy; data = numpy.arange(100); " + line
    )
    check = report["no_host_sync"]
    assert check.status == "passed" and not check.findings, check.render(False)
    assert check.figures["host_tensor_reads"] >= 3 * 4  # 4 elements a step, 3 steps


def test_a_batch_built_from_new_numpy_arrays_each_step_is_input_data_and_a_constant_array_is_not(
    tmp_path: Path,
) -> None:
    """nanoGPT's get_batch: `torch.stack([torch.from_numpy(data[i:i + n].astype(np.int64)) for i in ix])` moved
    every step is its input pipeline (a note); the same array converted and moved every step is a constant."""
    module, _ = write_module(
        tmp_path,
        "numpy_inputs",
        """
        import numpy as np
        import torch

        DATA = np.arange(200, dtype=np.uint16)
        WEIGHTS = np.ones((4, 1))

        def train(watch, model, batches, constant):
            dev = "cpu" if not torch.cuda.is_available() else "cuda"
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        if constant:
                            w = torch.from_numpy(WEIGHTS).float().to(dev)
                        else:
                            ix = torch.randint(len(DATA) - 8, (4,))
                            w = torch.stack([torch.from_numpy(DATA[i:i + 8].astype(np.int64)) for i in ix]).to(dev)
                        out = model(x)  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(4), False)
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    assert check.summary.endswith("4 copies of input data built by hand (noted)"), check.summary
    (event,) = check.figures["events"]
    assert event["input_data"] is True
    assert "input data (a batch built by hand)" in "\n".join(check.findings[0].facts)
    assert not check.findings[0].hint

    constant = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(4), True)["on_device"]
    assert constant.status == "failed", constant.summary
    assert "build it once before the loop" in constant.findings[0].hint


@pytest.mark.parametrize(
    "line, path",
    [
        ("t = (torch.rand(4) < 0.5).to(dev)", ["<"]),
        ("t = (1 - torch.ones(4)).to(dev)", ["-"]),
        ("t = (0.5 * torch.arange(4) + 1).to(dev)", ["*", "+"]),
        ("t = (~torch.zeros(4, dtype=torch.bool)).to(dev)", ["~"]),
        ("t = torch.cat([torch.zeros(2), torch.ones(2)]).to(dev)", ["cat"]),
        ("t = torch.stack([torch.zeros(2), torch.zeros(2)]).tril().to(dev)", ["stack", "tril"]),
        ("t = torch.ones(4).detach().clone().to(dev)", ["detach", "clone"]),
        ("t = (torch.ones(4) > 0) & (torch.zeros(4) < 1); t = t.to(dev)", [">", "&"]),
        ("t = (torch.ones(4) @ torch.ones(4, 4)).to(dev)", ["@"]),  # every operation is followed
        ("t = torch.ones(4).sum().to(dev)", ["sum"]),
    ],
)
def test_numbers_and_host_tensors_keep_the_provenance(tmp_path: Path, line: str, path: list[str]) -> None:
    report, lineno = run_line(tmp_path, "derived", line)
    assert report["on_device"].status == "failed", report["on_device"].summary
    (event,) = user_events(report)
    assert event["path"] == path
    assert event["kind"] == "built in the step"


@pytest.mark.parametrize(
    "line",
    [
        "t = (torch.ones(4, 1) * out).to(dev)",  # a device tensor in the operation: the result is on the device
        "t = torch.cat([torch.zeros(4, 1), out]).to(dev)",
        "t = (out @ torch.ones(1, 4)).to(dev)",  # a device tensor in any operation: the result is on the device
        "t = torch.einsum('ij,jk->ik', out, torch.ones(1, 4)).to(dev)",
    ],
)
def test_results_that_are_not_host_tensors_are_not_blamed(tmp_path: Path, line: str) -> None:
    report, _ = run_line(tmp_path, "not_host", line)
    assert report["on_device"].status == "passed", report["on_device"].render(False)


def test_batches_collated_from_host_tensors_are_not_host_built(tmp_path: Path) -> None:
    """default_collate stacks host tensors (torch's own call): the batch is a batch, not a host-built tensor."""
    model = torch.nn.Linear(8, 1)
    dev = torch.device("cpu")
    with watch(scope="test") as run:
        data = TensorDataset(torch.randn(12, 8), torch.randn(12, 1))  # built on the host inside the watch
        for x, y in DataLoader(data, batch_size=4):
            x, y = x.to(dev), y.to(dev)
            with run.step():
                torch.nn.functional.mse_loss(model(x), y).backward()
    assert run.report["on_device"].status == "passed", run.report["on_device"].render(False)


# -- the legacy constructors --------------------------------------------------------------------

@pytest.mark.parametrize(
    "line, factory, spelled",
    [
        ("t = torch.Tensor(4, 1).fill_(0.5).to(out.device)", "torch.Tensor",
         "`torch.full((4, 1), 0.5, device=out.device)`"),
        ("t = torch.FloatTensor(3).zero_().type_as(out)", "torch.FloatTensor",
         "`torch.empty(3, device=out.device)`"),
        ("t = torch.LongTensor(2).random_(5); t = t.to(dev)", "torch.LongTensor",
         "device=dev"),
        # imported by name (lightning-bolts' SimCLR loss: ``from torch import Tensor``) or through an alias
        ("from torch import Tensor; t = Tensor(out.shape).fill_(0.5).to(out.device)", "torch.Tensor",
         "`torch.full(out.shape, 0.5, device=out.device)`"),
        ("import torch as th; t = th.FloatTensor(3).zero_().type_as(out)", "torch.FloatTensor",
         "`torch.empty(3, device=out.device)`"),
    ],
)
def test_legacy_constructors_are_caught_from_the_source(tmp_path: Path, line: str, factory: str, spelled: str) -> None:
    report, lineno = run_line(tmp_path, "legacy", line)
    check = report["on_device"]
    assert check.status == "failed", check.summary
    (event,) = user_events(report)
    assert event["factory"] == factory
    assert event["kind"] == "built in the step"
    assert event["created_at"].endswith(f"legacy.py:{lineno}")
    assert spelled in event["hint"], event["hint"]
    assert "is a legacy constructor: it always builds on the host" in "\n".join(check.findings[0].facts)


def test_the_same_code_watched_again_is_read_from_what_the_first_watch_read(tmp_path: Path) -> None:
    """The lines' source facts outlive a watch (keyed by the code objects): a second watch of the same code
    gives the same verdicts, a legacy constructor and a plain batch move alike."""
    module, lineno = write_module(
        tmp_path, "legacy_again", STEP.format(line="t = torch.Tensor(4, 1).fill_(0.5).to(out.device)")
    )
    model = torch.nn.Linear(8, 1)
    first = report_of(module.train, watch, model, batches(3))
    again = report_of(module.train, watch, model, batches(3))
    for report in (first, again):
        assert report["on_device"].status == "failed", report["on_device"].summary
        (event,) = user_events(report)
        assert event["factory"] == "torch.Tensor"
        assert event["created_at"].endswith(f"legacy_again.py:{lineno}")
    assert first["on_device"].summary == again["on_device"].summary


def test_a_name_spelled_like_a_legacy_constructor_is_read_as_what_it_is(tmp_path: Path) -> None:
    """The source only shows the spelling: a ``Tensor`` or ``th.FloatTensor`` that is not torch's is no legacy
    constructor (here both build on the device)."""
    lines = (
        "Tensor = lambda *shape: torch.empty(*shape, device=dev); t = Tensor(4, 1).fill_(0.5).to(out.device)",
        "th = type('th', (), {'FloatTensor': staticmethod(lambda n: torch.empty(n, device=dev))}); "
        "t = th.FloatTensor(3).zero_().type_as(out)",
    )
    for i, line in enumerate(lines):
        report, _ = run_line(tmp_path, f"not_legacy_{i}", line)
        assert report["on_device"].status == "passed", report["on_device"].render(False)
        assert not user_events(report)


def test_a_legacy_tensor_built_on_an_earlier_line_is_found_there(tmp_path: Path) -> None:
    module, lineno = write_module(
        tmp_path,
        "legacy_lines",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        out = model(x)
                        noise = torch.FloatTensor(4, 1)
                        noise.normal_()
                        noise = noise.to(out.device)  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    (event,) = user_events(report)
    assert event["created_at"].endswith(f"legacy_lines.py:{lineno - 2}")
    assert event["moved_at"].endswith(f"legacy_lines.py:{lineno}")


def test_a_legacy_tensor_built_from_data_on_an_earlier_line_and_moved_by_name_is_caught(tmp_path: Path) -> None:
    """No initializer between the two lines registers it: the move of the named tensor is what finds the
    constructor, in the statement that assigned that name before (so a move cannot skip reading its line
    because its tensor is bound to a name, as every batch is)."""
    module, lineno = write_module(
        tmp_path,
        "legacy_named",
        """
        import torch

        def train(watch, model, batches):
            with watch() as run:
                for x, y in batches:
                    with run.step():
                        out = model(x)
                        rows = torch.Tensor([[0.5]] * 4)
                        rows = rows.to(out.device)  # HERE
            return run
        """,
    )
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(3))
    assert report["on_device"].status == "failed", report["on_device"].summary
    (event,) = user_events(report)
    assert event["factory"] == "torch.Tensor"
    assert event["created_at"].endswith(f"legacy_named.py:{lineno - 1}")
    assert event["moved_at"].endswith(f"legacy_named.py:{lineno}")


# -- explicit host targets -------------------------------------------------------------------------


def test_an_explicit_host_target_is_neither_a_copy_nor_a_sync(tmp_path: Path) -> None:
    report, _ = run_line(
        tmp_path, "explicit", 't = torch.tensor([1.0, 2.0]).to("cpu"); v = t[0].item(); w = t.to(device="cpu")'
    )
    assert report["on_device"].status == "passed", report["on_device"].render(False)
    assert report["no_host_sync"].status == "passed", report["no_host_sync"].render(False)
    assert report["no_host_sync"].figures["host_tensor_reads"] == 3


@pytest.mark.parametrize(
    "line, status",
    [
        # written out: a host target on purpose
        ('t = torch.tensor(1.0).to("cpu")', "passed"),
        ('t = torch.tensor(1.0, device="cpu:0")', "passed"),
        # a variable that holds "cpu" on this machine and the GPU on another (Lightning's DQN example:
        # `device = "cpu" if not self.on_gpu else index`): the training device, a copy there
        ('where = "cpu" if not torch.cuda.is_available() else 0; t = torch.tensor(1.0).to(where)', "failed"),
        ('where = "cpu" if not torch.cuda.is_available() else 0\n                t = torch.tensor(1.0, device=where)',
         "failed"),
        # the move on a line inside a longer statement (the DQN example's `log = {"reward": ....to(device), ...}`)
        ('where = "cpu" if not torch.cuda.is_available() else 0\n                log = {\n'
         '                    "reward": torch.tensor(1.0).to(where),\n                }', "failed"),
        ('log = {\n                    "reward": torch.tensor(1.0).to("cpu"),\n                }', "passed"),
    ],
)
def test_cpu_written_out_is_a_host_target_and_a_variable_holding_it_is_the_device(
    tmp_path: Path, line: str, status: str
) -> None:
    report, _ = run_line(tmp_path, f"cpu_{status}_{abs(hash(line)) % 10000}", line)
    assert report["on_device"].status == status, report["on_device"].render(False)


MODULE_CPU = """
import torch

def train(watch, batches, move):
    model = torch.nn.Linear(8, 1)
    with watch(scope="test") as run:
        if move:
            model.to(torch.device("cpu"))  # the training device (a torch.device, not the string "cpu")
        for x, y in batches:
            with run.step():
                model(x).sum().backward()
        model.cpu()  # HERE
    return run
"""


@pytest.mark.parametrize("move, status", [(False, "passed"), (True, "failed")])
def test_module_cpu_copies_only_a_module_that_was_moved(tmp_path: Path, move: bool, status: str) -> None:
    module, lineno = write_module(tmp_path, f"module_cpu_{move}", MODULE_CPU)
    report = report_of(module.train, watch, batches(2), move)
    check = report["no_host_sync"]
    assert check.status == status, check.render(False)
    if move:
        (event,) = check.figures["events"]
        assert event["operation"] == "cpu" and event["count"] == 4  # weight, bias and their gradients
        assert event["site"].endswith(f"module_cpu_{move}.py:{lineno}")


def test_a_formatted_host_scalar_is_not_a_sync(tmp_path: Path) -> None:
    """``format()`` of a 0-d tensor reads ``self.detach().item()``: the detached tensor is still a host tensor."""
    report, _ = run_line(tmp_path, "formatted", 's = f"{torch.tensor(3):d} {torch.tensor(0.5):.2f}"')
    assert report["no_host_sync"].status == "passed", report["no_host_sync"].render(False)


# -- python data built on the device inside a step -------------------------------------------------------


@pytest.mark.parametrize(
    "line, spelled",
    [
        ("t = torch.tensor(0.0, device=out.device)", "`torch.full((), 0.0, device=out.device)`"),
        ("t = torch.tensor([0, 0, 0], device=dev)", "`torch.zeros(3, device=dev, dtype=torch.int64)`"),
        ("t = torch.as_tensor([[1.0, 1.0]], device=dev)", "`torch.ones(1, 2, device=dev)`"),
        (
            "t = torch.tensor([1.0, 2.0], device=dev)",
            "build it once before the loop, `t = torch.tensor([1.0, 2.0], device=dev)`",
        ),
        ("t = out.new_tensor(2.5)", "`torch.full((), 2.5, device=out.device)`"),
    ],
)
def test_python_data_built_on_the_device_in_a_step_is_a_copy(tmp_path: Path, line: str, spelled: str) -> None:
    report, lineno = run_line(tmp_path, "data", line)
    check = report["on_device"]
    assert check.status == "failed", check.render(False)
    (event,) = user_events(report)
    assert event["kind"] == "python data copied to the device"
    assert event["moved_at"].endswith(f"data.py:{lineno}")
    assert spelled in event["hint"], event["hint"]
    assert "copies host memory to the device: on CUDA a blocking copy that waits for the stream" in event["hint"]
    assert "on CUDA a copy from pageable host memory is blocking" in "\n".join(check.findings[0].facts)


@pytest.mark.parametrize(
    "line",
    [
        "t = torch.tensor(0.0, device='cpu')",  # a host tensor on purpose
        "t = torch.tensor(out, device=dev)",  # a tensor converted, not python data
        "t = torch.full((), 0.5, device=out.device) + torch.zeros(3, device=dev)",
    ],
)
def test_device_factories_without_python_data_pass(tmp_path: Path, line: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.tensor(a_tensor) warns
        report, _ = run_line(tmp_path, "no_data", line)
    assert report["on_device"].status == "passed", report["on_device"].render(False)


def test_python_data_on_the_device_outside_the_steps_passes() -> None:
    with watch() as run:
        table = torch.tensor([1.0, 2.0], device=torch.device("cpu"))  # built once, before the loop
        for _ in range(3):
            with run.step():
                (table * 2).sum()
    assert run.report["on_device"].status == "passed"


# -- no hint recommends what another check flags -------------------------------------------------------

_SPELLED = re.compile(r"(?:create it on the device(?: with)?|without a copy): `([^`]+)`")


@pytest.mark.parametrize("name", list(PATTERNS))
def test_each_spelled_fix_passes_every_step_check(tmp_path: Path, name: str) -> None:
    """The code a hint spells, put in place of the pattern, passes on_device and no_host_sync."""
    line = PATTERNS[name][0].replace("\n                ", "; ")
    module, _ = write_module(tmp_path, f"bug_{name}", LOOP.format(line=line))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    (event,) = report["on_device"].figures["events"]
    spelled = _SPELLED.search(event["hint"])
    if spelled is None:
        assert "build it once" in event["hint"], event["hint"]  # a constant: built once, outside the step
        return
    if "copy_" in line:
        fixed = f"buffer = out.detach().clone(); buffer = {spelled.group(1)}"
    else:
        fixed = f"{line.split('=', 1)[0].strip()} = {spelled.group(1)}"
    module, _ = write_module(tmp_path, f"fixed_{name}", LOOP.format(line=fixed))
    report = report_of(module.train, watch, torch.nn.Linear(8, 1), batches(2))
    for check in ("on_device", "no_host_sync"):
        assert report[check].status == "passed", (fixed, report[check].render(False))


@pytest.mark.parametrize(
    "line",
    [
        "t = torch.tensor(0.0, device=out.device)",
        "t = torch.tensor([0, 0, 0], device=dev)",
        "t = out.new_tensor([1.0, 1.0])",
    ],
)
def test_each_spelled_fix_of_device_data_passes_every_step_check(tmp_path: Path, line: str) -> None:
    report, _ = run_line(tmp_path, "data_bug", line)
    (event,) = user_events(report)
    spelled = _SPELLED.search(event["hint"])
    assert spelled is not None, event["hint"]
    report, _ = run_line(tmp_path, "data_fixed", f"t = {spelled.group(1)}")
    for check in ("on_device", "no_host_sync"):
        assert report[check].status == "passed", report[check].render(False)


# -- a real Lightning fit ----------------------------------------------------------------------------


def test_lightning_transformer_demo_mask_is_caught_with_a_buffer_hint(tmp_path: Path) -> None:
    """The mask of pytorch_lightning.demos.transformer, built in forward and moved every step."""
    module, lineno = write_module(
        tmp_path,
        "demo_mask",
        """
        import torch
        import pytorch_lightning as pl

        class Model(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.Linear(8, 8)

            def generate_square_subsequent_mask(self, size):
                mask = torch.triu(torch.ones(size, size), diagonal=1)
                mask = mask.float().masked_fill(mask == 1, float("-inf")).masked_fill(mask == 0, 0.0)
                return mask

            def training_step(self, batch, batch_idx):
                x, y = batch
                mask = self.generate_square_subsequent_mask(x.size(0)).to(x.device)  # HERE
                out = torch.softmax(self.layer(x) @ self.layer(x).T + mask, dim=-1) @ x
                return out.sum()

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)
        """,
    )
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randn(16, 1)), batch_size=4)

    def fit() -> Any:
        with watch() as run:
            trainer.fit(module.Model(), loader)
        return run

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = report_of(fit)
    (event,) = user_events(report)
    assert event["moved_at"].endswith(f"demo_mask.py:{lineno}")
    assert event["path"] == ["triu", "masked_fill"]  # .float() of a float tensor returns the tensor itself
    assert (
        'self.register_buffer("name", self.generate_square_subsequent_mask(x.size(0)), persistent=False)'
        in event["hint"]
    )


# -- the copy rate: a lazy or periodic copy is a note --------------------------------------------------

LAZY = """
import torch

class Cached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
        self.mask = None

    def forward(self, x):
        if self.mask is None:
            self.mask = torch.triu(torch.ones(4, 4)).to(x.device)  # HERE
        return self.layer(x)

def train(watch, batches, **options):
    model = Cached()
    with watch(**options) as run:
        for i, (x, y) in enumerate(batches):
            with run.step():
                model(x).sum().backward()
                if i % 10 == 0:
                    image = torch.rand(4).to(x.device)  # every 10th step, like logging a sample
    return run
"""


def test_a_tensor_built_lazily_in_the_first_step_and_a_periodic_copy_are_notes(tmp_path: Path) -> None:
    module, lineno = write_module(tmp_path, "lazy", LAZY)
    data = [(torch.randn(4, 8), torch.randn(4, 1))] * 40
    report = report_of(module.train, watch, data)
    check = report["on_device"]
    assert check.status == "passed", check.render(False)
    cadences = {e["moved_at"].rsplit(":", 1)[1]: e["cadence"] for e in check.figures["events"]}
    assert cadences == {str(lineno): "once", str(lineno + 10): "periodic"}
    assert check.summary == "no host-built tensor copied over 40 steps; 4 periodic and 1 one-off in your code (noted)"
    assert [f.title.split(": ", 1)[0] for f in check.findings] == ["note", "note"]
    periodic = next(f for f in check.findings if "periodic" in f.title)
    assert (
        "copied in 4 of 40 steps, the first of them free; the other 3: 0.07 of the steps, within max_copy_rate=0.1: "
        "a note, not a failure (0 fails on it)" in periodic.facts
    ), periodic.facts
    assert report_of(module.train, watch, data, max_copy_rate=0)["on_device"].status == "failed"
    assert report_of(module.train, watch, data[:1])["on_device"].status == "failed"  # in every observed step
