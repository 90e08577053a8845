"""``no_iterator_reset``: worker pools counted on real DataLoaders, plain loops and Lightning fits."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")


def _outcomes(result: pytest.RunResult) -> dict[str, int]:
    return result.parseoutcomes()


# -- plain loops through the fixture ------------------------------------------------


def test_persistent_loader_reused_across_epochs_passes(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        """
        from torchperf_models import make_loader

        def test_loop(torchperf):
            loader = make_loader(num_workers=2, persistent_workers=True)
            with torchperf.watch() as run:
                for epoch in range(3):
                    for batch in loader:
                        with run.step():
                            pass
            check = run.report["no_iterator_reset"]
            assert check.status == "passed"
            assert check.figures["pools_started"] == 1
            assert check.figures["loaders"][0]["passes"] == 3
            assert run.steps == 12
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(passed=1)


def test_iterator_set_to_none_fails_at_the_line_that_dropped_it(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_drop="""
        from torchperf_models import make_loader

        def reset(loader):
            loader._iterator = None

        def test_loop(torchperf):
            loader = make_loader(num_workers=2, persistent_workers=True)
            with torchperf.watch():
                for epoch in range(3):
                    for batch in loader:
                        pass
                    reset(loader)
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 1 invariant broken: no_iterator_reset (2 extra worker pools in 1 loader)*",
            "*- torchperf: no_iterator_reset -*",
            "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=True) (first iterated at "
            "test_drop.py:10) started 3 worker pools;*",
            "*worker pools started in: pass 1, pass 2, pass 3",
            "*iterator set to None (2x) at test_drop.py:4 in reset [[]your code[]]",
            "*loader._iterator = None",
            "*stack (most recent call last; > marks your code):",
            "*> test_drop.py:12 in test_loop",
            "*reset(loader)",
            "*> test_drop.py:4 in reset",
            "*worker pool rebuilt (2x) at test_drop.py:10 in test_loop*",
            "*for batch in loader:",
            "*hint: something drops DataLoader._iterator between epochs*",
        ]
    )
    # The short summary names the invariant and its count.
    result.stdout.fnmatch_lines(["FAILED test_drop.py::test_loop - torchperf: 1 invariant broken*"])


def test_deleting_the_iterator_is_caught(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_del="""
        from torchperf_models import make_loader

        def test_loop(torchperf):
            loader = make_loader(num_workers=2, persistent_workers=True)
            with torchperf.watch():
                for epoch in range(2):
                    for batch in loader:
                        pass
                    del loader._iterator
                    loader._iterator = None
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*iterator deleted at test_del.py:9 in test_loop*", "*del loader._iterator"])


@pytest.mark.slow
def test_non_persistent_loader_over_several_epochs_fails_with_a_hint(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_np="""
        from torchperf_models import make_loader

        def test_loop(torchperf):
            loader = make_loader(num_workers=2, persistent_workers=False)
            with torchperf.watch() as run:
                for epoch in range(4):
                    for batch in loader:
                        pass
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_iterator_reset (3 extra worker pools in 1 loader)*",
            "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=False) (first iterated at "
            "test_np.py:7) started a new worker pool in each of its 4 passes over it",
            "*worker pool rebuilt (3x) at test_np.py:7 in test_loop*",
            "*hint: pass persistent_workers=True to this DataLoader*",
        ]
    )


@pytest.mark.parametrize(
    "loader_args, epochs",
    [
        ("num_workers=0", 3),  # no workers: nothing to respawn
        ("num_workers=2, persistent_workers=False", 1),  # one epoch: one pool
    ],
)
def test_loaders_that_start_no_extra_pool_pass(user_models: pytest.Pytester, loader_args: str, epochs: int) -> None:
    user_models.makepyfile(
        f"""
        from torchperf_models import make_loader

        def test_loop(torchperf):
            loader = make_loader({loader_args})
            with torchperf.watch() as run:
                for epoch in range({epochs}):
                    for batch in loader:
                        pass
            assert run.report["no_iterator_reset"].status == "passed"
        """
    )
    user_models.runpytest().assert_outcomes(passed=1)


@pytest.mark.slow
def test_subclass_overriding_get_iterator_is_still_counted(user_models: pytest.Pytester) -> None:
    """Pools are counted where workers start, not in DataLoader._get_iterator."""
    user_models.makepyfile(
        """
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
        from torchperf_models import RandomDataset

        class MyLoader(DataLoader):
            def _get_iterator(self):
                return _MultiProcessingDataLoaderIter(self)

            def __iter__(self):  # always builds a new iterator, persistent or not
                return self._get_iterator()

        def test_loop(torchperf):
            loader = MyLoader(RandomDataset(), batch_size=8, num_workers=2, persistent_workers=True)
            with torchperf.watch():
                for epoch in range(2):
                    for batch in loader:
                        pass
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["MyLoader(dataset=RandomDataset, num_workers=2, persistent_workers=True) (*) started 2*"]
    )


def test_check_can_be_switched_off(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        """
        from torchperf_models import make_loader

        def test_loop(torchperf):
            loader = make_loader(num_workers=2, persistent_workers=False)
            with torchperf.watch(no_iterator_reset=False) as run:
                for epoch in range(2):
                    for batch in loader:
                        pass
            assert "no_iterator_reset" not in run.report.checks
        """
    )
    user_models.runpytest().assert_outcomes(passed=1)


# -- Lightning fits through the marker -----------------------------------------------


def test_lightning_fit_with_persistent_loaders_passes_sanity_check_included(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        """
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit(tmp_path, request):
            train = make_loader(num_workers=2, persistent_workers=True)
            val = make_loader(num_workers=2, persistent_workers=True)
            make_trainer(tmp_path, max_epochs=3).fit(TinyModule(), train, val)
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(
        [
            "*= torchperf summary =*",
            "PASSED  test_lightning_fit_with_persistent_loaders_passes_sanity_check_included.py::test_fit",
            "*no_iterator_reset: passed (2 loaders with workers, 2 worker pools started)*",
        ]
    )


@pytest.mark.slow
def test_lightning_val_loader_without_persistent_workers_fails(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_val="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            train = make_loader(num_workers=2, persistent_workers=True)
            val = make_loader(num_workers=2, persistent_workers=False)
            make_trainer(tmp_path, max_epochs=3).fit(TinyModule(), train, val)
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_iterator_reset (2 extra worker pools in 1 loader)*",
            "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=False) (built at "
            "torchperf_models.py:25, called from test_val.py:7) started a new worker pool "
            "in each of its 3 epochs (and the sanity check)",
            "*worker pools started in: sanity check, epoch 0 (validate), epoch 1 (validate), epoch 2 (validate)",
            "*worker pool rebuilt (2x) at *pytorch_lightning/*[[]framework code[]]",
            "*> test_val.py:8 in test_fit",
            "*hint: pass persistent_workers=True*",
        ]
    )


def test_each_trainer_call_may_start_its_own_pool(user_models: pytest.Pytester) -> None:
    """Lightning shuts workers down when fit returns; validate starting them again is expected."""
    user_models.makepyfile(
        """
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit_then_validate(tmp_path):
            val = make_loader(num_workers=2, persistent_workers=True)
            model = TinyModule()
            trainer = make_trainer(tmp_path, max_epochs=2)
            trainer.fit(model, make_loader(num_workers=0), val)
            trainer.validate(model, val)
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*no_iterator_reset: passed (1 loader with workers, 2 worker pools started)*"])


# -- a loader rebuilt every epoch ------------------------------------------------------


def test_a_loader_rebuilt_every_epoch_from_the_same_line_fails(user_models: pytest.Pytester) -> None:
    """A new DataLoader object each epoch passes the per-loader count: each starts one pool, all from one line."""
    user_models.makepyfile(
        test_rebuilt="""
        from torch.utils.data import DataLoader
        from torchperf_models import RandomDataset

        def test_loop(torchperf):
            dataset = RandomDataset()
            with torchperf.watch() as run:
                for epoch in range(3):
                    loader = DataLoader(dataset, batch_size=8, num_workers=2)
                    for batch in loader:
                        with run.step():
                            pass
            assert run.report["no_iterator_reset"].figures["loaders"][0]["built_at"] == "test_rebuilt.py:8"
        """
    )
    result = user_models.runpytest()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_iterator_reset (2 extra worker pools in 1 loader)*",
            "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=False) built at test_rebuilt.py:8 "
            "was built again twice, and each new loader started its own worker pool: 3 pools",
            "  worker pools started in: pass 1, pass 1, pass 1",
            "  DataLoader built at test_rebuilt.py:8 in test_loop [[]your code[]]",
            "*worker pool started by a rebuilt loader (2x) at test_rebuilt.py:9 in test_loop*",
            "  hint: build this DataLoader once, outside the epoch loop, with persistent_workers=True*",
        ]
    )


