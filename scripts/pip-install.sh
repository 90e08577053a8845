#!/usr/bin/env bash
# pip-install.sh PYTHON ARGS...: `PYTHON -m pip install ARGS`, as the scripts install every environment:
# quietly, and with --no-compile. Compiling every file of an environment (40,000 in all, most of them
# never imported) was about a third of each install's CPU time; instead the first process that imports a
# module writes its bytecode cache, so the scripts unset PYTHONDONTWRITEBYTECODE.
set -euo pipefail
exec "$1" -m pip install -q --disable-pip-version-check --no-compile "${@:2}"
