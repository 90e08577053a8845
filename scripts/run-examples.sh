#!/usr/bin/env bash
# Set up and run the main job: the example suites, showing real torchperf failure reports.
# Each example directory is run with the environment it is about, and the script
# checks every test ended as the example says (`*_buggy` fails, `*_fixed` passes).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
# Where PYTHONDONTWRITEBYTECODE is set (as on many CI machines) no process writes a bytecode cache, and
# each example session compiles the plugin again.
unset PYTHONDONTWRITEBYTECODE  # and .venv is installed without byte-compiling (scripts/pip-install.sh)
# The pytorch-lightning 1.5 environments are built in the background, beside the main one (the first to
# need the shared torch layer builds it, scripts/torch-layer.sh; the other waits for it).
legacy_log=$(mktemp)
bash scripts/legacy-envs.sh >"$legacy_log" 2>&1 &
legacy=$!
# A new .venv gets torch from the shared layer (scripts/torch-layer.sh): one copy for every environment.
[ -x .venv/bin/python ] || { bash scripts/make-venv.sh "$python" .venv && bash scripts/torch-layer.sh .venv; }
# The editable install writes the plugin's metadata into the tree: one build from it at a time.
bash scripts/tree-build.sh \
  bash scripts/pip-install.sh .venv/bin/python torch==2.13.0 -e ".[lightning]"
bash scripts/check-torch.sh .venv/bin/python
legacy_status=0
wait "$legacy" || legacy_status=$?
cat "$legacy_log"
rm -f "$legacy_log"
[ "$legacy_status" -eq 0 ] || exit "$legacy_status"
envs=${TORCHPERF_LEGACY_ENVS:-$root/.torchperf-envs}
status=0
run() { .venv/bin/python examples/run.py "$@" -- -p no:warnings || status=1; }

echo; echo "=== The seed bug: pytorch-lightning 1.5.0 drops the DataLoader iterator every epoch"
run --python "$envs/pytorch-lightning-1.5.0/bin/python" --expect failed examples/seed_bug
echo; echo "=== The same test under pytorch-lightning 1.5.1, where it was fixed"
run --python "$envs/pytorch-lightning-1.5.1/bin/python" --expect passed examples/seed_bug
echo; echo "=== Current Lightning: each *_buggy example fails with a report, its *_fixed twin passes"
for suite in examples/*/; do
  [ "$suite" = "examples/seed_bug/" ] && continue
  compgen -G "${suite}test_*.py" >/dev/null || continue
  run --expect by-name "$suite"
done
echo; echo "=== A third-party invariant: examples/custom_invariant, installed as a package of its own"
acme=$(mktemp -d)
trap 'rm -rf "$acme"' EXIT
bash scripts/pip-install.sh .venv/bin/python --no-deps --no-build-isolation --target "$acme" \
  examples/custom_invariant
export PYTHONPATH="$acme${PYTHONPATH:+:$PYTHONPATH}"
run --expect by-name examples/custom_invariant/tests
exit "$status"
