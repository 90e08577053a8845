"""The unified ``lightning`` package: ``import lightning as L``, its own Trainer and Callback classes.

Runs where ``lightning`` is installed (the nox session `compat-lightning` has
``lightning`` and not ``pytorch_lightning``, so nothing can fall back to the older package);
elsewhere it skips, unless ``TORCHPERF_REQUIRE_LIGHTNING_PACKAGE=1`` (set by CI in that
environment), where a missing package fails.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

REQUIRED = os.environ.get("TORCHPERF_REQUIRE_LIGHTNING_PACKAGE") == "1"
if importlib.util.find_spec("lightning") is None:
    if REQUIRED:
        raise RuntimeError("TORCHPERF_REQUIRE_LIGHTNING_PACKAGE=1 but the `lightning` package is not installed")
    pytest.skip("the `lightning` package is not installed", allow_module_level=True)

MODELS = """
    import lightning as L
    import torch
    from torch.utils.data import DataLoader, TensorDataset


    def loader(persistent=True, workers=2):
        x = torch.randn(32, 8)
        return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8, num_workers=workers,
                          persistent_workers=persistent and workers > 0)


    class Regressor(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("loss", loss, prog_bar=True)
            return loss

        def validation_step(self, batch, batch_idx):
            x, y = batch
            self.log("val", torch.nn.functional.mse_loss(self.layer(x), y))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)


    def trainer(tmp_path, **kwargs):
        return L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path), accelerator="cpu", **kwargs)
"""


@pytest.fixture
def lightning_models(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(lightning_models=MODELS)
    pytester.syspathinsert()
    return pytester


def test_the_environment_has_lightning_and_not_pytorch_lightning() -> None:
    import lightning as L

    assert L.Trainer.__module__ == "lightning.pytorch.trainer.trainer"
    if REQUIRED:
        assert importlib.util.find_spec("pytorch_lightning") is None


def test_a_sync_in_training_step_fails_at_the_users_line(lightning_models: pytest.Pytester) -> None:
    lightning_models.makepyfile(
        test_fit="""
        import pytest
        from lightning_models import Regressor, loader, trainer

        class Syncing(Regressor):
            def training_step(self, batch, batch_idx):
                loss = super().training_step(batch, batch_idx)
                if loss.item() > 1e6:
                    raise RuntimeError("diverged")
                return loss

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            trainer(tmp_path).fit(Syncing(), loader(workers=0))
        """
    )
    result = lightning_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "torchperf: 1 invariant broken: no_host_sync (12 syncs at test_fit.py:7: 1 per step over 12 steps)*",
            "*`.item()` (12x) at test_fit.py:7 in training_step [[]your code[]]",
            "*lightning/pytorch/*",  # the stack runs through the unified package's Trainer
        ]
    )
    assert "pytorch_lightning" not in result.stdout.str()


def test_the_batch_scope_works_through_the_packages_own_hook_dispatch(lightning_models: pytest.Pytester) -> None:
    lightning_models.makepyfile(
        test_batch="""
        import lightning as L
        import pytest
        from lightning_models import Regressor, loader, trainer

        class Printing(L.Callback):
            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                print(float(outputs["loss"]))

        @pytest.mark.torchperf(scope="batch")
        def test_callback_sync(tmp_path):
            trainer(tmp_path, callbacks=[Printing()]).fit(Regressor(), loader(workers=0))

        class Counting(L.Callback):
            batches = 0

            def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
                self.batches += 1
                self.during = list(trainer.callbacks)

        @pytest.mark.torchperf(scope="batch")
        def test_clean(tmp_path):
            counting = Counting()
            t = trainer(tmp_path, callbacks=[counting, L.pytorch.callbacks.Timer()])
            t.fit(Regressor(), loader(workers=0))
            assert counting.batches == 12
            # The batch scope wraps lightning.pytorch's own hook dispatch: nothing is added to the callbacks.
            assert not [c for c in counting.during if type(c).__module__.startswith("pytest_torchperf")]
            assert [type(c).__name__ for c in counting.during if not type(c).__module__.startswith("lightning")] == [
                "Counting"
            ]
        """
    )
    result = lightning_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(["*`float(tensor)` (12x) at test_batch.py:7 in on_train_batch_end [[]your code[]]"])


def test_worker_pools_rebuilt_by_a_non_persistent_loader_fail(lightning_models: pytest.Pytester) -> None:
    lightning_models.makepyfile(
        test_loaders="""
        import pytest
        from lightning_models import Regressor, loader, trainer

        @pytest.mark.torchperf
        def test_respawns(tmp_path):
            trainer(tmp_path).fit(Regressor(), loader(persistent=False), loader(persistent=True))

        @pytest.mark.torchperf
        def test_persistent(tmp_path):
            trainer(tmp_path).fit(Regressor(), loader(persistent=True), loader(persistent=True))
        """
    )
    result = lightning_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1, passed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_iterator_reset (2 extra worker pools in 1 loader)*",
            "*started a new worker pool in each of its 3 epochs*",
        ]
    )


def test_a_lightning_imported_inside_the_test_is_observed(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_late="""
        import sys
        import pytest
        import torch

        @pytest.mark.torchperf(no_iterator_reset=False)
        def test_fit(tmp_path):
            import lightning as L

            class Module(L.LightningModule):
                def __init__(self):
                    super().__init__()
                    self.layer = torch.nn.Linear(4, 1)

                def training_step(self, batch, batch_idx):
                    loss = self.layer(batch[0]).pow(2).mean()
                    print(loss.tolist())
                    return loss

                def configure_optimizers(self):
                    return torch.optim.SGD(self.parameters(), lr=0.1)

            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
            L.Trainer(max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, default_root_dir=str(tmp_path)).fit(Module(), data)
        """
    )
    result = pytester.runpytest_subprocess("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*`.tolist()` (2x) at test_late.py:16 in training_step [[]your code[]]"])


def test_baseline_and_annotations_through_the_package(
    lightning_models: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(lightning_models.path))
    lightning_models.makepyfile(
        test_known="""
        import pytest
        from lightning_models import Regressor, loader, trainer

        @pytest.mark.torchperf
        def test_respawns(tmp_path):
            trainer(tmp_path).fit(Regressor(), loader(persistent=False))
        """
    )
    lightning_models.runpytest("--torchperf-baseline=b.json", "--torchperf-baseline-update", "-p", "no:warnings")
    result = lightning_models.runpytest("--torchperf-baseline=b.json", "-p", "no:warnings")
    result.assert_outcomes(passed=1)
    warnings = [line for line in result.stdout.lines if line.startswith("::warning ")]
    assert len(warnings) == 1 and warnings[0].startswith(
        "::warning file=test_known.py,line=6,title=torchperf no_iterator_reset::"
    ), warnings
