#!/usr/bin/env bash
# GPU readiness: on a machine with a CUDA GPU, run every CUDA-gated test and the GPU example pairs, then
# print a short summary. One command; about 2-4 minutes of tests (limit 8), plus the first setup.
#
#   bash scripts/gpu-check.sh
#
# What it sets up: a virtual environment (.venv-gpu, or TORCHPERF_GPU_VENV) with torch, the plugin and its
# test dependencies. torch comes from TORCH_SPEC (default torch==2.13.0, the version CI pins); the index
# this project's CI uses may only carry the CPU build of it, which cannot use a GPU. The script checks
# that the torch it installed is a CUDA build that sees the GPU, and says what to do when it is not:
# point pip at PyTorch's CUDA wheel index for your driver (cu126, cu128, ...) with
#   TORCH_INDEX_URL=<that index> bash scripts/gpu-check.sh
# or install a CUDA build of torch into the environment yourself (the script keeps one that works).
#
# Which tests: those a CPU-only run skips because they need CUDA (a skip/skipif marker whose reason names
# CUDA or a GPU; see scripts/cuda_gated.py), in tests/ and in examples/ (the *_buggy/*_fixed pairs, which
# examples/run.py checks end as their names say).
#
# Exit status: 0 all passed, 1 a test failed or ran out of time, 2 no CUDA GPU here, 3 torch cannot use it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
start=$(date +%s)

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no CUDA GPU on this machine (nvidia-smi is missing or lists no GPU)." >&2
  echo "gpu-check: this script checks the CUDA paths on a GPU machine; on CPU run scripts/run-tests.sh." >&2
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)
driver_cuda=$(nvidia-smi | sed -n 's/.*CUDA Version: *\([0-9.]*\).*/\1/p' | head -1)
echo "gpu-check: GPU $gpu (the driver supports CUDA ${driver_cuda:-?})"

python=${PYTHON:-python3}
venv=${TORCHPERF_GPU_VENV:-$root/.venv-gpu}
spec=${TORCH_SPEC:-torch==2.13.0}
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
[ -x "$venv/bin/python" ] || bash "$root/scripts/make-venv.sh" "$python" "$venv"
probe='import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available())'
if ! "$venv/bin/python" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    "${pip[@]}" --index-url "$TORCH_INDEX_URL" "$spec"
  else
    "${pip[@]}" "$spec"
  fi
fi
"${pip[@]}" -e ".[test]"
read -r torch_version torch_cuda torch_sees_gpu < <("$venv/bin/python" -c "$probe")
if [ "$torch_cuda" = "None" ]; then
  echo "gpu-check: torch $torch_version is a CPU-only build: it cannot use the GPU." >&2
  echo "gpu-check: install a CUDA build: TORCH_INDEX_URL=<PyTorch's CUDA wheel index for CUDA <= ${driver_cuda:-?}> bash $0" >&2
  exit 3
fi
if [ "$torch_sees_gpu" != "True" ]; then
  echo "gpu-check: torch $torch_version (built for CUDA $torch_cuda) does not see the GPU; the driver supports CUDA ${driver_cuda:-?}." >&2
  echo "gpu-check: a build for a newer CUDA than the driver's cannot run: pick the wheel index of an older CUDA (TORCH_INDEX_URL)." >&2
  exit 3
fi
echo "gpu-check: torch $torch_version, CUDA $torch_cuda"

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
export PYTHONPATH="$root/scripts${PYTHONPATH:+:$PYTHONPATH}"
status=0
echo; echo "=== CUDA-gated tests"
timeout 300 "$venv/bin/python" -m pytest -p no:cacheprovider -p cuda_gated --cuda-gated -q -rs \
  --junitxml="$out/tests.xml" tests || status=$?
[ "$status" -eq 5 ] && { echo "gpu-check: no CUDA-gated test was collected" >&2; status=1; }
echo; echo "=== GPU example pairs (each *_buggy must fail with a report, each *_fixed pass)"
examples=0
suites=()
for suite in examples/*/; do  # the seed bug needs pytorch-lightning 1.5 (scripts/run-examples.sh) and no GPU
  [ "$suite" = "examples/seed_bug/" ] || suites+=("$suite")
done
timeout 180 "$venv/bin/python" examples/run.py --expect by-name "${suites[@]}" -- -p cuda_gated --cuda-gated \
  -p no:warnings > >(tee "$out/examples.txt") 2>&1 || examples=$?
[ "$examples" -ne 0 ] && status=1

echo; echo "=== gpu-check summary"
"$venv/bin/python" - "$out/tests.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
try:
    cases = list(ET.parse(sys.argv[1]).getroot().iter("testcase"))
except (OSError, ET.ParseError):
    print("tests: no report (pytest did not finish)"); sys.exit()
def outcome(case):
    for tag in ("failure", "error", "skipped"):
        if case.find(tag) is not None:
            return tag
    return "passed"
counts = {}
for case in cases:
    counts.setdefault(outcome(case), []).append(f"{case.get('classname')}::{case.get('name')}")
print("tests: " + ", ".join(f"{len(v)} {k}" for k, v in sorted(counts.items())) + f" of {len(cases)} CUDA-gated")
for kind in ("failure", "error", "skipped"):
    for name in counts.get(kind, []):
        print(f"  {kind}: {name}")
PY
tail -1 "$out/examples.txt" | sed 's/^/examples: /'
echo "gpu: $gpu; torch $torch_version (CUDA $torch_cuda); $(( $(date +%s) - start )) s in all"
[ "$status" -eq 0 ] && echo "gpu-check: OK" || echo "gpu-check: FAILED"
exit "$status"
