#!/usr/bin/env bash
# Run every benchmark script in benchmarks/ (each bench_*.py), so that none can rot.
#   scripts/run-benchmarks.sh --smoke     each with its tiny CI setting (seconds each; no budget verdict)
#   scripts/run-benchmarks.sh             each with its own defaults (minutes; budgets enforced)
# Uses .venv/bin/python unless PYTHON names another interpreter. Exits non-zero if any script fails;
# the figures of a --smoke run mean nothing (too few rounds, and others may share the cores).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/benchmarks"
python=${PYTHON:-$root/.venv/bin/python}
status=0
for script in bench_*.py; do
  echo
  echo "=== benchmarks/$script $*"
  start=$(date +%s)
  if "$python" "$script" "$@"; then
    echo "run-benchmarks: $script ok ($(( $(date +%s) - start )) s)"
  else
    echo "run-benchmarks: $script FAILED" >&2
    status=1
  fi
done
exit "$status"
