#!/usr/bin/env bash
# tree-build.sh COMMAND [ARGS...]: run COMMAND holding the lock of builds from the working tree. A build
# from the tree (an editable install, a wheel, the sdist) writes the plugin's metadata and build folder
# there, and the scripts build environments side by side: one such build at a time.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$root/.torchperf-envs"
exec flock "$root/.torchperf-envs/.tree-build.lock" "$@"
