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
# A new .venv gets torch from the shared layer (scripts/torch-layer.sh): one copy for every environment.
[ -x .venv/bin/python ] || { "$python" -m venv .venv && bash scripts/torch-layer.sh .venv; }
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test]"
bash scripts/check-torch.sh .venv/bin/python
status=0
# The side environments are built in the background while the linters and the package check run (a
# build is mostly pip on one core, waiting on the disk or the network); each one's output is shown
# when it is waited for.
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
waited() {  # waited PID LOG: wait for a background build and show its output; its status
  local rc=0
  wait "$1" || rc=$?
  cat "$2"
  return "$rc"
}
export TORCHPERF_REQUIRE_LEGACY=1
# The package check and the compatibility runs first, so that the main suite's summary is the last line.
if [ "$#" -eq 0 ]; then
  echo; echo "=== ruff check"
  .venv/bin/ruff check . || status=1
  echo; echo "=== mypy (strict on the public and extension API modules)"
  .venv/bin/mypy || status=1
fi
if [ "$#" -eq 0 ] && [ "${TORCHPERF_COMPAT:-1}" != 0 ]; then
  echo; echo "=== The package: sdist and wheel, installed in a fresh environment"
  bash scripts/check-package.sh || status=1
  echo; echo "=== The side environments (built in the background)"
  waited "$legacy" "$logs/legacy" || status=1
  legacy_shown=1
  waited "$compat" "$logs/compat" || status=1
  bash scripts/run-compat.sh || status=1
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
