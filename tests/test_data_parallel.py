"""``no_data_parallel``: no ``torch.nn.DataParallel`` in the run (on by default; caught on CPU)."""

from __future__ import annotations

import pytest
import torch
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf import parse_options
from pytest_torchperf.report import FAILED, PASSED


def test_on_by_default() -> None:
    assert "no_data_parallel" in parse_options({}).enabled_checks


def test_data_parallel_submodule_fails_a_lightning_fit(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Wrapped(TinyModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.DataParallel(torch.nn.Linear(8, 1))

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=1, num_sanity_val_steps=0).fit(Wrapped(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_data_parallel (1 DataParallel module, 4 forward passes)*",
            "*torchperf: no_data_parallel*",
            "torch.nn.DataParallel(Linear) ran 4 forward passes",
            "  found as submodule 'layer' of Wrapped (Trainer.fit)",
            "  no GPU on this machine, so here it just calls the module*",
            "  created at test_fit.py:8 in __init__ [[]your code[]]",
            "      self.layer = torch.nn.DataParallel(torch.nn.Linear(8, 1))",
            "*",
            "  forward called (4x) at torchperf_models.py:* in training_step [[]your code[]]",
            "      loss = torch.nn.functional.mse_loss(self.layer(x), y)",
            "*",
            "  hint: use DistributedDataParallel, one process per GPU (Lightning: Trainer(strategy='ddp')*",
        ],
        consecutive=False,
    )


def test_data_parallel_built_before_the_run_is_caught_at_its_forward() -> None:
    model = torch.nn.DataParallel(torch.nn.Linear(8, 1))
    check = report_of(lambda run: train(run, model, loader(), epochs=1))["no_data_parallel"]
    assert check.status == FAILED
    (finding,) = check.findings
    assert [s.label for s in finding.sites] == ["forward called"]
    assert finding.sites[0].count == 5
    assert check.figures["forward_calls"] == 5
    assert check.figures["modules"] == [{"module": "DataParallel(Linear)", "forward_calls": 5, "device_ids": []}]


@pytest.mark.slow
def test_data_parallel_in_the_model_is_reported_even_unused(tmp_path) -> None:
    class Unused(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.spare = torch.nn.DataParallel(torch.nn.Linear(8, 1))

    def body(run) -> None:
        trainer(tmp_path, max_epochs=1).fit(Unused(), loader(), loader())

    check = report_of(body)["no_data_parallel"]
    assert check.status == FAILED
    assert check.findings[0].title == "torch.nn.DataParallel(Linear) is in the model"
    assert check.findings[0].facts[0] == "found as submodule 'spare' of Unused (Trainer.fit)"


def test_a_plain_model_passes_and_the_check_can_be_switched_off() -> None:
    check = report_of(lambda run: train(run, torch.nn.Linear(8, 1), loader()))["no_data_parallel"]
    assert check.status == PASSED
    assert check.summary == "no DataParallel in the run"
    model = torch.nn.DataParallel(torch.nn.Linear(8, 1))
    report = report_of(lambda run: train(run, model, loader(), epochs=1), no_data_parallel=False)
    assert "no_data_parallel" not in report.checks


def test_a_data_parallel_built_and_never_run_is_a_note_not_a_finding() -> None:
    def body(run) -> None:
        inner = torch.nn.Linear(8, 1)
        wrapped = torch.nn.DataParallel(inner)  # built only to test unwrapping, as transformers' tests do
        assert wrapped.module is inner
        train(run, inner, loader(), epochs=1)

    check = report_of(body)["no_data_parallel"]
    assert check.status == PASSED
    assert check.summary == "no DataParallel ran; 1 DataParallel module built and never run (noted)"
    (note,) = check.findings
    assert note.title == "note: torch.nn.DataParallel(Linear) was built and never ran"
    assert [s.label for s in note.sites] == ["created"]
    assert note.sites[0].frame is not None and note.sites[0].frame.function == "body"


def test_beside_one_that_ran_the_idle_data_parallel_stays_a_note() -> None:
    def body(run) -> None:
        torch.nn.DataParallel(torch.nn.Linear(8, 1))
        train(run, torch.nn.DataParallel(torch.nn.Linear(8, 1)), loader(), epochs=1)

    check = report_of(body)["no_data_parallel"]
    assert check.status == FAILED
    assert check.summary == "1 DataParallel module, 5 forward passes"
    assert [f.title.startswith("note: ") for f in check.findings] == [False, True]
