#!/usr/bin/env bash
# Side environments for the compatibility runs (scripts/run-compat.sh). Idempotent: an
# environment that already has what it is for is kept. Each holds this plugin installed
# from the working tree (not editable: pytest 7.0 cannot rewrite an editable finder).
#
#   lightning      Python 3 (this one), torch 2.13.0, the unified `lightning` package and NOT
#                  pytorch_lightning, pytest, pytest-xdist
#   transformers   Python 3 (this one), torch 2.13.0, the test-transformers extra (transformers, accelerate,
#                  pytest) and NOT pytorch_lightning: the Hugging Face Trainer's tests
#   pytest-oldest  Python 3 (this one), torch 2.13.0, pytorch-lightning, the oldest pytest and
#                  pluggy this plugin supports (PYTEST_OLDEST, PLUGGY_OLDEST), pytest-xdist
#   python-3.9     the oldest Python supported, the oldest pytest and pluggy, no torch
#   python-3.10    Python 3.10, the newest pytest, no torch
#   python-3.12    Python 3.12, the newest pytest, no torch
#   python-3.13    the newest Python supported, the newest pytest, no torch
#
# torch is only installed where a CPU wheel of the pinned version exists locally; the
# Python 3.9, 3.10, 3.12 and 3.13 environments run the torch-free part of the suite (with _slots).
#   TORCHPERF_COMPAT_ENVS  where to put them (default: .torchperf-envs/ in the repo)
#   PYTHON39, PYTHON310, PYTHON312, PYTHON313   interpreters to use (default: pythonX.Y on PATH or from pyenv)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${TORCHPERF_COMPAT_ENVS:-$root/.torchperf-envs}
python=${PYTHON:-python3}
PYTEST_OLDEST=${PYTEST_OLDEST:-7.0.0}
PLUGGY_OLDEST=${PLUGGY_OLDEST:-1.2.0}
mkdir -p "$dest"
# Installed without byte-compiling (scripts/pip-install.sh): the first process to import a module writes its cache.
unset PYTHONDONTWRITEBYTECODE

# The plugin's files: an environment whose copy differs from the working tree is refreshed.
stamp=$(cd "$root" && find pyproject.toml pytest_torchperf -name "*.py" -o -name pyproject.toml | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-16)

