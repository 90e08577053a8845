#!/usr/bin/env bash
# make-venv.sh PYTHON DIR: a virtual environment at DIR for the interpreter PYTHON, with the pip that
# PYTHON bundles (the one `PYTHON -m venv DIR` would give), installed without byte-compiling it.
# `-m venv` runs ensurepip, which byte-compiles pip's 700 modules and ignores PIP_* settings: about 5
# CPU-seconds an environment, and the scripts build eleven. Here the environment is made without pip,
# and the bundled wheel installed into it by PYTHON's own pip (`--python`, pip 22.3 or later), or, where
# PYTHON has none, by pip run from the wheel itself: about 2 CPU-seconds in all (3 from the wheel). The
# first process that imports pip writes its bytecode cache (the scripts unset PYTHONDONTWRITEBYTECODE).
set -euo pipefail
# The interpreter itself, not a launcher in front of it: a pyenv shim runs `pyenv rehash` after every
# `python -m pip`, and two environments built at once then race for its lock ("cannot rehash"), failing one.
python=$("$1" -c 'import sys; print(sys.executable)')
dir=$2
"$python" -m venv --without-pip "$dir"
wheel=$("$dir/bin/python" -c '
import glob, os, ensurepip
wheels = sorted(glob.glob(os.path.join(os.path.dirname(ensurepip.__file__), "_bundled", "pip-*.whl")))
print(wheels[-1] if wheels else "")')
if [ -z "$wheel" ]; then  # a Python whose ensurepip has no wheel of its own (some distributions' builds)
  rm -rf "$dir"
  exec "$python" -m venv "$dir"
fi
install=(install -q --disable-pip-version-check --no-compile --no-index --no-deps "$wheel")
if "$python" -c 'import sys, pip; sys.exit(tuple(map(int, pip.__version__.split(".")[:2])) < (22, 3))' 2>/dev/null; then
  "$python" -m pip --python "$dir/bin/python" "${install[@]}"
else
  "$dir/bin/python" "$wheel/pip" "${install[@]}"
fi
