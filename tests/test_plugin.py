"""The pytest side: reports, isolation, crashes, unmarked tests, JUnit, xdist, scripts."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

DROPPING_LOOP = """
    from torchperf_models import make_loader

    def test_loop(torchperf):
        loader = make_loader(num_workers=2, persistent_workers=True)
        with torchperf.watch():
            for epoch in range(3):
                for batch in loader:
                    pass
                loader._iterator = None
"""


def test_pytest_and_pluggy_frames_are_hidden_whatever_the_verbosity_and_full_stacks_shows_them(
    user_models: pytest.Pytester,
) -> None:
    user_models.makepyfile(test_drop=DROPPING_LOOP)
    for args in ([], ["-v"], ["-vv"], ["-rA"]):
        result = user_models.runpytest(*args)
        result.assert_outcomes(failed=1)
        text = result.stdout.str()
        assert "_pytest/" not in text and "pluggy/" not in text, args
    full = user_models.runpytest("--torchperf-full-stacks")
    full.assert_outcomes(failed=1)
    assert "_pytest/python.py" in full.stdout.str()  # pytest's own frames, shown on request
    assert "pluggy/" in full.stdout.str()
    assert "frames hidden" not in full.stdout.str()
    assert "pytest_torchperf/" not in full.stdout.str()  # the plugin's own frames never are
    user_models.makeini("[pytest]\ntorchperf_full_stacks = true\n")
    assert "_pytest/python.py" in user_models.runpytest().stdout.str()


def test_the_full_stacks_ini_option_is_validated(pytester: pytest.Pytester) -> None:
    pytester.makepyfile("def test_nothing():\n    pass\n")
    pytester.makeini("[pytest]\ntorchperf_full_stacks = ture\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*pytest-torchperf: ini option torchperf_full_stacks must be true or false, got 'ture' "
         "(did you mean 'true'?)*"]
    )


@pytest.mark.slow
def test_run_through_the_pytest_console_script_the_launcher_is_not_your_code(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_drop=DROPPING_LOOP)
    launcher = Path(sys.executable).parent / "pytest"
    if not launcher.exists():
        pytest.skip("no pytest console script beside this interpreter")
    result = user_models.run(
        str(launcher), "-p", "no:cacheprovider", "--torchperf-full-stacks", "--torchperf-json=out.json"
    )
    assert result.ret == 1
    text = result.stdout.str()
    assert f"{launcher.name}:" in text  # the full stack shows the launcher's frame, unmarked
    assert not [line for line in text.splitlines() if line.lstrip().startswith(">") and "bin/pytest" in line]
    document = json.loads((user_models.path / "out.json").read_text())
    (finding,) = document["tests"][0]["checks"]["no_iterator_reset"]["findings"]
    assert finding["sites"][0]["user_code"] and finding["sites"][0]["site"].startswith("test_drop.py:")


def test_a_script_in_a_virtual_environment_s_bin_is_a_launcher_not_your_code(tmp_path: Path) -> None:
    from pytest_torchperf.stacks import LAUNCHER, USER, Frame, classify, site_of

    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    script = tmp_path / "venv" / "bin" / "pytest"
    script.write_text("import sys\n")
    mine = tmp_path / "project" / "bin" / "train.py"  # a project's own bin/ (no pyvenv.cfg above it) is the user's
    mine.parent.mkdir(parents=True)
    mine.write_text("pass\n")
    assert classify(str(script)) == LAUNCHER
    assert "console-script launcher" in classify.rule(str(script))
    assert classify(str(mine)) == USER
    assert site_of((Frame(str(script), 8, "<module>"), Frame(torch_file(), 1, "add"))).filename == torch_file()


def torch_file() -> str:
    import torch

    return torch.__file__


def test_junit_xml_carries_the_summary_as_message_and_the_report_as_text(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(test_drop=DROPPING_LOOP)
    result = user_models.runpytest("--junitxml=out.xml")
    result.assert_outcomes(failed=1)
    failure = ET.parse(user_models.path / "out.xml").getroot().find(".//testcase/failure")
    assert failure is not None
    assert failure.get("message") == (
        "torchperf: 1 invariant broken: no_iterator_reset (2 extra worker pools in 1 loader)"
    )
    assert "iterator set to None (2x) at test_drop.py:9 in test_loop" in (failure.text or "")
    assert "loader._iterator = None" in (failure.text or "")


def test_exception_inside_training_is_shown_as_is(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_crash="""
        import pytest
        from torchperf_models import TinyModule, make_loader, make_trainer

        class Broken(TinyModule):
            def training_step(self, batch, batch_idx):
                raise ValueError("boom in training_step")

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            make_trainer(tmp_path).fit(Broken(), make_loader(num_workers=0))

        def test_loop(torchperf):
            with torchperf.watch():
                raise KeyError("boom in my loop")
        """
    )
    result = user_models.runpytest("-p", "no:warnings")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*raise ValueError(\"boom in training_step\")",
            "E*ValueError: boom in training_step",
            "*raise KeyError(\"boom in my loop\")",
            "E*KeyError: 'boom in my loop'",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED test_crash.py::test_fit - ValueError: boom in training_step"])
    result.stdout.no_fnmatch_line("*invariant broken*")
    result.stdout.no_fnmatch_line("*pytest_torchperf/*.py*")


def test_everything_patched_is_restored_after_passed_failed_and_crashed_tests(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_isolation="""
        import sys
        import pytest
        from torch.utils.data import DataLoader
        from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter
        from torchperf_models import TinyModule, make_loader, make_trainer, pl

        def snapshot():
            return {
                "loader": dict(vars(DataLoader)),
                "pool": dict(vars(_MultiProcessingDataLoaderIter)),
                "trainer": dict(vars(pl.Trainer)),
                "module_class": dict(vars(TinyModule)),
                "hook_dispatch": dict(vars(sys.modules[pl.__name__ + ".trainer.call"])),
                "meta_path": list(sys.meta_path),
            }

        BEFORE = snapshot()
        MODEL = TinyModule()
        TRAINER = {}

        @pytest.mark.torchperf
        def test_passes(tmp_path):
            TRAINER["t"] = make_trainer(tmp_path, max_epochs=1)
            TRAINER["t"].fit(MODEL, make_loader(num_workers=0))

        @pytest.mark.torchperf
        def test_fails(tmp_path):
            make_trainer(tmp_path, max_epochs=2).fit(TinyModule(), make_loader(persistent_workers=False))

        @pytest.mark.torchperf(scope="batch")
        def test_crashes(tmp_path):
            class Broken(TinyModule):
                def training_step(self, batch, batch_idx):
                    raise RuntimeError("crash")
            make_trainer(tmp_path).fit(Broken(), make_loader(num_workers=0))

        def test_fixture_left_open(torchperf):
            torchperf.watch().__enter__()  # never exited: the fixture must clean up

        def test_everything_is_pristine():
            assert snapshot() == BEFORE
            assert "training_step" not in vars(MODEL)
            assert "on_train_batch_end" not in vars(MODEL)
            assert not [c for c in TRAINER["t"].callbacks if "Torchperf" in type(c).__name__]
            from pytest_torchperf.core import active_runs
            assert active_runs() == []
        """
    )
    result = user_models.runpytest("-p", "no:warnings", "-p", "no:randomly")
    result.assert_outcomes(passed=3, failed=2)
    failed = sorted(line.split(" - ")[0] for line in result.stdout.lines if line.startswith("FAILED test_iso"))
    assert failed == ["FAILED test_isolation.py::test_crashes", "FAILED test_isolation.py::test_fails"]


def test_marker_and_fixture_together_each_report(user_models: pytest.Pytester) -> None:
    user_models.makepyfile(
        test_both="""
        import pytest
        from pytest_torchperf import InvariantViolation
        from torchperf_models import make_loader

        @pytest.mark.torchperf
        def test_both(torchperf):
            loader = make_loader(persistent_workers=False)
            with pytest.raises(InvariantViolation) as excinfo:
                with torchperf.watch() as run:
                    for epoch in range(2):
                        for batch in loader:
                            pass
            assert run.report is excinfo.value.report
            assert [c.name for c in run.report.failures] == ["no_iterator_reset"]
            assert run.report["no_iterator_reset"].count == 1
        """
    )
    result = user_models.runpytest()
    # The inner failure was expected by the test; the marker's run saw the same respawn.
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*= torchperf summary =*",
            "FAILED  test_both.py::test_both: no_iterator_reset failed (1 extra worker pool in 1 loader)",
        ]
    )
    verbose = user_models.runpytest("-v")
    verbose.stdout.fnmatch_lines(
        [
            "*= torchperf summary =*",
            "FAILED  test_both.py::test_both",
            "*no_iterator_reset: failed (1 extra worker pool in 1 loader)*",
            "*no_iterator_reset: failed (1 extra worker pool in 1 loader)*",
        ]
    )


def test_run_step_outside_its_watch_is_an_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest

        def test_loop(torchperf):
            with torchperf.watch() as run:
                pass
            with pytest.raises(RuntimeError, match="outside its"):
                with run.step():
                    pass
        """
    )
    pytester.runpytest().assert_outcomes(passed=1)


