"""The seed article's other tips as marker arguments: validation, defaults, JSON figures, isolation.

Each invariant's behaviour has its own file (test_workers, test_cuda_cache,
test_data_parallel, test_grads, test_recompiles, test_precision).
"""

from __future__ import annotations

import json

import pytest
import seed_tips_models  # noqa: F401  (compiles once: pytester runs below compile too)

from pytest_torchperf import UsageError, parse_options

TIPS = (
    "min_workers",
    "pin_memory",
    "no_empty_cache",
    "no_data_parallel",
    "grads_set_to_none",
    "no_recompiles",
    "mixed_precision",
)


def test_defaults_only_no_data_parallel_is_on() -> None:
    options = parse_options({})
    assert [name for name in TIPS if name in options.enabled_checks] == ["no_data_parallel"]
    assert options.min_workers is None and options.recompile_warmup_steps is None
    everything = parse_options({"min_workers": 2, **{name: True for name in TIPS if name != "min_workers"}})
    assert [name for name in TIPS if name in everything.enabled_checks] == list(TIPS)
    assert "recompile_warmup_steps" not in parse_options({"recompile_warmup_steps": 3}).enabled_checks


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"min_worker": 2}, "unknown argument 'min_worker' (did you mean 'min_workers'?)"),
        ({"pin_memroy": True}, "unknown argument 'pin_memroy' (did you mean 'pin_memory'?)"),
        ({"no_recompile": True}, "unknown argument 'no_recompile' (did you mean 'no_recompiles'?)"),
        ({"grad_set_to_none": True}, "did you mean 'grads_set_to_none'?"),
        (
            {"min_workers": 0},
            "min_workers must be an integer >= 1 (the fewest DataLoader worker processes each training loader "
            "may have) or None, got 0 (int)",
        ),
        ({"min_workers": True}, "min_workers must be an integer >= 1 (the fewest DataLoader worker"),
        ({"min_workers": 2.0}, "or None, got 2.0 (float)"),
        ({"min_workers": "4"}, "or None, got '4' (str)"),
        (
            {"recompile_warmup_steps": -1},
            "recompile_warmup_steps must be an integer >= 0 (training steps whose recompiles count as warm-up) "
            "or None, got -1 (int)",
        ),
        ({"pin_memory": 1}, "pin_memory must be True or False, got 1 (int)"),
        ({"no_empty_cache": "yes"}, "no_empty_cache must be True or False, got 'yes' (str)"),
        ({"no_data_parallel": None}, "no_data_parallel must be True or False, got None (NoneType)"),
        ({"grads_set_to_none": 0}, "grads_set_to_none must be True or False, got 0 (int)"),
        ({"no_recompiles": "off"}, "no_recompiles must be True or False"),
        ({"mixed_precision": 16}, "mixed_precision must be True or False, got 16 (int)"),
    ],
)
def test_bad_arguments_name_what_is_accepted(kwargs: dict, message: str) -> None:
    with pytest.raises(UsageError) as excinfo:
        parse_options(kwargs, where="@pytest.mark.torchperf")
    assert message in str(excinfo.value)
    assert str(excinfo.value).startswith("@pytest.mark.torchperf")


def test_bad_marker_value_is_a_setup_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        @pytest.mark.torchperf(min_workers=0)
        def test_body():
            pass
        """
    )
    result = pytester.runpytest()
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*pytest-torchperf: @pytest.mark.torchperf: min_workers must be an integer >= 1*"])
    result.stdout.no_fnmatch_line("*INTERNALERROR*")


def test_marker_signature_lists_the_new_arguments(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        [
            "@pytest.mark.torchperf(*max_overhead=None, min_workers=None, pin_memory=False, no_empty_cache=False, "
            "no_data_parallel=True, grads_set_to_none=False, no_recompiles=False, mixed_precision=False, "
            "*scope='training_step'*recompile_warmup_steps=None*)*"
        ]
    )


def test_every_invariant_reports_its_figures_in_the_json(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_all="""
        import pytest
        import torch
        from torch.utils.data import DataLoader
        from torchperf_models import RandomDataset, TinyModule, make_trainer

        class Everything(TinyModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.DataParallel(torch.compile(torch.nn.Linear(8, 1), backend="eager"))

            def training_step(self, batch, batch_idx):
                torch.cuda.empty_cache()
                return super().training_step(batch, batch_idx)

            def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
                optimizer.zero_grad(set_to_none=False)

        @pytest.mark.torchperf(
            min_workers=1, pin_memory=True, no_empty_cache=True, grads_set_to_none=True,
            no_recompiles=True, mixed_precision=True,
        )
        def test_fit(tmp_path):
            loader = DataLoader(RandomDataset(), batch_size=8)
            make_trainer(tmp_path, max_epochs=2).fit(Everything(), loader)
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "--torchperf-json=out.json", "--junitxml=junit.xml")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*torchperf: 4 invariants broken: min_workers (*); no_empty_cache (*); no_data_parallel (*); "
            "grads_set_to_none (*)*"
        ]
    )
    document = json.loads((user_models.path / "out.json").read_text())
    (test,) = document["tests"]
    checks = test["checks"]
    assert document["summary"]["checks_failed"] == {
        "min_workers": 1,
        "no_empty_cache": 1,
        "no_data_parallel": 1,
        "grads_set_to_none": 1,
    }
    assert set(TIPS) <= set(checks)
    expected_figures = {
        "min_workers": {"min_workers": 1, "training_loaders": 1, "loaders_below_minimum": 1, "fewest_workers": 0},
        "no_empty_cache": {"calls": 8, "calls_in_scope": 8, "steps": 8},
        "no_data_parallel": {"data_parallel_modules": 1, "forward_calls": 8, "lightning_strategy": None},
        "grads_set_to_none": {"optimizer_steps": 8, "zero_grad_set_to_none_false": 8, "grads_zeroed_in_place": 0},
        "no_recompiles": {
            "recompiles_after_warmup": 0,
            "recompile_limit_hits": 0,
            "warmup": "the first compile of each mode (grad mode, autocast, train/eval)",
        },
    }
    for name, figures in expected_figures.items():
        assert {key: checks[name]["figures"][key] for key in figures} == figures, name
    assert checks["no_recompiles"]["status"] == "passed"
    assert checks["no_recompiles"]["figures"]["compiles"] >= 1
    for name in ("pin_memory", "mixed_precision"):
        assert checks[name]["status"] == "not checked"
        assert checks[name]["summary"].startswith("not applicable: ")
        assert checks[name]["figures"]["accelerator_available"] is False
    # Findings carry their sites, as data.
    (finding,) = checks["no_empty_cache"]["findings"]
    (site,) = finding["sites"]
    assert site["site"] == "test_all.py:12" and site["source"] == "torch.cuda.empty_cache()" and site["user_code"]
    assert site["count"] == 8
    # Scalar figures become JUnit properties.
    junit = (user_models.path / "junit.xml").read_text()
    assert 'name="torchperf.min_workers.fewest_workers" value="0"' in junit
    assert 'name="torchperf.no_empty_cache.calls" value="8"' in junit


