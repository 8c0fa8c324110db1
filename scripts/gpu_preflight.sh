#!/usr/bin/env bash
# Preflight of the H200 run on the device's JAX, on the CPU: finds an API move (a
# deprecation, a lowering that needs a device) here, not in the GPU window.
#
#   bash scripts/gpu_preflight.sh              # jax 0.11.2 (the device's) and 0.12.0.1
#   bash scripts/gpu_preflight.sh 0.11.2       # one version
#
# Per version, a Python 3.12 venv (the device's Python) outside the repository,
# $PREFLIGHT_VENVS/venv312-VERSION (default /tmp), with what the device has: jax and
# jaxlib of that version (CPU), triton 3.6, pytest, tokenizers, safetensors,
# transformers (4.x), flax; plus torch for Triton's interpreter; none of openai, jsonschema,
# pydantic, fastapi, llguidance (removed if a dependency brought one). The .whl/ wheels (scripts/gpu_wheels.sh) are installed
# the way gpu_check.sh installs them on the device. Then, with JAX_PLATFORMS=cpu:
#   1. the CUDA-lowering tests, the Mosaic GPU lowering and the Triton interpreter tests
#      (tests/test_gpu_lowering*.py, tests/test_kernels_triton*.py), our own modules'
#      deprecation warnings made errors; a test may skip only for want of a GPU;
#   2. the device script itself: bash scripts/gpu_check.sh --cpu-smoke (every task).
# Exit 0 when every version passed. The first run downloads ~3 GB per venv (torch).
# The default test suite stays on the machine's own Python; this is a separate check.
set -uo pipefail
# (one function, parsed whole before it runs: editing the file mid-run is harmless)
main() {
  cd "$(dirname "$0")/.."
  if (($#)); then versions=("$@"); else versions=(0.11.2 0.12.0.1); fi
  venvs="${PREFLIGHT_VENVS:-/tmp}"
  results="${PREFLIGHT_OUT:-$venvs/arcjax-preflight}"
  mkdir -p "$results"

  python312() {
    if [[ -n "${PREFLIGHT_PYTHON:-}" ]]; then "$PREFLIGHT_PYTHON" "$@"
    elif python3.12 -V > /dev/null 2>&1; then python3.12 "$@"
    else PYENV_VERSION=3.12.1 python3.12 "$@"; fi
  }

  if ! compgen -G ".whl/*.whl" > /dev/null; then
    bash scripts/gpu_wheels.sh || echo "preflight: no .whl/ wheels; running without them"
  fi

  TESTS=(tests/test_gpu_lowering.py tests/test_gpu_lowering_mosaic.py
         tests/test_kernels_triton.py tests/test_kernels_triton_replay.py)
  failed=()
  for v in "${versions[@]}"; do
    venv="$venvs/venv312-$v"
    echo "== preflight jax $v in $venv"
    if [[ ! -x "$venv/bin/python" ]]; then
      python312 -m venv "$venv" || { failed+=("$v: no Python 3.12 venv"); continue; }
    fi
    py="$venv/bin/python"
    # transformers < 5: 5.x brings typer and with it pydantic, which the device lacks;
    # flax (and optax, which it brings) as the device has them: the model's layers need it
    if ! "$py" -m pip install -q "jax==$v" "jaxlib==$v" numpy absl-py pytest tokenizers \
        safetensors "transformers<5" "triton==3.6.0" "torch==2.10.0" flax; then
      failed+=("$v: pip install"); continue
    fi
    for pkg in openai jsonschema pydantic fastapi llguidance; do  # not on the device
      if "$py" -m pip show "$pkg" > /dev/null 2>&1; then
        echo "preflight: removing $pkg (the device lacks it)"
        "$py" -m pip uninstall -q -y "$pkg"
      fi
    done
    site="$venv/whl-site"
    rm -rf "$site"
    if compgen -G ".whl/*.whl" > /dev/null; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    fi
    junit="$results/pytest-$v.xml"
    PYTHONPATH="$PWD:$site" JAX_PLATFORMS=cpu "$py" -m pytest -q -p no:cacheprovider -rs \
      -o "filterwarnings=error::DeprecationWarning:pallas_kernels" \
      --junitxml="$junit" "${TESTS[@]}"
    rc=$?
    "$py" scripts/gpu_report.py "$junit" "needs an NVIDIA GPU" || rc=1
    ((rc == 0)) || failed+=("$v: tests")
    PYTHON="$py" bash scripts/gpu_check.sh --out "$results/smoke-$v" \
      --cpu-smoke || failed+=("$v: gpu_check.sh --cpu-smoke")
  done
  if ((${#failed[@]})); then
    printf 'preflight FAILED: %s\n' "${failed[@]}"
    exit 1
  fi
  echo "preflight passed: jax ${versions[*]}"
}
main "$@"
exit $?
