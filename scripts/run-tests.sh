#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine with only python3 (and pyenv's 3.9 and 3.13).
#   .venv/                 torch 2.13.0 (CPU), current pytorch-lightning, pytest, pytest-xdist, this plugin
#   .torchperf-envs/       pytorch-lightning 1.5.0 and 1.5.1 for the seed-bug integration test, and the
#                          compatibility environments (scripts/compat-envs.sh)
# Extra arguments go to pytest. Without any (as CI runs it), the package check
# (scripts/check-package.sh) and the compatibility runs (scripts/run-compat.sh) run before the
# suite; TORCHPERF_COMPAT=0 leaves them out.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test]"
bash scripts/check-torch.sh .venv/bin/python
bash scripts/legacy-envs.sh
export TORCHPERF_REQUIRE_LEGACY=1
status=0
# The package check and the compatibility runs first, so that the main suite's summary is the last line.
if [ "$#" -eq 0 ] && [ "${TORCHPERF_COMPAT:-1}" != 0 ]; then
  echo; echo "=== The package: sdist and wheel, installed in a fresh environment"
  bash scripts/check-package.sh || status=1
  bash scripts/run-compat.sh || status=1
  echo; echo "=== The benchmarks, each in its --smoke setting"
  bash scripts/bench-smoke.sh || status=1
  echo; echo "=== The test suite"
fi
rc=0
.venv/bin/python -m pytest "$@" || rc=$?
# 5: no test selected (a -k that matches nothing); not a failure of the suite.
if [ "$rc" -eq 5 ]; then
  echo "run-tests: pytest selected no test"
  rc=0
fi
[ "$rc" -eq 0 ] || status=$rc
if [ "$status" -ne 0 ] && [ "$rc" -eq 0 ]; then
  echo "run-tests: the suite passed, but the package check or a compatibility run failed (see above)"
fi
exit "$status"
