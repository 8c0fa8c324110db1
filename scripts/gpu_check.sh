#!/usr/bin/env bash
# One command for an H200 window: verifies every GPU kernel against the oracle, times them
# against the machine's own ceilings, serves a burst, and leaves everything in one folder.
#
# The device command (the machine's own python3: jax 0.11.2, triton 3.6, pytest; no
# jax-triton, no hypothesis): the working tree with .whl/ carried along (fill it first,
# where the package registry is reachable: bash scripts/gpu_wheels.sh), a 600 s limit,
# and OUT a folder that comes back:
#
#     bash scripts/gpu_check.sh --out "$OUT"
#
# It writes $OUT/gpu_check.json and .md after every task, $OUT/rows/*.jsonl (each task's
# rows as they finish), $OUT/log (everything printed), $OUT/verified_kernels.json (the
# GPU passes: append its records to the list in pallas_kernels/verified_kernels.json and
# commit them, so every installation trusts what passed) and $OUT/pytest_gpu.xml. The last lines printed are the summary table. Exit 0: every
# section passed; 1: some failed; 124: the outer limit cut the run (what finished is
# written).
#
#     bash scripts/gpu_check.sh --out /tmp/smoke --cpu-smoke   # the same code paths on
#                                     # the CPU: tiny shapes, kernels interpreted
#
# Expected seconds on the H200, stage by stage, against the 600 s command limit (each
# task is its own process; ~5-8 s of each is python + jax import + CUDA init):
#
#   stage                                           expected   cap
#   wheels install, start                                  5     -
#   environment (nvidia-smi, JAX sees the GPU)            12    60
#   correctness pallas_gpu (10 cases + oracle)            45    90
#   correctness triton (10 cases)                         45    90
#   correctness mosaic_gpu (2 decode cases)               25    90
#   kernel_table ceilings (8192^3 matmul, 2 GiB copy)     12    45
#   kernel_table pallas_gpu (6 cases)                     35    75
#   kernel_table triton (6 cases)                         35    75
#   kernel_table mosaic_gpu (3 decode cases)              20    75
#   kernel_table cudnn (2 prefill cases)                  15    45
#   kernel_table moe (ragged_dot, tiled; 128, 2048 tok)   25    60
#   kernel_table w4a16 (3 decode shapes x 2 zero kinds;
#     the kernel vs its oracle, xla, bf16)                25    50
#   kernel_table mla (DeepSeek-V2-Lite decode, 1k/4k/16k;
#     the kernel and xla vs the float64 oracle)           15    40
#   kernel_table invariance (each kernel's probe)         20    60
#   end_to_end (8B init, warm, throughput, 60 s burst)   170   220  (reserved)
#   alt_tilings pallas_gpu, triton (what is left)      25+25    60
#   gpu_tests (pytest -m gpu, 3 files)                    50    90  (reserved, last)
#   total                                               ~605   555 budget, 585 hard stop
#   (the ~50 s over the budget come out of the alternative tilings: they run only when
#   the tasks before them finish early)
#
# A task gets min(its cap, what is left less the reserved tasks' expected time); one
# that would get less than its minimum is skipped and says so, so the run ends by
# ~555 s whatever happens (alternative tilings absorb the slack), and the outer timeout
# (585 s, inside the 600 s command limit with the wheels' install) is the last resort.
set -uo pipefail
# (one function, parsed whole before it runs: editing the file mid-run is harmless)
main() {
  cd "$(dirname "$0")/.."
  out=""
  args=()
  smoke=0
  while (($#)); do
    case "$1" in
      --cpu-smoke|--cpu_smoke) args+=(--cpu_smoke); smoke=1 ;;
      --out) out="$2"; shift ;;
      --out=*) out="${1#--out=}" ;;
      *) args+=("$1") ;;
    esac
    shift
  done
  if [[ -z "$out" ]]; then
    echo "usage: bash scripts/gpu_check.sh --out DIR [--cpu-smoke] [gpu_check.py flags]" >&2
    exit 2
  fi
  mkdir -p "$out"
  out="$(cd "$out" && pwd)"
  exec > >(tee -a "$out/log") 2>&1
  local tee_pid=$!
  export PYTHONUNBUFFERED=1
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  export ARCJAX_VERIFIED_KERNELS="${ARCJAX_VERIFIED_KERNELS:-$out/verified_kernels.json}"
  python="${PYTHON:-python3}"
  echo "gpu_check: $("$python" --version 2>&1) at $(command -v "$python"), out=$out"
  if compgen -G ".whl/*.whl" > /dev/null; then
    site="$(mktemp -d)"
    if "$python" -m pip install -q --no-index --no-deps --no-compile --target "$site" \
        .whl/*.whl; then
      export PYTHONPATH="$PYTHONPATH:$site"
      GPU_CHECK_WHEELS="$(cd .whl && ls -1 ./*.whl | sed 's|^\./||' | tr '\n' ' ')"
      export GPU_CHECK_WHEELS
      echo "gpu_check: installed from .whl/ into $site: $GPU_CHECK_WHEELS"
    else
      echo "gpu_check: pip could not install .whl/; going on without those wheels"
    fi
  else
    echo "gpu_check: no .whl/ (bash scripts/gpu_wheels.sh fills it): impl=triton needs" \
         "jax-triton, the GPU tests hypothesis; their rows say so"
  fi
  # the CPU smoke's interpreters are slow on a shared machine: its budget is 1,700 s
  if ((smoke)); then default_limit=1800; else default_limit=585; fi
  limit="${GPU_CHECK_TIMEOUT_S:-$default_limit}"
  timeout --kill-after=5 "$limit" "$python" scripts/gpu_check.py "--out=$out" "${args[@]}"
  rc=$?
  if [[ $rc -eq 124 || $rc -eq 137 ]]; then
    echo "gpu_check: cut by the ${limit} s limit; what finished is in $out/gpu_check.md"
  fi
  exec > /dev/null 2>&1  # tee sees the end of its input: the log is complete on return
  wait "$tee_pid" 2>/dev/null
  return $rc
}
main "$@"
exit $?
