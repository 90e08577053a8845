"""``no_empty_cache``: ``torch.cuda.empty_cache()`` called by your code during the run, counted on CPU too."""

from __future__ import annotations

import pytest
import torch
from seed_tips_models import Regressor, loader, report_of, train, trainer

from pytest_torchperf.report import FAILED, PASSED


def test_empty_cache_in_training_step_fails_with_count_site_and_hint(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_fit="""
        import pytest
        import torch
        from torchperf_models import TinyModule, make_loader, make_trainer

        class FreesMemory(TinyModule):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                torch.cuda.empty_cache()
                return loss

        @pytest.mark.torchperf(no_empty_cache=True)
        def test_fit(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(FreesMemory(), make_loader(num_workers=0))
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_empty_cache (8 torch.cuda.empty_cache() calls by your code)*",
            "*torchperf: no_empty_cache*",
            "torch.cuda.empty_cache() called 8 times by your code during the run: 1 per step over 8 steps",
            "  8 of these calls inside a training step (8 steps ran)",
            "  the framework made * more (not counted)",
            "  torch.cuda.empty_cache() called (8x) at test_fit.py:8 in training_step [[]your code[]]",
            "      torch.cuda.empty_cache()",
            "*",
            "  hint: empty_cache() frees no memory your tensors hold*PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True*",
        ],
        consecutive=False,
    )


def test_lightning_own_call_is_listed_not_blamed(tmp_path) -> None:
    check = report_of(lambda run: trainer(tmp_path).fit(Regressor(), loader(), loader()), no_empty_cache=True)[
        "no_empty_cache"
    ]
    assert check.status == PASSED, check.summary
    # Lightning calls it when a fit restores its state (checkpoint_connector.resume_end), on CPU too.
    assert check.figures["framework_calls"] >= 1
    assert any("checkpoint_connector.py" in site for site in check.figures["framework_sites"])
    assert check.summary.startswith("no torch.cuda.empty_cache() call by your code (")
    assert check.figures["calls"] == 0


def test_a_call_after_training_is_a_note_and_one_after_every_batch_fails() -> None:
    def once(run) -> None:
        train(run, torch.nn.Linear(8, 1), loader(), epochs=1)
        torch.cuda.empty_cache()  # "free memory after training"

    check = report_of(once, no_empty_cache=True)["no_empty_cache"]
    assert check.status == PASSED, check.summary
    assert check.count == 0
    assert check.figures["calls"] == 1 and check.figures["periodic_calls"] == 1
    (finding,) = check.findings
    assert finding.title == "note: torch.cuda.empty_cache() called by your code: once: 1 time outside training steps"
    assert finding.sites[0].frame.source == 'torch.cuda.empty_cache()  # "free memory after training"'

    def every_batch(run) -> None:
        model = torch.nn.Linear(8, 1)
        for x, y in loader():
            with run.step():
                torch.nn.functional.mse_loss(model(x), y).backward()
            torch.cuda.empty_cache()  # between the steps, after every one

    check = report_of(every_batch, no_empty_cache=True)["no_empty_cache"]
    assert check.status == FAILED
    assert check.count == 5
    assert check.findings[0].title.endswith("during the run: 5 times outside training steps")


def test_once_per_epoch_is_a_note_and_every_step_fails_with_the_rate_setting() -> None:
    def per_epoch(run) -> None:
        model = torch.nn.Linear(8, 1)
        for _epoch in range(3):
            for i, (x, y) in enumerate(loader()):
                with run.step():
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    if i == 0:
                        torch.cuda.empty_cache()

    check = report_of(per_epoch, no_empty_cache=True)["no_empty_cache"]
    assert check.status == PASSED, check.summary
    assert (
        check.findings[0].title == "note: torch.cuda.empty_cache() called by your code: once per epoch: 3 of 15 steps"
    )
    check = report_of(per_epoch, no_empty_cache=True, max_empty_cache_rate=0)["no_empty_cache"]
    assert check.status == FAILED and check.count == 3


def test_calls_through_torch_cuda_memory_are_seen() -> None:
    check = report_of(lambda run: torch.cuda.memory.empty_cache(), no_empty_cache=True)["no_empty_cache"]
    assert check.figures["calls"] == 1


def test_off_by_default(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        """
        import pytest
        import torch

        @pytest.mark.torchperf
        def test_body():
            torch.cuda.empty_cache()
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(passed=1)
    result.stdout.no_fnmatch_line("*no_empty_cache*")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_counted_with_real_cuda_memory() -> None:
    def body(run) -> None:
        for _ in range(3):
            with run.step():
                x = torch.randn(1024, 1024, device="cuda")
                del x
                torch.cuda.empty_cache()

    check = report_of(body, no_empty_cache=True)["no_empty_cache"]
    assert check.status == FAILED
    assert check.figures["calls"] == 3 and check.figures["calls_in_scope"] == 3
