"""``min_workers`` and ``pin_memory``: the DataLoaders that feed training, judged by how they load batches."""

from __future__ import annotations

import pytest
import torch
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf.invariants import pin_memory as workers
from pytest_torchperf.probes import loaders as _loaders
from pytest_torchperf.report import FAILED, NOT_CHECKED, PASSED

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only verdict")


@pytest.fixture
def cpu_as_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the CPU stand in for CUDA, so the CUDA verdict runs for real on a CPU-only machine."""
    monkeypatch.setattr(workers, "ACCELERATORS", ("cpu",))
    monkeypatch.setattr(workers, "cuda_available", lambda: True)


# -- min_workers ------------------------------------------------------------------------


def test_min_workers_fails_a_lightning_fit_naming_the_loader_and_its_line(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        from torch.utils.data import DataLoader
        from torchperf_models import RandomDataset, TinyModule, make_trainer

        @pytest.mark.torchperf(min_workers=2)
        def test_fit(tmp_path):
            train = DataLoader(RandomDataset(), batch_size=8)
            val = DataLoader(RandomDataset(), batch_size=8)  # validation loaders are not judged
            make_trainer(tmp_path, max_epochs=2).fit(TinyModule(), train, val)
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: min_workers (1 training DataLoader below min_workers=2 (fewest: 0))*",
            "*torchperf: min_workers*",
            "DataLoader(dataset=RandomDataset, batch_size=8, num_workers=0) feeds training with 0 workers, "
            "fewer than min_workers=2",
            "  iterated in: epoch 0 (train), epoch 1 (train)",
            "  with num_workers=0 every batch is read and collated in the training process*",
            "  created at test_fit.py:7 in test_fit [[]your code[]]",
            "      train = DataLoader(RandomDataset(), batch_size=8)",
            "*",
            "  hint: pass num_workers=2 or more (Lightning suggests up to the * CPU cores*persistent_workers=True*",
        ],
        consecutive=False,
    )


def test_min_workers_passes_with_enough_workers_and_ignores_validation_loaders(tmp_path) -> None:
    def body(run) -> None:
        train_loader = loader(num_workers=2, persistent_workers=True)
        trainer(tmp_path).fit(Regressor(), train_loader, loader())

    check = report_of(body, min_workers=2)["min_workers"]
    assert check.status == PASSED, check.summary
    assert check.summary == "1 training DataLoader, the fewest workers: 2"
    assert check.figures["training_loaders"] == 1
    assert check.figures["loaders"][0]["num_workers"] == 2


def test_min_workers_in_a_plain_loop_judges_the_loader_that_feeds_the_steps() -> None:
    train_loader = loader()  # created before the run: its first iteration is the site

    def body(run) -> None:
        model = torch.nn.Linear(8, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        evaluation = loader(batch_size=12)
        for _ in range(2):
            for x, y in train_loader:
                with run.step():
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
            with torch.no_grad():
                for x, _ in evaluation:  # between epochs, no step: not a training loader
                    model(x)

    check = report_of(body, min_workers=1)["min_workers"]
    assert check.status == FAILED
    assert check.count == 1
    (finding,) = check.findings
    assert finding.title.startswith("DataLoader(dataset=TensorDataset, batch_size=8, num_workers=0)")
    assert finding.facts[0] == "iterated in: pass 1, pass 2"
    (site,) = finding.sites
    assert site.label == "first iterated (it was created before the run started)"
    assert site.frame is not None and site.frame.source == "for x, y in train_loader:"
    assert check.figures["training_loaders"] == 1


def test_min_workers_without_a_training_loader_is_not_checked() -> None:
    batches = [(torch.randn(4, 8), torch.randn(4, 1))] * 3
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), batches), min_workers=2)["min_workers"]
    assert check.status == NOT_CHECKED
    assert check.summary == "no DataLoader fed a training step in the run"


def test_a_loader_that_yields_no_step_is_not_a_training_loader() -> None:
    """Iterating a loader with no step in between (an evaluation) is not feeding training."""

    def body(run) -> None:
        for _ in range(2):
            for _batch in loader():
                pass

    report = report_of(body, min_workers=1)
    assert report["min_workers"].status == NOT_CHECKED


# -- pin_memory -----------------------------------------------------------------------


@cpu_only
def test_pin_memory_is_not_applicable_without_cuda(tmp_path) -> None:
    check = report_of(lambda run: trainer(tmp_path).fit(Regressor(), loader()), pin_memory=True)["pin_memory"]
    assert check.status == NOT_CHECKED
    assert check.summary == (
        "not applicable: no CUDA device on this machine (pinned memory only speeds up copies to a GPU)"
    )
    # The facts are still there for the JSON report.
    assert check.figures["accelerator_available"] is False
    assert check.figures["trained_on"] == ["cpu"]
    assert check.figures["loaders"][0]["pin_memory"] is False


def test_pin_memory_fails_an_unpinned_training_loader(tmp_path, cpu_as_accelerator) -> None:
    def body(run) -> None:
        trainer(tmp_path).fit(Regressor(), loader(), loader(pin_memory=True))

    check = report_of(body, pin_memory=True)["pin_memory"]
    assert check.status == FAILED, check.summary
    assert check.summary == "1 training DataLoader without pin_memory=True on cpu"
    (finding,) = check.findings
    assert finding.title == (
        "DataLoader(dataset=TensorDataset, batch_size=8, pin_memory=False) feeds training on cpu without pinned memory"
    )
    assert "pin_memory=True" in finding.hint and "non_blocking=True" in finding.hint
    assert finding.sites[0].label == "created"


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")
def test_pin_memory_passes_pinned_loaders(tmp_path, cpu_as_accelerator) -> None:
    check = report_of(
        lambda run: trainer(tmp_path).fit(Regressor(), loader(pin_memory=True)), pin_memory=True
    )["pin_memory"]
    assert check.status == PASSED, check.summary
    assert check.summary == "1 training DataLoader on cpu, all pinned"


def test_pin_memory_is_not_applicable_when_nothing_trained_on_the_accelerator(monkeypatch) -> None:
    monkeypatch.setattr(workers, "cuda_available", lambda: True)  # a GPU machine, a CPU-only test
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader()), pin_memory=True)["pin_memory"]
    assert check.status == NOT_CHECKED
    assert check.summary == "not applicable: no optimizer stepped parameters on a CUDA device"


def test_batches_already_on_a_device_are_recognised() -> None:
    meta = torch.empty(2, device="meta")
    assert _loaders._device_type((meta, meta)) == "meta"
    assert _loaders._device_type({"x": torch.zeros(2)}) is None
    assert _loaders._device_type([[torch.zeros(1)], meta]) == "meta"


@needs_cuda
def test_pin_memory_on_cuda() -> None:
    def body(pin: bool):
        def run_body(run) -> None:
            model = torch.nn.Linear(8, 1).cuda()
            batches = loader(pin_memory=pin)

            def forward(model, x):
                return model(x.cuda(non_blocking=True))

            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for x, y in batches:
                with run.step():
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(forward(model, x), y.cuda()).backward()
                    optimizer.step()

        return run_body

    assert report_of(body(False), pin_memory=True)["pin_memory"].status == FAILED
    assert report_of(body(True), pin_memory=True)["pin_memory"].status == PASSED
