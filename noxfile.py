"""Every environment this project runs in, declared once. ``nox -l`` lists the sessions.

    nox -s tests                 # the suite (extra arguments after -- go to pytest)
    nox -s lint types docs       # ruff, mypy, ``mkdocs build --strict``
    nox -s examples              # the main job: every example suite, with its real failure reports
    nox                          # the test command: everything CI runs (scripts/run-tests.sh adds --parallel)

Environments are made with uv where it is installed (``uv|virtualenv``): uv links the files of a
package from its cache, so the environments with torch share one copy of it on disk. Every
environment with torch pins ``torch==2.13.0`` and checks, once installed, that it got that version and
no CUDA package (``nvidia-*``, ``triton``): no silent fallback to a multi-GB CUDA build.

uv does not read pip's configuration. Where pip is configured to find packages elsewhere (a local
index, a directory of wheels, a constraints file, a certificate), those settings are read from
``python -m pip config list`` when this file is loaded and handed to uv as its own ``UV_*`` settings,
unless they are set already.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
DIST = ROOT / "dist"
TORCH = "torch==2.13.0"  # CI's torch: the CPU build where the index offers it (see docs/getting-started.md)
PYTEST_OLDEST = "7.0.0"
PLUGGY_OLDEST = "1.2.0"
TORCH_FREE_PYTHONS = ["3.9", "3.10", "3.12", "3.13"]  # the oldest and newest Pythons, without torch
LEGACY_LIGHTNING = ["1.5.0", "1.5.1"]  # the seed bug, and its fix (examples/seed_bug)

nox.needs_version = ">=2026.10.20"  # --parallel and requires=
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_venv = "yes"  # an environment is kept and brought up to date (uv checks it in milliseconds)


# --- uv, configured as pip is --------------------------------------------------------------------------

# pip's setting -> (uv's environment variable, how uv separates several values)
PIP_TO_UV = {
    "index-url": ("UV_DEFAULT_INDEX", None),
    "extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "find-links": ("UV_FIND_LINKS", ","),
    "constraint": ("UV_CONSTRAINT", " "),
    "no-index": ("UV_NO_INDEX", None),
    "trusted-host": ("UV_INSECURE_HOST", " "),
    "cert": ("SSL_CERT_FILE", None),
    "client-cert": ("SSL_CLIENT_CERT", None),
    "default-timeout": ("UV_HTTP_TIMEOUT", None),
    "timeout": ("UV_HTTP_TIMEOUT", None),
    "proxy": ("HTTPS_PROXY", None),
}


def pip_settings() -> dict[str, str]:
    """pip's settings as ``python -m pip config list`` prints them (``global.find-links='...'``), by name;
    a section's own value (``install.``) over ``global.``, the environment's (``:env:.``) over both."""
    try:
        listing = subprocess.run(
            [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rank = {"global": 0, "install": 1, ":env:": 2}
    found: dict[str, tuple[int, str]] = {}
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if not sep or section not in rank:
            continue
        value = value.strip().strip("'\"")
        if name not in found or rank[section] >= found[name][0]:
            found[name] = (rank[section], value)
    return {name: value for name, (_, value) in found.items()}


def configure_uv_from_pip() -> None:
    """Give uv pip's settings, once per nox run (the parallel sessions' processes inherit them)."""
    if os.environ.get("TORCHPERF_UV_FROM_PIP") == "1":
        return
    os.environ["TORCHPERF_UV_FROM_PIP"] = "1"
    settings = pip_settings()
    for name, (variable, separator) in PIP_TO_UV.items():
        if name in settings and variable not in os.environ:
            value = settings[name]
            if name == "no-index":
                value = "1" if value.lower() in ("1", "true", "yes", "on") else "0"
            elif separator:
                value = separator.join(value.split())
            os.environ[variable] = value
    # pip picks the best version across all its indexes and links (a local `+cpu` build of torch over the
    # package index's); uv's default takes a package from the first index that has it.
    if ("extra-index-url" in settings or "find-links" in settings) and "UV_INDEX_STRATEGY" not in os.environ:
        os.environ["UV_INDEX_STRATEGY"] = "unsafe-best-match"


def find_other_pythons() -> None:
    """Let nox find the Pythons of the torch-free runs where pyenv installed them but did not make them
    global (pyenv's shims then refuse to run them)."""
    try:
        pyenv_root = subprocess.run(["pyenv", "root"], capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return
    paths = os.environ.get("PATH", "").split(os.pathsep)
    for version in TORCH_FREE_PYTHONS:
        installed = sorted(glob.glob(os.path.join(pyenv_root, "versions", f"{version}.*", "bin")))
        if installed and installed[-1] not in paths:
            paths.append(installed[-1])  # after the shims: a Python on PATH still comes first
    os.environ["PATH"] = os.pathsep.join(paths)


configure_uv_from_pip()
find_other_pythons()
# Where PYTHONDONTWRITEBYTECODE is set (as on many CI machines) no process writes a bytecode cache, and
# each of the few hundred the suite starts compiles torch and the plugin again (seconds each). uv installs
# without byte-compiling: the first process that imports a module writes its cache.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)


# --- helpers ---------------------------------------------------------------------------------------------


def extra(name: str) -> list[str]:
    """The requirements of one of pyproject.toml's extras (the pins live there, once)."""
    return list(nox.project.load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"][name])


def pinned(package: str) -> str:
    """``package==X`` as the test extras pin it (ruff, mypy)."""
    return next(requirement for requirement in extra("test") if requirement.startswith(f"{package}=="))


@contextmanager
def tree_build_lock() -> Iterator[None]:
    """One build from the working tree at a time: an editable install or a wheel writes the plugin's
    metadata and build folder into the tree, and sessions run side by side under --parallel."""
    lock_dir = ROOT / ".nox"
    lock_dir.mkdir(exist_ok=True)
    with open(lock_dir / ".tree-build.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # Windows: no parallel runs there
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def install_editable(session: nox.Session, *requirements: str, target: str = ".") -> None:
    with tree_build_lock():
        session.install(*requirements, "-e", target)


CHECK_TORCH = """
import importlib.metadata as md, sys
import torch
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "triton")))
if not torch.__version__.startswith("2.13.0") or cuda:
    sys.exit(f"{sys.prefix} has torch {torch.__version__} and {cuda or 'no CUDA packages'}; expected torch "
             "2.13.0 and no CUDA packages: a requirement made the installer resolve another torch")
print(f"torch {torch.__version__}, no CUDA packages")
"""


def check_torch(session: nox.Session) -> None:
    """Fail unless the environment has torch 2.13.0 and no CUDA package."""
    session.log(str(session.run("python", "-c", CHECK_TORCH, silent=True, log=False)).strip())


def plugin_wheel() -> str:
    """The wheel the ``build`` session made from the working tree (compatibility environments install it:
    not editable, since pytest 7.0 cannot rewrite an editable install's finder)."""
    wheels = sorted(DIST.glob("pytest_torchperf-*.whl"))
    if not wheels:
        raise RuntimeError("no wheel in dist/: run `nox -s build` first")
    return str(wheels[-1])


def install_plugin_wheel(session: nox.Session) -> None:
    """The plugin alone (not its requirements: the environment's own pytest and torch stay as they are)."""
    session.install("--no-deps", "--reinstall-package", "pytest-torchperf", plugin_wheel())


def pytest(session: nox.Session, *args: str, env: dict[str, str] | None = None) -> None:
    """pytest, where exit code 5 (no test selected) is a failure: a compatibility run that selects no test is
    broken, not passed."""
    session.run("python", "-m", "pytest", "-p", "no:cacheprovider", *args, env=env or {})


def example_suites() -> list[str]:
    """Every example suite except the seed bug's (pytorch-lightning 1.5 only)."""
    return sorted(
        f"examples/{path.parent.name}/"
        for path in ROOT.glob("examples/*/test_*.py")
        if path.parent.name != "seed_bug"
    )


# --- the suite and its linters ------------------------------------------------------------------------


@nox.session(requires=[f"pytorch-lightning-{v}" for v in LEGACY_LIGHTNING], allow_parallel=True)
def tests(session: nox.Session) -> None:
    """The test suite on 2 xdist workers (TORCHPERF_WORKERS); arguments after ``--`` replace that."""
    # pip too: tests/test_examples.py and tests/test_user_code.py install example projects with it (uv's
    # environments have none of their own).
    install_editable(session, TORCH, "pip", target=".[test]")
    check_torch(session)
    # -rfEs: name each failed and errored test, and say why each test was skipped, in the summary.
    args = session.posargs or ["-n", os.environ.get("TORCHPERF_WORKERS", "2"), "-rfEs"]
    legacy = Path(session.virtualenv.location).parent  # type: ignore[union-attr]
    # Exit code 5 (no test selected: a -k that matches nothing) is not a failure of the suite.
    session.run("python", "-m", "pytest", *args, success_codes=[0, 5],
                env={"TORCHPERF_REQUIRE_LEGACY": "1", "TORCHPERF_LEGACY_ENVS": str(legacy)})


@nox.session(allow_parallel=True)
def lint(session: nox.Session) -> None:
    """ruff (configured in pyproject.toml, pinned in the test extras)."""
    session.install(pinned("ruff"))
    session.run("ruff", "check", ".", *session.posargs)


@nox.session(allow_parallel=True)
def types(session: nox.Session) -> None:
    """mypy, strict on the public and extension API modules (pyproject.toml), with the libraries it reads."""
    session.install(TORCH, *extra("test"), "pytest>=7", "pluggy>=1.2")
    check_torch(session)
    session.run("mypy", *session.posargs)


@nox.session(default=False, allow_parallel=True)
def docs(session: nox.Session) -> None:
    """The docs site: ``mkdocs build --strict`` (the suite's tests/test_docs.py builds it as well)."""
    session.install(*extra("docs"))
    session.run("mkdocs", "build", "--strict", "--site-dir", str(Path(session.create_tmp()) / "site"))


# --- the package as users get it ------------------------------------------------------------------------


@nox.session(allow_parallel=True)
def build(session: nox.Session) -> None:
    """The sdist and the wheel in dist/, checked (metadata, README rendering, the wheel's contents)."""
    shutil.rmtree(DIST, ignore_errors=True)
    session.install("build[uv]", "twine", "check-wheel-contents")
    with tree_build_lock():  # build's isolated environment made by uv: seconds, not a pip install of setuptools
        session.run("python", "-m", "build", "--installer", "uv", "--outdir", str(DIST), ".", silent=True)
        shutil.rmtree(ROOT / "build", ignore_errors=True)
    session.run("twine", "check", "--strict", *map(str, sorted(DIST.iterdir())))
    session.run("check-wheel-contents", plugin_wheel())


@nox.session(name="package", requires=["build"], reuse_venv=False, allow_parallel=True)
@nox.parametrize("dist", ["wheel", "sdist"])
def package(session: nox.Session, dist: str) -> None:
    """The built wheel or sdist in a fresh environment, smoke-tested from outside the repository.

    With torch 2.13.0; scripts/smoke_test.py checks the metadata and runs a buggy and a fixed test."""
    built = plugin_wheel() if dist == "wheel" else str(next(DIST.glob("pytest_torchperf-*.tar.gz")))
    session.install(TORCH, built)
    check_torch(session)
    with tempfile.TemporaryDirectory() as outside:
        session.chdir(outside)
        session.run("python", str(ROOT / "scripts" / "smoke_test.py"), dist)


# --- compatibility: other packages and Pythons ------------------------------------------------------------


@nox.session(name="compat-lightning", requires=["build"], allow_parallel=True)
def compat_lightning(session: nox.Session) -> None:
    """The unified ``lightning`` package (no pytorch_lightning): its tests, Lightning's tests, the examples.

    Its own tests, the Lightning-facing test modules and every example suite (each *_buggy fails, each
    *_fixed passes), with pytorch_lightning absent so that nothing can fall back to it."""
    session.install(TORCH, "pytest", "pytest-xdist")
    # `lightning` declares pytorch-lightning as a dependency but never imports it: leave it out, so nothing
    # can fall back to the older package, and install what `lightning` does import.
    session.install("--no-deps", "lightning")
    session.install(TORCH, "lightning-utilities", "torchmetrics", "fsspec", "packaging", "PyYAML", "tqdm",
                    "typing-extensions")
    install_plugin_wheel(session)
    check_torch(session)
    session.run("python", "-c", "import importlib.util as u; assert u.find_spec('pytorch_lightning') is None",
                silent=True)
    # The Lightning-facing test modules (their suites import `lightning.pytorch` when pytorch_lightning is
    # missing: tests/conftest.py MODELS); one test matches pytorch_lightning's file paths in its output.
    pytest(session, "-n", "2", "-p", "no:warnings", "tests/test_lightning_package.py", "tests/test_iterators.py",
           "tests/test_seed_tips.py", "tests/test_workers.py", "tests/test_grads.py", "tests/test_cuda_cache.py",
           "tests/test_recompiles.py", "tests/test_data_parallel.py",
           "--deselect", "tests/test_iterators.py::test_lightning_val_loader_without_persistent_workers_fails",
           env={"TORCHPERF_REQUIRE_LIGHTNING_PACKAGE": "1"})
    session.run("python", "examples/run.py", "--expect", "by-name", *example_suites(),
                "--", "-p", "no:warnings", "-q", "--tb=no")


@nox.session(name="compat-transformers", requires=["build"], allow_parallel=True)
def compat_transformers(session: nox.Session) -> None:
    """transformers without Lightning: the Hugging Face Trainer's tests and the README's snippet.

    Apart from the suite: where transformers is installed, every `import pytorch_lightning` imports it too
    (torchmetrics' BERTScore), 1.5 s more in each process that imports Lightning."""
    session.install(TORCH, f"{plugin_wheel()}[test-transformers]")
    install_plugin_wheel(session)
    check_torch(session)
    pytest(session, "-p", "no:warnings", "tests/test_frameworks.py", "tests/test_docs.py", "-k", "hugging_face",
           env={"TORCHPERF_REQUIRE_TRANSFORMERS": "1"})


@nox.session(name="compat-pytest-oldest", requires=["build"], allow_parallel=True)
def compat_pytest_oldest(session: nox.Session) -> None:
    """The oldest pytest and pluggy supported, with torch: the plugin-glue test modules (fast tier)."""
    session.install(TORCH, f"pytest=={PYTEST_OLDEST}", f"pluggy=={PLUGGY_OLDEST}", "pytest-xdist",
                    "pytorch-lightning")
    install_plugin_wheel(session)
    check_torch(session)
    pytest(session, "-n", "2", "-p", "no:warnings", "tests/test_plugin.py", "tests/test_adoption.py",
           "tests/test_options.py", "tests/test_torch_free.py", "tests/test_baseline.py", "tests/test_github.py",
           "tests/test_ci_output.py", "-m", "not slow")


@nox.session(name="compat-torch-free", python=TORCH_FREE_PYTHONS, requires=["build"], allow_parallel=True)
def compat_torch_free(session: nox.Session) -> None:
    """Python 3.9-3.13 without torch: the torch-free test modules (tests/conftest.py TORCH_FREE).

    On the oldest Python with the oldest pytest and pluggy, on the others with the newest pytest."""
    if session.python == TORCH_FREE_PYTHONS[0]:
        session.install(f"pytest=={PYTEST_OLDEST}", f"pluggy=={PLUGGY_OLDEST}")
    else:
        session.install("pytest", "pytest-xdist")
    install_plugin_wheel(session)
    pytest(session, "tests", env={"TORCHPERF_EXPECT_NO_TORCH": "1"})


# --- pytorch-lightning 1.5: the seed bug -------------------------------------------------------------------


def legacy_lightning(session: nox.Session, version: str) -> None:
    """pytorch-lightning VERSION with torch 2.13.0, pytest and this plugin (editable).

    Marked complete at the end: tests/test_lightning_legacy.py runs examples/seed_bug in it."""
    complete = Path(session.virtualenv.location) / ".torchperf-complete"  # type: ignore[union-attr]
    complete.unlink(missing_ok=True)
    session.install(TORCH, "pytest")
    # 1.5.x pins old requirements that would pull another torch: installed alone, then what it imports.
    # It imports pkg_resources, which setuptools 81 removed; torch 2.13.0 needs setuptools>=77.0.3.
    session.install("--no-deps", f"pytorch-lightning=={version}")
    session.install(TORCH, "future", "tqdm", "PyYAML", "fsspec", "tensorboard", "torchmetrics==0.6.0",
                    "pyDeprecate==0.3.1", "packaging", "typing-extensions", "numpy", "setuptools>=77.0.3,<81")
    install_editable(session, "--no-deps")
    session.run("python", "-c", f"import pytorch_lightning as pl, pytest_torchperf; "
                f"assert pl.__version__ == '{version}', pl.__version__", silent=True)
    check_torch(session)
    complete.touch()


def _legacy_session(version: str) -> None:
    def session(session: nox.Session) -> None:
        legacy_lightning(session, version)

    session.__doc__ = f"pytorch-lightning {version}'s environment, for the seed bug (examples/seed_bug)."
    nox.session(session, name=f"pytorch-lightning-{version}", allow_parallel=True)


for _version in LEGACY_LIGHTNING:
    _legacy_session(_version)


# --- the examples and the benchmarks -----------------------------------------------------------------------


@nox.session(requires=[f"pytorch-lightning-{v}" for v in LEGACY_LIGHTNING], default=False)
def examples(session: nox.Session) -> None:
    """The main job: every example suite, showing real failure reports.

    examples/seed_bug under pytorch-lightning 1.5.0 (fails with its report) and 1.5.1 (passes), each other
    example suite under the current Lightning (each *_buggy fails with a report, its *_fixed twin passes),
    and examples/custom_invariant installed as a package of its own."""
    install_editable(session, TORCH, target=".[lightning]")
    check_torch(session)
    envs = Path(session.virtualenv.location).parent  # type: ignore[union-attr]
    failed = []

    def run(title: str, *args: str, env: dict[str, str] | None = None) -> None:
        print(f"\n=== {title}", flush=True)
        try:
            session.run("python", "examples/run.py", *args, env=env or {})
        except nox.command.CommandFailed:
            failed.append(title)

    for version, expect in zip(LEGACY_LIGHTNING, ("failed", "passed")):
        python = envs / f"pytorch-lightning-{version.replace('.', '-')}" / "bin" / "python"
        run(f"examples/seed_bug under pytorch-lightning {version}: expected to have {expect}",
            "--python", str(python), "--expect", expect, "examples/seed_bug", "--", "-p", "no:warnings")
    for suite in example_suites():
        run(f"{suite} under the current Lightning: each *_buggy fails with a report, its *_fixed twin passes",
            "--expect", "by-name", suite, "--", "-p", "no:warnings")
    with tempfile.TemporaryDirectory() as acme:
        session.install("--no-deps", "--target", acme, "examples/custom_invariant")
        run("a third-party invariant: examples/custom_invariant, installed as a package of its own",
            "--expect", "by-name", "examples/custom_invariant/tests", "--", "-p", "no:warnings",
            env={"PYTHONPATH": acme})
    if failed:
        session.error("unexpected outcomes in: " + "; ".join(failed))


@nox.session(allow_parallel=True)
def benchmarks(session: nox.Session) -> None:
    """Every benchmark script with its tiny ``--smoke`` setting, two at a time, so that none can rot.

    The figures of a smoke run mean nothing; ``nox -s benchmarks -- ARGS`` runs each with ARGS instead,
    one at a time unless ARGS has --smoke."""
    install_editable(session, TORCH, target=".[test]")
    check_torch(session)
    args = session.posargs if session.posargs else ["--smoke"]
    jobs = "2" if "--smoke" in args else "1"
    session.run("bash", "scripts/run-benchmarks.sh", *args, external=True,
                env={"PYTHON": session.virtualenv.bin + "/python", "TORCHPERF_BENCH_JOBS": jobs})  # type: ignore[union-attr]


# --- a contributor's environment ------------------------------------------------------------------------


@nox.session(venv_backend="none", default=False)
def dev(session: nox.Session) -> None:
    """``.venv``: torch 2.13.0, the test extras and this plugin (editable), for running single test files."""
    uv = shutil.which("uv")
    if uv:
        session.run(uv, "venv", "--seed", "--allow-existing", "-p", sys.executable, ".venv", external=True)
        with tree_build_lock():
            session.run(uv, "pip", "install", "-p", ".venv/bin/python", TORCH, "-e", ".[test]", external=True)
    else:
        session.run(sys.executable, "-m", "venv", ".venv", external=True)
        with tree_build_lock():
            session.run(".venv/bin/python", "-m", "pip", "install", TORCH, "-e", ".[test]", external=True)
    session.run(".venv/bin/python", "-c", CHECK_TORCH, external=True)


# What `nox` runs without -s: the test command (CI), every session but the main job, the docs (the suite
# builds them) and .venv. Longest first: under --parallel the short ones fill the cores at the end.
nox.options.sessions = [
    "tests", "compat-lightning", "benchmarks", "compat-pytest-oldest", "compat-transformers", "types",
    "package", "lint", "compat-torch-free",
]