def test_loaders_built_by_one_helper_for_train_and_val_are_not_one_loader(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        """
        from torchperf_models import make_loader

        def test_loop(torchperf):
            with torchperf.watch() as run:
                train = make_loader(num_workers=2, persistent_workers=True)
                val = make_loader(num_workers=2, persistent_workers=True)
                for epoch in range(2):
                    for batch in train:
                        pass
                    for batch in val:
                        pass
            check = run.report["no_iterator_reset"]
            assert check.status == "passed", check.summary
            names = sorted(entry["loader"] for entry in check.figures["loaders"])
            called = "called from test_loaders_built_by_one_helper_for_train_and_val_are_not_one_loader.py"
            assert names[0].endswith(f"(built at torchperf_models.py:25, {called}:5)")
            assert names[1].endswith(f"(built at torchperf_models.py:25, {called}:6)")
        """
    )
    user_models.runpytest().assert_outcomes(passed=1)


def test_lightning_reload_dataloaders_every_n_epochs_is_named_as_the_cause(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_reload="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Reloading(TinyModule):
            def train_dataloader(self):
                return make_loader(num_workers=2, persistent_workers=True)

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            trainer = make_trainer(tmp_path, max_epochs=3, num_sanity_val_steps=0, reload_dataloaders_every_n_epochs=1)
            trainer.fit(Reloading())
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_iterator_reset (2 extra worker pools in 1 loader)*",
            "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=True) built at "
            "torchperf_models.py:25 was built again twice*: 3 pools",
            "  worker pools started in: epoch 0 (train), epoch 1 (train), epoch 2 (train)",
            "  the Trainer has reload_dataloaders_every_n_epochs=1: Lightning calls your *_dataloader() hook again "
            "every epoch",
            "*> test_reload.py:6 in train_dataloader",
            "  hint: Trainer(reload_dataloaders_every_n_epochs=1) rebuilds the loaders, and each new one starts its "
            "own worker pool*",
        ]
    )


