#!/usr/bin/env bash
# Run every benchmark script in benchmarks/ (each bench_*.py), so that none can rot.
#   scripts/run-benchmarks.sh --smoke     each with its tiny CI setting (seconds each; no budget verdict)
#   scripts/run-benchmarks.sh             each with its own defaults (minutes; budgets enforced)
# Uses .venv/bin/python unless PYTHON names another interpreter. Exits non-zero if any script fails;
# the figures of a --smoke run mean nothing (too few rounds, and others may share the cores).
# TORCHPERF_BENCH_JOBS=N runs N scripts at a time (each one's output shown in order when it ends): the
# benchmarks use one torch thread, so a smoke run on 2 cores takes about half the time with N=2. Leave
# it at 1 (the default) for figures that mean something.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root/benchmarks"
python=${PYTHON:-$root/.venv/bin/python}
jobs=${TORCHPERF_BENCH_JOBS:-1}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
status=0

one() {  # one SCRIPT ARGS...: run it, its output and a last line saying how it went
  local script=$1 start
  shift
  echo
  echo "=== benchmarks/$script $*"
  start=$(date +%s)
  if "$python" "$script" "$@"; then
    echo "run-benchmarks: $script ok ($(( $(date +%s) - start )) s)"
  else
    echo "run-benchmarks: $script FAILED" >&2
    return 1
  fi
}

scripts=(bench_*.py)
if [ "$jobs" -le 1 ]; then
  for script in "${scripts[@]}"; do one "$script" "$@" || status=1; done
  exit "$status"
fi
for i in "${!scripts[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do wait -n || true; done
  { rc=0; one "${scripts[$i]}" "$@" >"$logs/$i.log" 2>&1 || rc=$?; echo "$rc" >"$logs/$i.rc"; } &
done
wait
for i in "${!scripts[@]}"; do
  cat "$logs/$i.log"
  [ "$(cat "$logs/$i.rc" 2>/dev/null || echo 1)" -eq 0 ] || status=1
done
exit "$status"
