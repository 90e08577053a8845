#!/usr/bin/env bash
# check-torch.sh PYTHON: fail loudly unless that environment has torch 2.13.0 (CPU) and no CUDA
# packages, so that no set-up silently falls back to another torch and its multi-GB CUDA build.
set -euo pipefail
"$1" - <<'PY'
import importlib.metadata as md, sys
torch = md.version("torch")
cuda = sorted(d.metadata["Name"] for d in md.distributions()
              if (d.metadata["Name"] or "").lower().startswith(("nvidia-", "triton")))
if not torch.startswith("2.13.0") or cuda:
    sys.exit(f"check-torch: {sys.prefix} has torch {torch} and {cuda or 'no CUDA packages'}; "
             "expected torch 2.13.0 (CPU) and no CUDA packages: a requirement made pip resolve another torch")
PY
