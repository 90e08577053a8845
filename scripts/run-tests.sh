#!/usr/bin/env bash
# The test command (CI: .ci/run), on a fresh machine with only python3: every session of noxfile.py but
# the main job (nox -l), two at a time. Extra arguments go to pytest, and only the suite runs.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$#" -eq 0 ]; then
  exec bash scripts/nox.sh --parallel "${TORCHPERF_SESSIONS:-2}"
fi
exec bash scripts/nox.sh -s tests -- "$@"
