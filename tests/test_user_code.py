"""Your code is the project under test wherever it is installed (a wheel in site-packages under tox or CI).

The project is installed for real, non-editable, into a temporary site
directory (``pip install --no-deps --target .../site-packages``), the way tox
or a CI job testing the built wheel would have it. The sessions run in this
process: pytester restores ``sys.modules`` and ``sys.path`` after each, so every
one imports ``mypkg`` from the site directory afresh.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

TRAIN = '''
import torch


def train(run, steps=4):
    model = torch.nn.Linear(8, 1)
    for _ in range(steps):
        with run.step():
            loss = model(torch.ones(2, 8)).sum()
            loss.backward()
            print_loss = loss.item()
'''


def make_project(root: Path, dist_name: str) -> Path:
    """A src-layout project named ``dist_name`` whose import package is ``mypkg``."""
    (root / "src" / "mypkg").mkdir(parents=True)
    (root / "src" / "mypkg" / "__init__.py").write_text("")
    (root / "src" / "mypkg" / "train.py").write_text(TRAIN)
    (root / "pyproject.toml").write_text(
        textwrap.dedent(
            f"""
            [build-system]
            requires = ["setuptools>=64"]
            build-backend = "setuptools.build_meta"

            [project]
            name = "{dist_name}"
            version = "0.1.0"

            [tool.setuptools.packages.find]
            where = ["src"]
            """
        )
    )
    return root


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mypkg`` (distribution ``mypkg-dist``) installed non-editable into a site directory of its own."""
    root = make_project(tmp_path_factory.mktemp("project"), "mypkg-dist")
    site = tmp_path_factory.mktemp("env") / "site-packages"
    command = [
        sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
        "--target", str(site), str(root),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PIP_NO_INPUT": "1"})
    if done.returncode != 0:
        pytest.skip(f"cannot build the project here: {done.stderr[-500:]}")
    assert (site / "mypkg" / "train.py").exists()
    assert any(p.name.startswith("mypkg_dist-") and p.name.endswith(".dist-info") for p in site.iterdir())
    return site


def write_suite(pytester: pytest.Pytester, site: Path, dist_name: str) -> None:
    """The tests of the project: rootdir has its pyproject.toml, mypkg is imported from the site directory."""
    pytester.makefile(".toml", pyproject=f'[project]\nname = "{dist_name}"\nversion = "0.1.0"\n')
    pytester.makeconftest(f"import sys\nsys.path.insert(0, {str(site)!r})\n")
    pytester.makepyfile(
        test_train="""
        import mypkg.train

        def test_loop(torchperf):
            assert "site-packages" in mypkg.train.__file__
            with torchperf.watch() as run:
                mypkg.train.train(run)
        """
    )


@pytest.mark.slow
def test_the_rootdir_project_installed_in_site_packages_is_your_code(pytester: pytest.Pytester, site_dir: Path) -> None:
    write_suite(pytester, site_dir, "mypkg-dist")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*no_host_sync (4 syncs at mypkg/train.py:11: 1 per step over 4 steps)*",
            "  counted as your code: package mypkg installed in site-packages: the project under test "
            "(pyproject.toml at the rootdir names 'mypkg-dist')",
            "  `.item()` (4x) at mypkg/train.py:11 in train [[]your code[]]",
        ]
    )


@pytest.mark.slow
def test_another_project_sees_it_as_a_library_unless_named(pytester: pytest.Pytester, site_dir: Path) -> None:
    write_suite(pytester, site_dir, "some-other-project")
    result = pytester.runpytest("-p", "no:cacheprovider", "-v")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*no_host_sync: passed (no sync in your code over 4 steps; 4 in mypkg (noted))*"])
    # By default the library's note is one session line for its site.
    quiet = pytester.runpytest("-p", "no:cacheprovider")
    quiet.stdout.fnmatch_lines(["torchperf: noted in 1 test: no_host_sync at mypkg/*.py:* in *(4x), not your code"])

    result = pytester.runpytest("-p", "no:cacheprovider", "-rf", "--torchperf-user-packages=mypkg")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["  counted as your code: package mypkg installed in site-packages: named by --torchperf-user-packages"]
    )

    pytester.makeini("[pytest]\ntorchperf_user_packages = mypkg\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*named by torchperf_user_packages"])


