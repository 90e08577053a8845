#!/usr/bin/env bash
# The package as users get it: `python -m build` makes an sdist and a wheel, each is installed
# into a fresh virtual environment (with torch 2.13.0, the CPU wheel) and must pass
# scripts/smoke_test.py, run from outside the repository.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# A new .venv gets torch from the shared layer (scripts/torch-layer.sh): one copy for every environment.
[ -x .venv/bin/python ] || { bash scripts/make-venv.sh "$python" .venv && bash scripts/torch-layer.sh .venv; }
bash scripts/pip-install.sh .venv/bin/python build  # the CI/test path only
# Under the lock of builds from the working tree (side environments may be built meanwhile: legacy-envs.sh).
if ! bash "$root/scripts/tree-build.sh" \
    .venv/bin/python -m build --outdir "$work/dist" "$root" >"$work/build.log" 2>&1; then
  cat "$work/build.log"
  exit 1
fi
wheel=$(ls "$work"/dist/*.whl)
sdist=$(ls "$work"/dist/*.tar.gz)
echo "check-package: built $(basename "$sdist") and $(basename "$wheel")"
bash scripts/make-venv.sh "$python" "$work/venv"
bash "$root/scripts/torch-layer.sh" "$work/venv"  # torch 2.13.0 CPU, shared: the package is what is checked
pip=(bash "$root/scripts/pip-install.sh" "$work/venv/bin/python")
# torch pinned: the package asks for torch>=2.1, and only this version's CPU wheel is wanted here.
"${pip[@]}" torch==2.13.0 "$wheel"
bash "$root/scripts/check-torch.sh" "$work/venv/bin/python"
(cd "$work" && "$work/venv/bin/python" "$root/scripts/smoke_test.py" wheel)
"${pip[@]}" --force-reinstall --no-deps "$sdist"
(cd "$work" && "$work/venv/bin/python" "$root/scripts/smoke_test.py" sdist)
