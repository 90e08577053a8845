#!/usr/bin/env bash
# CI: every benchmark that takes --smoke runs in its tiny setting (it runs and prints; budgets are not
# judged at that size). Usage: bash scripts/bench-smoke.sh [python]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
python=${1:-$root/.venv/bin/python}
status=0
for bench in "$root"/benchmarks/bench_*.py; do
  grep -q -- '"--smoke"' "$bench" || continue
  echo "--- $(basename "$bench") --smoke"
  (cd "$root" && "$python" "$bench" --smoke) >/dev/null 2>&1 || { echo "benchmark failed: $bench --smoke"; status=1; }
done
exit "$status"
