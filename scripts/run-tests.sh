#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine with only python3 (and pyenv's 3.9 and 3.13).
#   .venv/                 torch 2.13.0 (CPU), current pytorch-lightning, pytest, pytest-xdist, this plugin
#   .torchperf-envs/       pytorch-lightning 1.5.0 and 1.5.1 for the seed-bug integration test, and the
#                          compatibility environments (scripts/compat-envs.sh)
# Extra arguments go to pytest. Without any (as CI runs it), the linters (ruff, mypy: configured in
# pyproject.toml, pinned in the test extras), the package check (scripts/check-package.sh), the
# compatibility runs (scripts/run-compat.sh) and a smoke run of every benchmark
# (scripts/run-benchmarks.sh --smoke) run before the suite; TORCHPERF_COMPAT=0 leaves out the package
# check and the compatibility runs, TORCHPERF_BENCH=0 the benchmarks; the suite then runs on
# TORCHPERF_WORKERS xdist workers (default 2). The suite builds the docs site with `mkdocs build --strict`
# and runs the README's snippets (tests/test_docs.py). `-m "not slow"` is the fast tier (CONTRIBUTING.md).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
# Where PYTHONDONTWRITEBYTECODE is set (as on many CI machines) no process writes a bytecode cache, and
# each of the few hundred the suite starts compiles the plugin (0.15-0.25 s) and its test files again.
# With it unset, the first process that imports a module writes its cache: every environment is
# installed without byte-compiling (scripts/pip-install.sh).
unset PYTHONDONTWRITEBYTECODE
# The side environments are built in the background from the start, beside the main environment's
# install and then the linters and the package check (a build is mostly pip on one core, waiting on the
# disk or the network); each one's output is shown when it is waited for. The first to need the shared
# torch layer builds it (scripts/torch-layer.sh), the others wait for it.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
bash scripts/legacy-envs.sh >"$logs/legacy" 2>&1 &
legacy=$!
legacy_shown=
compat=
if [ "$#" -eq 0 ] && [ "${TORCHPERF_COMPAT:-1}" != 0 ]; then
  bash scripts/compat-envs.sh >"$logs/compat" 2>&1 &
  compat=$!
fi
# A new .venv gets torch from the shared layer (scripts/torch-layer.sh): one copy for every environment.
[ -x .venv/bin/python ] || { bash scripts/make-venv.sh "$python" .venv && bash scripts/torch-layer.sh .venv; }
# The editable install writes the plugin's metadata into the tree: one build from it at a time.
bash scripts/tree-build.sh \
  bash scripts/pip-install.sh .venv/bin/python torch==2.13.0 -e ".[test]"
bash scripts/check-torch.sh .venv/bin/python
status=0
waited() {  # waited PID LOG: wait for a background build and show its output; its status
  local rc=0
  wait "$1" || rc=$?
  cat "$2"
  return "$rc"
}
export TORCHPERF_REQUIRE_LEGACY=1
# The package check and the compatibility runs first, so that the main suite's summary is the last line.
# The package check (pip and a build, on one core) runs beside the linters (mypy: one core).
package=
if [ "$#" -eq 0 ] && [ "${TORCHPERF_COMPAT:-1}" != 0 ]; then
  bash scripts/check-package.sh >"$logs/package" 2>&1 &
  package=$!
fi
if [ "$#" -eq 0 ]; then
  echo; echo "=== ruff check"
  .venv/bin/ruff check . || status=1
  echo; echo "=== mypy (strict on the public and extension API modules)"
  .venv/bin/mypy || status=1
fi
if [ -n "$package" ]; then
  echo; echo "=== The package: sdist and wheel, installed in a fresh environment"
  waited "$package" "$logs/package" || status=1
  echo; echo "=== The side environments (built in the background)"
  waited "$legacy" "$logs/legacy" || status=1
  legacy_shown=1
  if waited "$compat" "$logs/compat"; then
    TORCHPERF_COMPAT_ENVS_BUILT=1 bash scripts/run-compat.sh || status=1
  else
    status=1
    bash scripts/run-compat.sh || status=1  # builds what it can again, and runs in what there is
  fi
fi
if [ -z "$legacy_shown" ]; then  # TORCHPERF_COMPAT=0, or pytest arguments given: the suite needs them
  waited "$legacy" "$logs/legacy" || status=1
fi
if [ "$#" -eq 0 ] && [ "${TORCHPERF_BENCH:-1}" != 0 ]; then
  echo; echo "=== Every benchmark, smoke setting"
  TORCHPERF_BENCH_JOBS=${TORCHPERF_BENCH_JOBS:-2} bash scripts/run-benchmarks.sh --smoke || status=1
fi
args=("$@")
if [ "$#" -eq 0 ]; then
  echo; echo "=== The test suite (${TORCHPERF_WORKERS:-2} xdist workers)"
  args=(-n "${TORCHPERF_WORKERS:-2}")
fi
rc=0
.venv/bin/python -m pytest "${args[@]}" || rc=$?
# 5: no test selected (a -k that matches nothing); not a failure of the suite.
if [ "$rc" -eq 5 ]; then
  echo "run-tests: pytest selected no test"
  rc=0
fi
[ "$rc" -eq 0 ] || status=$rc
if [ "$status" -ne 0 ] && [ "$rc" -eq 0 ]; then
  echo "run-tests: the suite passed, but a linter, the package check, a compatibility run or a benchmark failed (see above)"
fi
exit "$status"
