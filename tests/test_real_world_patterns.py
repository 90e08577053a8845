"""Verdicts on patterns from real projects: host math followed, one policy for input batches, graphs kept
outside the loss, DataParallel wrappers driven through another method, messages, and the plugin as a guest
in a foreign suite (docs: the pages of on_device, no_graph_retention, no_data_parallel, max_overhead,
no_host_sync, and isolation).

Every test runs real user code through ``pytester`` (a test file, a marker or the fixture), as a user would.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pl = pytest.importorskip("pytorch_lightning")

EVERY_INVARIANT = (
    "no_host_sync=True, on_device=True, no_iterator_reset=True, max_overhead=0.5, min_workers=1, pin_memory=True, "
    "no_empty_cache=True, no_data_parallel=True, grads_set_to_none=True, no_recompiles=True, "
    "mixed_precision=True, no_graph_retention=True, max_memory_growth=1000000, "
    "no_unused_parameters_search=True, no_sync_accumulation=True"
)


# -- 1. host math is followed ----------------------------------------------------------------------

SINUSOIDAL = """
import math
import pytest
import torch

def timestep_embedding(n, d, dev):
    pos = torch.arange(n).float()
    inv = 1 / (10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.einsum("i,j->ij", pos, inv)
    return torch.cat([emb.sin(), emb.cos()], -1).to(dev)  # MOVE

def train(run, exp_and_matmul=False):
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dev = torch.device("cpu")
    for _ in range(4):
        with run.step():
            x = torch.ones(8, 16, device=dev)
            if exp_and_matmul:
                freqs = torch.exp(-math.log(10000.0) * torch.arange(8) / 8)
                table = (torch.arange(8).float()[:, None] @ freqs[None, :]).repeat(1, 2).to(dev)  # MOVE2
            else:
                table = timestep_embedding(8, 16, dev)
            loss = model(x + table).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

def test_sinusoidal(torchperf):
    with torchperf.watch() as run:
        train(run)

def test_exp_matmul(torchperf):
    with torchperf.watch() as run:
        train(run, exp_and_matmul=True)
"""


def test_host_math_through_pow_einsum_sin_cos_is_followed_to_its_move(pytester: pytest.Pytester) -> None:
    path = pytester.makepyfile(test_embedding=SINUSOIDAL)
    lines = path.read_text().splitlines()
    move = next(i for i, line in enumerate(lines, 1) if line.endswith("# MOVE"))
    move2 = next(i for i, line in enumerate(lines, 1) if line.endswith("# MOVE2"))
    result = pytester.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=2)
    out = result.stdout.str()
    assert f"moved at test_embedding.py:{move}:" in out, out
    assert f"moved at test_embedding.py:{move2}:" in out, out
    assert "torch.arange(...).float().einsum().sin().cat() built on the host" in out, out
    assert "torch.arange(...).float() @ ….repeat() built on the host" in out, out


# -- 7. a guest in a foreign suite -----------------------------------------------------------------

MOCKED_CLOCKS = f"""
import time
from unittest import mock
import pytest
import torch

def loop():
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    for _ in range(3):
        loss = model(torch.ones(2, 4, requires_grad=True)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append((time.perf_counter(), time.monotonic()))
    return seen

def check():
    with mock.patch("time.perf_counter", side_effect=[1.0, 2.0, 3.0]), \\
            mock.patch("time.monotonic", side_effect=[10.0, 20.0, 30.0]):
        assert loop() == [(1.0, 10.0), (2.0, 20.0), (3.0, 30.0)]

def test_plain():
    check()

@pytest.mark.torchperf({EVERY_INVARIANT}, scope="test")
def test_watched():
    check()
"""


def test_a_test_mocking_the_clocks_runs_identically_watched_with_every_invariant(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_clocks=MOCKED_CLOCKS)
    result = pytester.runpytest("-p", "no:warnings", "--torchperf-report-only", "-rA")
    result.assert_outcomes(passed=2)
    assert "StopIteration" not in result.stdout.str()


def test_the_plugin_reads_no_clock_through_the_time_module() -> None:
    """Every clock of the package is bound at import (see ``pytest_torchperf.clocks``)."""
    import pathlib
    import re

    import pytest_torchperf

    root = pathlib.Path(pytest_torchperf.__file__).parent
    pattern = re.compile(r"\btime\.(perf_counter|monotonic|time|process_time|thread_time|sleep)\b")
    offenders = [
        f"{path.relative_to(root)}:{i}"
        for path in root.rglob("*.py")
        if path.name != "clocks.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not offenders, offenders


THREADS = """
import os
import pytest
import torch

def test_unmarked(request):
    (request.config.rootpath / f"unmarked-{os.environ['PYTEST_XDIST_WORKER']}.txt").write_text(
        f"{torch.get_num_threads()} {os.environ.get('OMP_NUM_THREADS')}"
    )

@pytest.mark.torchperf
def test_marked(request):
    (request.config.rootpath / f"marked-{os.environ['PYTEST_XDIST_WORKER']}.txt").write_text(
        f"{torch.get_num_threads()}"
    )

def test_unmarked_after(request):
    test_unmarked(request)
"""


def test_under_xdist_only_watched_tests_get_the_thread_setting(pytester: pytest.Pytester, monkeypatch) -> None:
    pytest.importorskip("xdist")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    pytester.makepyfile(test_threads=THREADS)
    plain = pytester.runpytest_subprocess("-n", "2", "-p", "no:torchperf", "-p", "no:cacheprovider")
    plain.assert_outcomes(passed=3)
    unwatched = {p.read_text() for p in pytester.path.glob("unmarked-*.txt")}
    for p in pytester.path.glob("*.txt"):
        p.unlink()
    result = pytester.runpytest_subprocess("-n", "2", "-p", "no:cacheprovider", "--torchperf-threads=1")
    result.assert_outcomes(passed=3)
    seen = {p.read_text() for p in pytester.path.glob("unmarked-*.txt")}
    assert seen == unwatched, (seen, unwatched)
    assert {p.read_text() for p in pytester.path.glob("marked-*.txt")} == {"1"}


# -- 4. wrappers not called through forward --------------------------------------------------------

MM_DATA_PARALLEL = """
import pytest
import torch
from torch.nn.parallel import DataParallel

class MMDataParallel(DataParallel):
    '''mmcv's wrapper (mmcv/parallel/data_parallel.py): the runner calls train_step, never forward.'''

    def __init__(self, *args, dim=0, **kwargs):
        super().__init__(*args, dim=dim, **kwargs)
        self.dim = dim

    def scatter(self, inputs, kwargs, device_ids):
        return (inputs,), (kwargs,)

    def train_step(self, *inputs, **kwargs):
        if not self.device_ids:
            inputs, kwargs = self.scatter(inputs, kwargs, [-1])
            return self.module.train_step(*inputs[0], **kwargs[0])
        inputs, kwargs = self.scatter(inputs, kwargs, self.device_ids)
        return self.module.train_step(*inputs[0], **kwargs[0])

class Detector(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def train_step(self, data, optimizer):
        loss = self.net(data).pow(2).mean()
        return {"loss": loss}

@pytest.fixture
def model():
    return MMDataParallel(Detector(), device_ids=None)

def test_built_outside(torchperf, model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with torchperf.watch() as run:
        for _ in range(3):
            with run.step():
                out = model.train_step(torch.ones(2, 4), opt)
                out["loss"].backward()
                opt.step()

@pytest.mark.torchperf
def test_built_inside():
    model = MMDataParallel(Detector(), device_ids=None)
    model.net_copy = None
"""


def test_a_data_parallel_subclass_driven_through_train_step_is_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mm=MM_DATA_PARALLEL)
    result = pytester.runpytest("-p", "no:warnings", "--torchperf-json=out.json")
    result.assert_outcomes(failed=1, passed=1)  # one built and never run is a note (issue 45)
    out = result.stdout.str()
    assert "no DataParallel in the run" not in out, out
    assert "MMDataParallel(Detector) was driven through MMDataParallel.train_step (3 calls)" in out, out
    assert "MMDataParallel is a torch.nn.DataParallel subclass" in out, out
    doc = json.loads((pytester.path / "out.json").read_text())
    inside = next(t for t in doc["tests"] if t["nodeid"].endswith("test_built_inside"))["checks"]["no_data_parallel"]
    assert inside["summary"] == "no DataParallel ran; 1 DataParallel module built and never run (noted)"


# -- 3. a graph kept alive outside the loss --------------------------------------------------------

AUX_HEAD = """
import pytest
import torch

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = torch.nn.Linear(8, 16)
        self.head = torch.nn.Linear(16, 1)
        self.probe_head = torch.nn.Linear(16, 3)  # not part of the loss: an epoch-end metric only

    def forward(self, x):
        h = torch.relu(self.trunk(x))
        return self.head(h), self.probe_head(h.detach())

class Loop:
    def __init__(self):
        self.metric_inputs = []
        self.periodic = []

    def run(self, steps, periodic=False):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        window = []
        with pytest.torchperf_watch(no_graph_retention=True) as run:
            for i in range(steps):
                with run.step():
                    out, probs = model(torch.randn(4, 8))
                    loss = torch.nn.functional.mse_loss(out, torch.zeros(4, 1))
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    self.metric_inputs.append(probs.softmax(-1))  # predictions kept for the epoch's end
                    if periodic:
                        window.append(out)
                        if len(window) == 4:
                            self.periodic.append(torch.stack(window).sum(0))  # spans 4 steps, added every 4th
                            window = []

def test_aux_head(torchperf):
    pytest.torchperf_watch = torchperf.watch
    Loop().run(8)

def test_two_holders(torchperf):
    pytest.torchperf_watch = torchperf.watch
    Loop().run(12, periodic=True)
"""


def test_predictions_of_a_head_outside_the_loss_kept_in_a_list_fail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_aux=AUX_HEAD)
    result = pytester.runpytest("-p", "no:warnings", "-k", "aux_head")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "no_graph_retention (graphs of" in out and "kept by Loop.metric_inputs" in out, out
    assert "Loop.metric_inputs: list of 7 tensors with autograd graphs, one per step (steps 1-7)" in out, out


def test_the_holder_that_grew_every_step_is_named_first(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_aux=AUX_HEAD)
    result = pytester.runpytest("-p", "no:warnings", "-k", "two_holders")
    result.assert_outcomes(failed=1)
    out = result.stdout.str()
    assert "kept by Loop.metric_inputs (+" in out, out
    assert out.index("Loop.metric_inputs: list of") < out.index("Loop.periodic: list of"), out


# -- 6. messages a newcomer can act on -------------------------------------------------------------


@pytest.mark.parametrize(
    "value, expected",
    [(0.5, 0.5), ("50%", 0.5), ("150%", 1.5), (1.0, 1.0), (1, 1.0), (2.5, 2.5), ("250%", 2.5), (10.0 - 0.5, 9.5),
     ("10000%", 100.0), ("12.5%", 0.125)],
)
def test_max_overhead_is_a_fraction_or_a_percentage_written_out(value: object, expected: float) -> None:
    from pytest_torchperf import parse_options

    assert parse_options({"max_overhead": value}).max_overhead == expected


@pytest.mark.parametrize(
    "value, message",
    [
        (5, 'max_overhead=5 reads as a percentage typed without its % sign: did you mean max_overhead=0.05 or '
            'max_overhead="5%"? (for 500%, write max_overhead="500%")'),
        (3.0, 'did you mean max_overhead=0.03 or max_overhead="3%"? (for 300%, write max_overhead="300%")'),
        (50, 'did you mean max_overhead=0.5 or max_overhead="50%"? (for 5000%, write max_overhead="5000%"); '
             'max_overhead is a number > 0 and at most 10'),
        (12.5, 'did you mean max_overhead=0.125 or max_overhead="12.5%"?'),
        ("20000%", "max_overhead must be a finite number > 0 and at most 10000%"),
    ],
)
def test_a_whole_number_or_a_number_above_ten_is_refused_as_a_percentage_without_its_sign(
    value: object, message: str
) -> None:
    from pytest_torchperf import UsageError, parse_options

    with pytest.raises(UsageError) as excinfo:
        parse_options({"max_overhead": value}, where="@pytest.mark.torchperf")
    assert message in str(excinfo.value)


def test_a_percentage_given_as_a_fraction_is_refused_with_did_you_mean(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_typo="""
        import pytest

        @pytest.mark.torchperf(max_overhead=50)
        def test_overhead():
            pass

        @pytest.mark.torchperf(max_copy_rate=20)
        def test_rate():
            pass

        @pytest.mark.torchperf(max_overhead=2.5)
        def test_allowance_above_100_percent_is_taken():
            pass  # no fit: the check runs (and says so), the marker is not an error
        """
    )
    result = pytester.runpytest("-p", "no:warnings")
    result.assert_outcomes(errors=2, failed=1)
    result.stdout.fnmatch_lines(["*max_overhead*no Trainer.fit to compare*"])
    result.stdout.fnmatch_lines([
        "*max_overhead=50 reads as a percentage typed without its % sign: did you mean max_overhead=0.5 or "
        "max_overhead=\"50%\"?*",
        "*max_copy_rate must be a number from 0 to 1*got 20 (int): a fraction, not a percentage: did you mean "
        "max_copy_rate=0.20 (20%)?*",
    ])


LIGHTNING_NOTES = """
import pytest
import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

class TinyRegressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        noise = torch.randn(x.shape).to(self.device)
        loss = torch.nn.functional.mse_loss(self.net(x + noise), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

@pytest.mark.torchperf
def test_fit(tmp_path):
    data = DataLoader(TensorDataset(torch.randn(32, 8), torch.randn(32, 1)), batch_size=8)
    pl.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=str(tmp_path)).fit(TinyRegressor(), data)
"""


def test_lightning_s_own_host_tensors_are_one_line_beside_an_on_device_failure(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_notes=LIGHTNING_NOTES)
    short = pytester.runpytest("-p", "no:warnings")
    short.assert_outcomes(failed=1)
    out = short.stdout.str()
    assert "not by your code (the training framework's own code)" not in out, out
    short.stdout.fnmatch_lines([
        "*note: * more from pytorch_lightning's own code (result.py:*), not from yours: notes, not failures "
        "(-v shows them)*",
    ])
    verbose = pytester.runpytest("-p", "no:warnings", "-v").stdout.str()
    assert "made by pytorch_lightning, not by your code" in verbose, verbose


def test_a_lightning_hook_the_user_never_wrote_is_not_named_after_the_user_s_class() -> None:
    from pytest_torchperf.overhead.attribution import _module_hook_label

    class TinyRegressor(pl.LightningModule):
        def on_train_batch_end(self, *args: object) -> None:
            pass

    module = TinyRegressor()
    assert _module_hook_label(module, "on_train_batch_end") == "TinyRegressor.on_train_batch_end (LightningModule hook)"
    label = _module_hook_label(module, "configure_gradient_clipping")
    assert not label.startswith("TinyRegressor."), label
    assert label == (
        "LightningModule.configure_gradient_clipping (Lightning's own hook: TinyRegressor does not override it)"
    )


def test_the_no_host_sync_hint_says_each_thing_once(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_item="""
        import torch

        def test_loop(torchperf):
            model = torch.nn.Linear(4, 1)
            with torchperf.watch() as run:
                for _ in range(4):
                    with run.step():
                        loss = model(torch.ones(2, 4)).sum()
                        seen = loss.item()
        """
    )
    result = pytester.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    (hint,) = [line for line in result.stdout.lines if "hint:" in line and ".item()" in line]
    assert hint.count("every N steps or at epoch end") == 1, hint
    assert "(that periodic sync is a note, not a failure, at max_sync_rate=0.1)" in hint, hint


# -- 2. one policy for input batches ---------------------------------------------------------------

BATCHES = """
import numpy as np
import pytest
import torch

DEV = torch.device("cpu")
CONSTANT = [[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]]

def replay_batches(spell):
    rng = np.random.default_rng(0)
    model = torch.nn.Linear(4, 1)
    with pytest.torchperf_watch() as run:
        for _ in range(4):
            with run.step():
                obs = rng.standard_normal((2, 4)).astype(np.float32)  # a fresh sample every step
                x = spell(obs)
                model(x).sum().backward()

def copy_twice(obs):
    return torch.tensor(obs).to(DEV)  # TWICE

def legacy(obs):
    next_obs = obs
    return torch.Tensor(next_obs).to(DEV)  # LEGACY

def test_tensor_of_an_array_then_to(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(copy_twice)

def test_legacy_tensor_of_an_array(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(legacy)

def test_as_tensor_on_the_device(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(lambda obs: torch.as_tensor(obs, device=DEV))

def test_from_numpy_then_to(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(lambda obs: torch.from_numpy(obs).to(DEV))

def test_list_of_lists(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(lambda obs: torch.tensor(obs.tolist()).to(DEV))

def test_legacy_tensor_of_a_list(torchperf):
    pytest.torchperf_watch = torchperf.watch
    def spell(obs):
        rows = obs.tolist()
        return torch.Tensor(rows).to(DEV)
    replay_batches(spell)

def test_constant_rebuilt_every_step(torchperf):
    pytest.torchperf_watch = torchperf.watch
    replay_batches(lambda obs: torch.tensor(CONSTANT).to(DEV))
"""


def test_input_batches_one_policy_for_every_spelling(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_batches=BATCHES)
    result = pytester.runpytest("-p", "no:warnings", "-rA")
    outcomes = {
        line.split(" ")[1].split("::")[1]: line.split(" ")[0]
        for line in result.stdout.lines
        if line.startswith(("PASSED test_batches.py", "FAILED test_batches.py"))
    }
    assert outcomes == {
        "test_tensor_of_an_array_then_to": "FAILED",  # an avoidable host copy
        "test_legacy_tensor_of_an_array": "FAILED",  # CleanRL's torch.Tensor(next_obs).to(device)
        "test_as_tensor_on_the_device": "PASSED",  # the fix: fresh input data moved once
        "test_from_numpy_then_to": "PASSED",
        "test_list_of_lists": "PASSED",  # input data, not a constant
        "test_legacy_tensor_of_a_list": "PASSED",  # not silent: a note
        "test_constant_rebuilt_every_step": "FAILED",  # build it once
    }, result.stdout.str()
    out = result.stdout.str()
    assert "torch.tensor(<numpy array>) copies the array on the host, then .to(...) copies it again" in out, out
    assert "hint: copy it once: `torch.as_tensor(obs, device=DEV)`" in out, out
    assert "hint: copy it once: `torch.as_tensor(next_obs, dtype=torch.float32, device=DEV)`" in out, out
    assert "hint: the values are the same every step: build it once before the loop" in out, out
    assert "compute them on the device" not in out, out
    assert out.count("input data built by hand (noted)") == 4, out