@pytest.mark.slow
def test_a_library_note_says_which_rule_classified_it(pytester: pytest.Pytester, site_dir: Path) -> None:
    write_suite(pytester, site_dir, "some-other-project")
    pytester.makepyfile(
        test_train="""
        import mypkg.train

        def test_loop(torchperf):
            with torchperf.watch(fail_on_framework_syncs=True) as run:
                mypkg.train.train(run)
        """
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["  made by mypkg, not by your code (installed in site-packages: a library (name it in "
         "torchperf_user_packages if it is yours); failing because fail_on_framework_syncs=True)"]
    )


@pytest.mark.parametrize(
    "option, message",
    [
        ("--torchperf-user-packages=my-pkg", "--torchperf-user-packages entry 'my-pkg' is not an import name like "
                                             "'mypkg' or 'mypkg.sub' (did you mean 'my_pkg'?)"),
        ("--torchperf-user-packages=mypkgg", "--torchperf-user-packages names 'mypkgg', which is not importable here "
                                             "(did you mean 'mypkg'?)"),
        ("--torchperf-max-sync-rate=2", "argument --torchperf-max-sync-rate: must be a number from 0 to 1, got '2'"),
    ],
)
def test_options_are_validated(pytester: pytest.Pytester, site_dir: Path, option: str, message: str) -> None:
    write_suite(pytester, site_dir, "some-other-project")
    result = pytester.runpytest("-p", "no:cacheprovider", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*{message}*"])


@pytest.mark.slow
def test_max_sync_rate_from_the_command_line_and_the_ini_file(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_rate="""
        import pytest
        import torch

        def loop(run):
            model = torch.nn.Linear(2, 1)
            for i in range(20):
                with run.step():
                    loss = model(torch.ones(1, 2)).sum()
                    if i % 4 == 0:
                        v = loss.item()

        def test_default(torchperf):
            with torchperf.watch() as run:
                loop(run)

        @pytest.mark.torchperf(max_sync_rate=0.25)
        def test_marker_wins(torchperf):
            with torchperf.watch(max_sync_rate=0.25) as run:
                loop(run)
        """
    )
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1, failed=1)  # every 4th step: 0.1 fails it
    pytester.runpytest("-p", "no:cacheprovider", "--torchperf-max-sync-rate=0.3").assert_outcomes(passed=2)
    pytester.makeini("[pytest]\ntorchperf_max_sync_rate = 0.3\n")
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    pytester.runpytest("-p", "no:cacheprovider", "--torchperf-max-sync-rate=0").assert_outcomes(passed=1, failed=1)
    pytester.makeini("[pytest]\ntorchperf_max_sync_rate = most\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini option torchperf_max_sync_rate must be a number from 0 to 1, got 'most'*"])


def test_the_classifier_keeps_its_tables_across_watches_until_what_they_come_from_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A watch starting again rebuilds the file classification only when a package it places was imported
    since, ``sys.path`` or the user packages changed, or a user package is not imported (its place on disk
    may appear at any time); a file's display path follows the working directory."""
    from pytest_torchperf import stacks, watch
    from pytest_torchperf.stacks import USER, UserPackage

    classify = stacks.classify

    def tables() -> object:
        """The tables after a watch (built on the first file classified)."""
        with watch():
            pass
        classify(__file__)
        return classify._roots

    kept = tables()
    assert tables() is kept  # nothing changed: the same tables

    monkeypatch.syspath_prepend(str(tmp_path))
    assert tables() is not kept  # a new sys.path entry: built again

    (tmp_path / "latepkg").mkdir()
    (tmp_path / "latepkg" / "__init__.py").write_text("")
    previous = classify.set_user_packages([UserPackage("latepkg", "named in a test")])
    try:
        kept = tables()
        assert tables() is not kept  # the user package is not imported: looked up again every watch
        import latepkg  # noqa: F401 - imported now

        kept = tables()
        assert tables() is kept
    finally:
        classify.set_user_packages(previous)
        sys.modules.pop("latepkg", None)

    mine = tmp_path / "sub" / "mine.py"
    mine.parent.mkdir()
    mine.write_text("")
    assert classify(str(mine)) == USER
    monkeypatch.chdir(tmp_path)
    assert stacks.display_path(str(mine)) == os.path.join("sub", "mine.py")
    monkeypatch.chdir(mine.parent)
    assert stacks.display_path(str(mine)) == "mine.py"
