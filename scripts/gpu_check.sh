#!/usr/bin/env bash
# One command for the H200 machine as it is: its python3, no installs, PYTHONPATH=.
#
#   scripts/gpu_check.sh --out DIR [--cpu-smoke] [--budget_s=450]
#
# Writes DIR/gpu_check.json and DIR/gpu_check.md (environment, pytest -m gpu, kernel
# correctness against the oracle, the kernel table; see scripts/gpu_check.py). The
# whole run is capped at 8 minutes; sections finished before a cap stay written.
# --cpu-smoke: the same code paths with tiny shapes on the CPU (interpret mode).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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