def test_two_loaders_built_by_one_line_and_used_side_by_side_are_two_loaders(user_models: pytest.Pytester) -> None:
    """``fit(model, make_loader(), make_loader())``: the same lines build both, but neither replaces the other."""
    user_models.makepyfile(
        test_pair="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            trainer = make_trainer(tmp_path, max_epochs=3)
            trainer.fit(TinyModule(), make_loader(num_workers=2), make_loader(num_workers=2))
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "--torchperf-json=out.json")
    result.assert_outcomes(passed=1)
    import json

    doc = json.loads((user_models.path / "out.json").read_text())
    names = sorted(e["loader"] for e in doc["tests"][0]["checks"]["no_iterator_reset"]["figures"]["loaders"])
    assert names == [
        "DataLoader(dataset=RandomDataset, num_workers=2, persistent_workers=True) (built at torchperf_models.py:25, "
        f"called from test_pair.py:7, the {which} built there)"
        for which in ("first", "second")
    ]


def test_a_loader_and_ddp_that_lightning_built_get_lightnings_settings_as_the_hint(
    user_models: pytest.Pytester,
) -> None:
    # strategy="ddp" on one CPU device: Lightning wraps the model in DDP and re-creates the user's loader with a
    # distributed sampler, both from the test's fit line: the hints name what the user writes (the loader their
    # hook returns, the Trainer's strategy), never DistributedDataParallel(...) they did not call.
    user_models.makepyfile(
        test_built="""
        import os
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        @pytest.mark.torchperf(no_unused_parameters_search=True)
        def test_fit(tmp_path, monkeypatch):
            monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
            monkeypatch.setenv("MASTER_PORT", "29531")
            trainer = make_trainer(tmp_path, max_epochs=2, num_sanity_val_steps=0, accelerator="cpu", devices=1,
                                   strategy="ddp_find_unused_parameters_true")
            trainer.fit(TinyModule(), make_loader(num_workers=1, persistent_workers=False))
        """
    )
    result = user_models.runpytest_subprocess("-p", "no:warnings")  # its process group outlives the test
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*persistent_workers=False) (built by lightning, called from test_built.py:11) started a new worker pool*",
            "*hint: pass persistent_workers=True to the DataLoader your *_dataloader() hook (or fit's argument) "
            "returns: Lightning re-creates it*",
        ]
    )
    result.stdout.fnmatch_lines(['*hint: use Trainer(strategy="ddp") instead of "ddp_find_unused_parameters_true"*'])
    assert "drop find_unused_parameters=True" not in result.stdout.str()


def test_the_hugging_face_trainers_settings_are_what_a_hint_names_for_what_it_built() -> None:
    # transformers is not in the test environment: the Trainer's branch at unit level. A stack whose frames
    # below the user's line are a framework's is "built by" that framework; the setting is its own.
    from pytest_torchperf import frameworks

    assert "TrainingArguments(ddp_find_unused_parameters=False)" in frameworks.setting(
        "transformers", "no_unused_parameters_search")
    assert "TrainingArguments(dataloader_persistent_workers=True)" in frameworks.setting(
        "transformers", "no_iterator_reset")
    assert frameworks.setting(None, "no_iterator_reset") == ""
    assert frameworks.setting("ignite", "no_iterator_reset") == ""