def test_unmarked_suite_never_imports_torch(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import sys

        def test_plain():
            assert "torch" not in sys.modules
        """
    )
    result = pytester.runpytest_subprocess()
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["plugins:*torchperf*"])


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, pytest_torchperf, pytest_torchperf.glue.plugin; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.slow
def test_watch_works_from_a_plain_script(tmp_path: pytest.TempPathFactory, user_models: pytest.Pytester) -> None:
    script = user_models.path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            from pytest_torchperf import InvariantViolation, watch
            from torchperf_models import make_loader

            loader = make_loader(persistent_workers=False)
            try:
                with watch() as run:
                    for epoch in range(2):
                        for batch in loader:
                            pass
            except InvariantViolation as exc:
                print(exc)
            """
        )
    )
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=user_models.path
    )
    assert "torchperf: 1 invariant broken: no_iterator_reset (1 extra worker pool in 1 loader)" in out.stdout
    assert "- torchperf: no_iterator_reset -" in out.stdout
    assert "hint: pass persistent_workers=True" in out.stdout


@pytest.mark.slow
def test_lightning_imported_inside_the_test_is_observed(user_models: pytest.Pytester) -> None:
    """A Trainer imported after the watch started is patched on import, and unpatched after."""
    user_models.makepyfile(
        test_late="""
        import sys
        import pytest

        @pytest.mark.torchperf
        def test_fit(tmp_path):
            assert "pytorch_lightning" not in sys.modules
            from torchperf_models import TinyModule, make_loader, make_trainer
            make_trainer(tmp_path, max_epochs=2).fit(
                TinyModule(), make_loader(num_workers=0), make_loader(persistent_workers=False)
            )

        def test_after():
            import pytorch_lightning as pl
            assert not [f for f in sys.meta_path if "torchperf" in type(f).__module__]
            assert not hasattr(pl.Trainer.fit, "__wrapped__")
        """
    )
    # A fresh interpreter, so Lightning is not imported before the test body runs.
    result = user_models.runpytest_subprocess("-p", "no:warnings", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*worker pools started in: sanity check, epoch 0 (validate), epoch 1 (validate)",
            "*worker pool rebuilt at *pytorch_lightning/*[[]framework code[]]",
        ]
    )