def test_everything_patched_is_pristine_after_passed_failed_and_crashed_tests(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_isolation="""
        import sys
        import pytest
        import torch
        import torch._dynamo.callback
        import torch._dynamo.convert_frame as convert_frame
        import torch.amp.autocast_mode as autocast_mode
        import torch.optim.optimizer as optimizer_module
        from torch.utils.data import dataloader
        from torchperf_models import TinyModule, make_loader, make_trainer

        ALL = dict(
            min_workers=1, pin_memory=True, no_empty_cache=True, grads_set_to_none=True,
            no_recompiles=True, mixed_precision=True,
        )

        def snapshot():
            return {
                "tensor": dict(vars(torch.Tensor)),
                "module": dict(vars(torch.nn.Module)),
                "optimizer": dict(vars(torch.optim.Optimizer)),
                "data_parallel": dict(vars(torch.nn.DataParallel)),
                "autocast": dict(vars(autocast_mode.autocast)),
                "loader": dict(vars(dataloader.DataLoader)),
                "iterator": dict(vars(dataloader._BaseDataLoaderIter)),
                "empty_cache": (torch.cuda.empty_cache, torch.cuda.memory.empty_cache),
                "convert_frame": dict(vars(convert_frame)),
                "compile_callbacks": list(torch._dynamo.callback.callback_handler.start_callbacks),
                "pre_hooks": dict(optimizer_module._global_optimizer_pre_hooks),
                "post_hooks": dict(optimizer_module._global_optimizer_post_hooks),
                "meta_path": list(sys.meta_path),
            }

        # torch.compile patches nn.Module once per process (dynamo's mutation tracking): not ours.
        torch.compile(torch.nn.Linear(1, 1), backend="eager")(torch.ones(1, 1))
        torch._dynamo.reset()
        BEFORE = snapshot()

        class Bad(TinyModule):
            def __init__(self):
                super().__init__()
                self.layer = torch.nn.DataParallel(torch.compile(torch.nn.Linear(8, 1), backend="eager"))

            def optimizer_zero_grad(self, epoch, batch_idx, optimizer):
                torch.cuda.empty_cache()
                optimizer.zero_grad(set_to_none=False)

        @pytest.mark.torchperf(**ALL)
        def test_passes(tmp_path):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                make_trainer(tmp_path, max_epochs=1).fit(TinyModule(), make_loader(num_workers=1))

        @pytest.mark.torchperf(**ALL)
        def test_fails(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(Bad(), make_loader(num_workers=0))

        @pytest.mark.torchperf(**ALL)
        def test_crashes(tmp_path):
            class Broken(Bad):
                def training_step(self, batch, batch_idx):
                    if batch_idx == 1:
                        raise RuntimeError("crash")
                    return super().training_step(batch, batch_idx)
            make_trainer(tmp_path).fit(Broken(), make_loader(num_workers=0))

        def test_everything_is_pristine():
            torch._dynamo.reset()
            assert snapshot() == BEFORE
            from pytest_torchperf.core import active_runs
            from pytest_torchperf.engine import ENGINE
            from pytest_torchperf.watching import installed_probes
            assert active_runs() == [] and installed_probes() == ()
            loaders, grads = ENGINE.probe("loaders"), ENGINE.probe("grads")
            assert len(loaders.created) == 0 and len(loaders.loader_of) == 0
            assert len(ENGINE.probe("data_parallel").created) == 0
            assert grads.grad_owners == {} and grads.inside_zero_grad == 0
            assert ENGINE.probe("recompiles").attached is None
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "-p", "no:randomly")
    result.assert_outcomes(passed=2, failed=2)
    result.stdout.fnmatch_lines(["*RuntimeError: crash*"])
