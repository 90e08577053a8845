#!/usr/bin/env bash
# Set up and run the test suite on a fresh machine with only python3.
#   .venv/                 torch 2.13.0 (CPU), current pytorch-lightning, pytest, pytest-xdist, this plugin
#   .torchperf-envs/       pytorch-lightning 1.5.0 and 1.5.1 for the seed-bug integration test
# Extra arguments go to pytest.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0 -e ".[test]"
bash scripts/legacy-envs.sh
export TORCHPERF_REQUIRE_LEGACY=1
status=0
.venv/bin/python -m pytest "$@" || status=$?
# 5: no test selected (a -k that matches nothing); not a failure of the suite.
if [ "$status" -eq 5 ]; then
  echo "run-tests: pytest selected no test"
  status=0
fi
exit "$status"
