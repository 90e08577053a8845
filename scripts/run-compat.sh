#!/usr/bin/env bash
# Compatibility runs, each in a side environment of scripts/compat-envs.sh:
#   - the unified `lightning` package (no pytorch_lightning): its own tests, the Lightning-facing
#     test modules and every example suite (each *_buggy fails, each *_fixed passes)
#   - transformers (without Lightning): the Hugging Face Trainer's tests and the README's snippet of it
#   - the oldest pytest and pluggy supported, with torch: the plugin-glue test modules (fast tier)
#   - Python 3.9 (with the oldest pytest), 3.10, 3.12 and 3.13 (the newest pytest), without torch:
#     the torch-free test modules (tests/conftest.py TORCH_FREE), _slots' own tests among them
# Exits non-zero if any run fails, or selects no test (that would be a broken run, not a pass).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
envs=${TORCHPERF_COMPAT_ENVS:-$root/.torchperf-envs}
status=0
# The environments are installed without byte-compiling (scripts/pip-install.sh): the first process to
# import a module writes its cache.
unset PYTHONDONTWRITEBYTECODE
# Built (or checked) first, unless the caller has just done it (run-tests.sh: checking them again costs
# 20 CPU-seconds of imports and a wheel build).
if [ "${TORCHPERF_COMPAT_ENVS_BUILT:-0}" != 1 ]; then
  bash scripts/compat-envs.sh || status=1
fi

run() {  # run TITLE ENV PYTEST-ARGS...
  local title=$1 env=$2 rc=0
  shift 2
  echo
  echo "=== compat: $title"
  if [ ! -x "$envs/$env/bin/python" ]; then
    echo "compat: no environment $envs/$env" >&2
    status=1
    return
  fi
  "$envs/$env/bin/python" -m pytest -p no:cacheprovider "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then
    echo "compat: $title selected no test" >&2
  fi
  [ "$rc" -eq 0 ] || status=1
}

lightning_version=$("$envs/lightning/bin/python" -c "import lightning; print(lightning.__version__)" 2>/dev/null || echo "?")
# The Lightning-facing test modules (their suites import `lightning.pytorch` when pytorch_lightning
# is missing: tests/conftest.py MODELS); one test matches pytorch_lightning's file paths in its output.
TORCHPERF_REQUIRE_LIGHTNING_PACKAGE=1 run "lightning $lightning_version (import lightning as L), no pytorch_lightning" \
  lightning -n 2 -p no:warnings tests/test_lightning_package.py tests/test_iterators.py tests/test_seed_tips.py \
  tests/test_workers.py tests/test_grads.py tests/test_cuda_cache.py tests/test_recompiles.py \
  tests/test_data_parallel.py \
  --deselect tests/test_iterators.py::test_lightning_val_loader_without_persistent_workers_fails
# The Hugging Face run is one process (one core): it runs in the background beside the example suites
# and the torch-free runs (one process each too), its output shown after theirs.
transformers_version=$("$envs/transformers/bin/python" -c "import transformers; print(transformers.__version__)" 2>/dev/null || echo "?")
transformers_log=$(mktemp)
trap 'rm -f "$transformers_log"' EXIT
(
  status=0
  TORCHPERF_REQUIRE_TRANSFORMERS=1 run "transformers $transformers_version: the Hugging Face Trainer's tests and the README's snippet" \
    transformers -p no:warnings tests/test_frameworks.py tests/test_docs.py -k "hugging_face"
  exit "$status"
) >"$transformers_log" 2>&1 &
transformers=$!
echo
echo "=== compat: the example suites under lightning $lightning_version (one session: the main job shows each)"
suites=()
for suite in examples/*/; do
  [ "$suite" = "examples/seed_bug/" ] && continue  # pytorch-lightning 1.5 only
  compgen -G "${suite}test_*.py" >/dev/null || continue
  suites+=("$suite")
done
"$envs/lightning/bin/python" examples/run.py --expect by-name "${suites[@]}" -- -p no:warnings -q --tb=no || status=1
run "pytest ${PYTEST_OLDEST:-7.0.0} and pluggy ${PLUGGY_OLDEST:-1.2.0} (the oldest supported), with torch" \
  pytest-oldest -n 2 -p no:warnings tests/test_plugin.py tests/test_adoption.py tests/test_options.py \
  tests/test_torch_free.py tests/test_baseline.py tests/test_github.py tests/test_ci_output.py \
  -m "not slow"  # the hooks and options in-process; the slow tier's subprocess sessions run in the suite
for version in 3.9 3.10 3.12 3.13; do
  TORCHPERF_EXPECT_NO_TORCH=1 run "Python $version without torch: the torch-free tests" "python-$version" tests
done
rc=0
wait "$transformers" || rc=$?
cat "$transformers_log"
[ "$rc" -eq 0 ] || status=1
exit "$status"
