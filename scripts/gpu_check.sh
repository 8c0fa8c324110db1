#!/usr/bin/env bash
# One command for the H200 machine as it is: its python3, no installs, PYTHONPATH=.
#
#   scripts/gpu_check.sh --out DIR [--cpu-smoke] [--budget_s=450]
#
# Writes DIR/gpu_check.json and DIR/gpu_check.md (environment, pytest -m gpu, kernel
# correctness against the oracle, the kernel table; see scripts/gpu_check.py). The
# whole run is capped at 8 minutes; sections finished before a cap stay written.
# --cpu-smoke: the same code paths with tiny shapes on the CPU (interpret mode).
#
# The Triton kernel (impl="triton") launches through jax-triton, which the H200 image does
# not ship. Put its wheel (and any other missing pure-Python wheel) in .whl/ at the repo
# root and it is installed into a scratch directory first, nothing else touched:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     -d .whl jax-triton==0.3.1
# (jax-triton 0.3.1 pairs with the image's Triton 3.6; 0.4.x needs Triton >= 3.7.)
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" > /dev/null; then
  site="$(mktemp -d)"
  "${PYTHON:-python3}" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
  export PYTHONPATH="$PYTHONPATH:$site"
fi
args=()
while (($#)); do
  case "$1" in
    --cpu-smoke) args+=(--cpu_smoke) ;;
    --out) args+=("--out=$2"); shift ;;
    *) args+=("$1") ;;
  esac
  shift
done
exec timeout --kill-after=10 480 "${PYTHON:-python3}" scripts/gpu_check.py "${args[@]}"