find_python() {  # find_python 3.9: an interpreter of exactly that version, or nothing
  local version=$1 candidate pyenv_root override="PYTHON${1/./}"
  pyenv_root=$(pyenv root 2>/dev/null || true)
  for candidate in "${!override:-}" "$(command -v "python$version" 2>/dev/null || true)" \
      ${pyenv_root:+"$pyenv_root"/versions/"$version".*/bin/python"$version"}; do
    [ -n "$candidate" ] && [ -x "$candidate" ] || continue
    if "$candidate" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$version'.split('.'))))" \
        >/dev/null 2>&1; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

pip_in() { bash "$root/scripts/pip-install.sh" "$1/bin/python" "${@:2}"; }

# The plugin's wheel, built once from the working tree for every environment (they are built side by
# side: one build folder for all of them would be a race).
wheels=$(mktemp -d)
logs=$(mktemp -d)
trap 'rm -rf "$wheels" "$logs"' EXIT
wheel() { compgen -G "$wheels/*.whl"; }
build_wheel() {  # under the lock of builds from the working tree (scripts/tree-build.sh)
  bash "$root/scripts/tree-build.sh" \
    bash -c '"$1" -m pip wheel -q --disable-pip-version-check --no-deps -w "$2" "$3" && rm -rf "$3/build"' \
    _ "$python" "$wheels" "$root"
  wheel >/dev/null || { echo "compat-envs: no wheel of the plugin was built" >&2; return 1; }
}
# The wheel is built while the environments install their own packages (the lock may be held meanwhile
# by the main environment's editable install): each waits for it only to install it.
wheel_ready() {
  while [ ! -e "$wheels/.done" ] && [ ! -e "$wheels/.failed" ]; do sleep 1; done
  [ -e "$wheels/.done" ] || { echo "compat-envs: no wheel of the plugin to install" >&2; return 1; }
}

# build NAME INTERPRETER CHECK-CODE INSTALL-FUNCTION
build() {
  local name=$1 interpreter=$2 check=$3 install=$4 env="$dest/$1"
  if [ -f "$env/.torchperf-stamp" ] && [ "$(cat "$env/.torchperf-stamp")" = "$stamp" ] \
      && "$env/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "compat-envs: $env is ready"
    return 0
  fi
  if [ -x "$env/bin/python" ] && "$env/bin/python" -c "$check" >/dev/null 2>&1; then
    echo "compat-envs: $env: refreshing the plugin"
  else
    echo "compat-envs: building $env"
    rm -rf "$env"
    bash "$root/scripts/make-venv.sh" "$interpreter" "$env"
    "$install" "$env"
  fi
  # Not editable, no dependencies: the environment's own pytest and torch stay as they are.
  wheel_ready
  pip_in "$env" --no-deps --force-reinstall "$(wheel)"
  "$env/bin/python" -c "$check"
  if "$env/bin/python" -c "import torch" >/dev/null 2>&1; then bash "$root/scripts/check-torch.sh" "$env/bin/python"; fi
  echo "$stamp" > "$env/.torchperf-stamp"
}

install_lightning() {
  bash "$root/scripts/torch-layer.sh" "$1"  # torch 2.13.0 CPU from the shared layer
  pip_in "$1" torch==2.13.0 pytest pytest-xdist
  # `lightning` declares pytorch-lightning as a dependency but never imports it: leave it out,
  # so nothing can fall back to the older package, and install what `lightning` does import.
  pip_in "$1" --no-deps lightning
  pip_in "$1" lightning-utilities torchmetrics fsspec packaging PyYAML tqdm typing-extensions 2>&1 \
    | { grep -v "pytorch-lightning, which is not installed\|dependency resolver does not currently" || true; }
}
install_pytest_oldest() {
  bash "$root/scripts/torch-layer.sh" "$1"
  pip_in "$1" torch==2.13.0 "pytest==$PYTEST_OLDEST" "pluggy==$PLUGGY_OLDEST" pytest-xdist pytorch-lightning
}
install_transformers() {
  bash "$root/scripts/torch-layer.sh" "$1"
  wheel_ready
  pip_in "$1" torch==2.13.0 "$(wheel)[test-transformers]"
}
install_python_oldest() { pip_in "$1" "pytest==$PYTEST_OLDEST" "pluggy==$PLUGGY_OLDEST" pytest-xdist; }
install_python_newest() { pip_in "$1" pytest pytest-xdist; }

{ if build_wheel; then touch "$wheels/.done"; else touch "$wheels/.failed"; fi; } >"$logs/wheel.log" 2>&1 &
wheel_job=$!
# Each environment is built in the background, its output kept and shown in order once all are done:
# most of a build is pip unpacking and compiling on one core, so two cores build about two at once.
names=()
pids=()
start() {  # start NAME INTERPRETER CHECK-CODE INSTALL-FUNCTION
  build "$@" >"$logs/$1.log" 2>&1 &
  names+=("$1")
  pids+=("$!")
}
start lightning "$python" \
  "import lightning.pytorch, pytest_torchperf, xdist, importlib.util as u; assert u.find_spec('pytorch_lightning') is None" \
  install_lightning
start transformers "$python" \
  "import transformers, accelerate, pytest_torchperf, importlib.util as u; assert u.find_spec('pytorch_lightning') is None" \
  install_transformers
start pytest-oldest "$python" \
  "import torch, pytorch_lightning, pytest, pluggy, pytest_torchperf; assert pytest.__version__ == '$PYTEST_OLDEST'" \
  install_pytest_oldest
status=0
for version in 3.9 3.10 3.12 3.13; do
  if ! interpreter=$(find_python "$version"); then
    echo "compat-envs: no Python $version found (set PYTHON${version/./})" >&2
    status=1
    continue
  fi
  if [ "$version" = 3.9 ]; then
    start "python-$version" "$interpreter" \
      "import pytest, pytest_torchperf; assert pytest.__version__ == '$PYTEST_OLDEST'" install_python_oldest
  else
    start "python-$version" "$interpreter" "import pytest, xdist, pytest_torchperf" install_python_newest
  fi
done
wait "$wheel_job" || true
cat "$logs/wheel.log"
[ -e "$wheels/.done" ] || status=1
for i in "${!pids[@]}"; do
  rc=0
  wait "${pids[$i]}" || rc=$?
  cat "$logs/${names[$i]}.log"
  if [ "$rc" -ne 0 ]; then
    echo "compat-envs: building ${names[$i]} failed (exit $rc)" >&2
    status=1
  fi
done
exit "$status"
