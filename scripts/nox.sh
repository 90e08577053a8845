#!/usr/bin/env bash
# nox.sh [NOX ARGS...]: nox and uv (scripts/nox-requirements.txt) from .nox-bootstrap/, which is made on first
# use from python3 (or PYTHON); the README's two commands run through it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
boot=$root/.nox-bootstrap
want=$(cat "$root/scripts/nox-requirements.txt")
if [ "$(cat "$boot/.requirements" 2>/dev/null)" != "$want" ]; then
  rm -rf "$boot"
  "${PYTHON:-python3}" -m venv "$boot"
  "$boot/bin/python" -m pip install -q --disable-pip-version-check -r "$root/scripts/nox-requirements.txt"
  echo "$want" > "$boot/.requirements"
fi
cd "$root"
exec "$boot/bin/nox" "$@"
