#!/usr/bin/env bash
# torch-layer.sh ENV: give the virtual environment ENV torch 2.13.0 (CPU) from one shared install
# instead of a copy of its own (about 760 MB and a minute or more of unpacking each): the layer
# .torchperf-envs/torch-2.13.0-pyX.Y/site-packages is built once per Python version with
# `pip install --target`, and ENV sees it through a .pth file, after its own site-packages. pip in
# ENV counts the layer's torch as installed, so `pip install torch==2.13.0 ...` there downloads no
# torch; a package ENV installs itself shadows the layer's copy. check-torch.sh then checks ENV.
#   TORCHPERF_TORCH_LAYER  where the layers live (default: .torchperf-envs/ in the repo)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
env=$1
dest=${TORCHPERF_TORCH_LAYER:-$root/.torchperf-envs}
version=$("$env/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
layer="$dest/torch-2.13.0-py$version/site-packages"  # named so: frames there are a library's
mkdir -p "$dest"
# Environments are built side by side (legacy-envs.sh, compat-envs.sh): one builds the layer, the others wait.
exec 9>"$dest/.torch-layer-py$version.lock"
flock 9
if [ ! -f "$layer/.torchperf-complete" ]; then
  echo "torch-layer: building $layer"
  rm -rf "$layer"
  mkdir -p "$layer"
  bash "$root/scripts/pip-install.sh" "$env/bin/python" --target "$layer" torch==2.13.0
  touch "$layer/.torchperf-complete"
fi
# Byte-compiled once, by importing what the suite's processes import (torch, TorchDynamo and
# torch.distributed, as Lightning does: about 1,500 of the layer's 5,000 modules, 10 CPU-seconds; all of
# them took 28): a process never writes the layer's .pyc files where PYTHONDONTWRITEBYTECODE is set (as
# on many CI machines), and then each one that imports torch compiles it again (4-6 s a process; the
# suite starts hundreds). The scripts unset it, so the first process that imports another module of the
# layer (torch._inductor, for torch.compile) writes its cache.
if [ ! -f "$layer/.torchperf-compiled" ]; then
  env -u PYTHONDONTWRITEBYTECODE PYTHONPATH="$layer" "$env/bin/python" -W ignore -c \
    "import torch, torch._dynamo, torch.distributed.fsdp, torch.distributed.tensor, torch.utils.data"
  touch "$layer/.torchperf-compiled"
fi
site=$("$env/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$layer" > "$site/torchperf-torch-layer.pth"
