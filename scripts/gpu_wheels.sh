#!/usr/bin/env bash
# Downloads the pure-Python wheels the H200 image lacks into .whl/ (git-ignored), on a
# machine that reaches the package registry. scripts/gpu_check.sh installs them on the
# device (pip --no-index --no-deps --target, nothing else touched); the device command
# carries .whl/ with the working tree (its header says how).
#
#   bash scripts/gpu_wheels.sh            # into .whl/
#   WHEEL_DIR=/tmp/w bash scripts/gpu_wheels.sh
#
# What and why (the image: Python 3.12, jax 0.11.2, triton 3.6, pytest, no jax_triton,
# no hypothesis):
#   jax-triton 0.3.1     impl="triton" launches through it; 0.3.1 pairs with Triton 3.6 and
#                        jax >= 0.8.2 (0.4.x needs Triton >= 3.7)
#   hypothesis           tests/conftest.py and the GPU test modules import it
#   sortedcontainers     hypothesis' one dependency
# Only pure-Python wheels (py3-none-any): they install on any CPU architecture and Python.
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${WHEEL_DIR:-.whl}"
python="${PYTHON:-python3}"
mkdir -p "$dir"
"$python" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation py --abi none --platform any -d "$dir" \
  "jax-triton==0.3.1" "hypothesis>=6.100" "sortedcontainers>=2.1"
echo "gpu_wheels: $(cd "$dir" && ls -1 *.whl | tr '\n' ' ')in $dir/"
