#!/usr/bin/env bash
# Side environments with pytorch-lightning 1.5.0 (the seed bug) and 1.5.1 (its fix),
# each with torch 2.13.0 (CPU, from the shared layer: scripts/torch-layer.sh), pytest and this plugin
# installed editable. Idempotent: an environment built to the end that imports all three is kept.
#   TORCHPERF_LEGACY_ENVS  where to put them (default: .torchperf-envs/ in the repo)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${TORCHPERF_LEGACY_ENVS:-$root/.torchperf-envs}
python=${PYTHON:-python3}
mkdir -p "$dest"
# Installed without byte-compiling (scripts/pip-install.sh): the first process to import a module writes its cache.
unset PYTHONDONTWRITEBYTECODE
ready() {  # ready ENV: built to the end (the mark is written last) and imports what the tests use
  [ -f "$1/.torchperf-complete" ] && "$1/bin/python" -c "import pytorch_lightning, pytest_torchperf, pytest" >/dev/null 2>&1
}
install() {  # install VERSION ENV: the environment from nothing; stops at the first step that fails
  local version=$1 env=$2
  rm -rf "$env"
  bash "$root/scripts/make-venv.sh" "$python" "$env"
  bash "$root/scripts/torch-layer.sh" "$env"  # torch 2.13.0 CPU from the shared layer
  local pip=(bash "$root/scripts/pip-install.sh" "$env/bin/python")
  "${pip[@]}" torch==2.13.0 pytest
  # 1.5.x imports pkg_resources, which setuptools 81 removed; torch 2.13.0 needs setuptools>=77.0.3.
  # A pin outside that window makes pip resolve another torch (a multi-GB CUDA build): checked below.
  # 1.5.x pins old requirements that would pull another torch: install it alone, then what it imports.
  "${pip[@]}" --no-deps "pytorch-lightning==$version"
  "${pip[@]}" future tqdm PyYAML fsspec tensorboard "torchmetrics==0.6.0" "pyDeprecate==0.3.1" \
    packaging typing-extensions numpy "setuptools>=77.0.3,<81"
  # One build from the working tree at a time (this, the compat wheel, the package check): each writes
  # its metadata there.
  bash "$root/scripts/tree-build.sh" "${pip[@]}" --no-deps -e "$root"
  "$env/bin/python" -c "import pytorch_lightning as pl; assert pl.__version__ == '$version', pl.__version__"
  "$env/bin/python" -c "import pytest, pytest_torchperf"
  bash "$root/scripts/check-torch.sh" "$env/bin/python"
  touch "$env/.torchperf-complete"
}
build() {  # build VERSION: the environment of pytorch-lightning VERSION (kept if it is ready)
  local version=$1 env="$dest/pytorch-lightning-$1" attempt rc
  # Both commands build these (run-examples.sh, run-tests.sh): one build of an environment at a time.
  exec 8>"$dest/.pytorch-lightning-$version.lock"
  flock 8
  if ready "$env"; then
    echo "legacy-envs: $env is ready"
    return 0
  fi
  # A build that fails (pip, beside the other side environments' builds on a busy machine) is made once
  # more from nothing. One that fails again is removed, so that nothing runs in half an environment: the
  # seed-bug tests then say that it is missing, after this script's output has shown why.
  for attempt in first second; do
    echo "legacy-envs: building $env ($attempt try)"
    # Not `( ... ) || rc=$?`: on the left of || bash ignores set -e, in the subshell too.
    set +e
    (set -e; install "$version" "$env")
    rc=$?
    set -e
    [ "$rc" -ne 0 ] || return 0
    echo "legacy-envs: building $env failed (exit $rc)" >&2
  done
  rm -rf "$env"
  return "$rc"
}

# Both are built side by side (most of a build is pip on one core), each one's output shown when done.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
build 1.5.0 >"$logs/1.5.0.log" 2>&1 &
first=$!
build 1.5.1 >"$logs/1.5.1.log" 2>&1 &
second=$!
status=0
rc=0; wait "$first" || rc=$?; cat "$logs/1.5.0.log"; [ "$rc" -eq 0 ] || { echo "legacy-envs: pytorch-lightning 1.5.0 failed (exit $rc)" >&2; status=1; }
rc=0; wait "$second" || rc=$?; cat "$logs/1.5.1.log"; [ "$rc" -eq 0 ] || { echo "legacy-envs: pytorch-lightning 1.5.1 failed (exit $rc)" >&2; status=1; }
exit "$status"
