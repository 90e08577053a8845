#!/usr/bin/env bash
# The main job, on a fresh machine with only python3: every example suite, showing real failure reports
# (the nox session `examples`).
set -euo pipefail
exec bash "$(dirname "$0")/nox.sh" -s examples "$@"
