"""Prefix caching on and off, side by side in one run, on two workloads:

  (a) shared system prompt: N requests arrive at once, each a S-token shared prefix plus U
      unique tokens (the issue's case: 256 x (1,024 + 64));
  (b) multi-turn chat: C conversations of T turns; each turn resends the whole history
      (previous prompt + the model's answer) plus U new tokens.

Both engines use the same model, geometry and compiled executables (warmed first, outside the
measurement). Reports TTFT p50/p90, output throughput and the prefix-cache hit rate (cached
prompt tokens over the shared tokens that could be reused, and over all prompt tokens), and
checks that greedy outputs are identical with caching on and off.

  python scripts/bench_prefix.py --out=runs/prefix.json
  python scripts/bench_prefix.py --num_requests=32 --shared_tokens=256   # a quick look
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import time

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.entrypoints.flags import config_from_flags, define_flags  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class PrefixBenchConfig:
    model: str = ""  # "" = the packaged default model
    num_requests: int = 256
    shared_tokens: int = 1024
    unique_tokens: int = 64
    max_new_tokens: int = 16
    conversations: int = 16
    turns: int = 4
    turn_tokens: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    policy: str = "token_budget"
    num_kv_blocks: int = 0  # 0 = the engine's default
    seed: int = 0
    out: str = ""


def _percentile(xs, q):
    xs = sorted(xs)
    if not xs:
        return None
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def _measure(llm, prompts, params) -> tuple[dict, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    ttft = [o.metrics.ttft for o in outs]
    tokens = sum(len(o.token_ids) for o in outs)
    cached = sum(o.num_cached_tokens for o in outs)
    prompt_tokens = sum(len(p) for p in prompts)
    return {"requests": len(outs), "wall_s": wall, "ttft_p50_s": _percentile(ttft, 50),
            "ttft_p90_s": _percentile(ttft, 90), "output_tok_s": tokens / wall,
            "cached_tokens": cached, "prompt_tokens": prompt_tokens,
            "hit_rate_of_prompt_tokens": cached / prompt_tokens}, outs


def shared_prompt_workload(cfg, vocab, rs) -> list[list[int]]:
    shared = rs.randint(3, vocab, cfg.shared_tokens).tolist()
    return [shared + rs.randint(3, vocab, cfg.unique_tokens).tolist()
            for _ in range(cfg.num_requests)]


def run(cfg: PrefixBenchConfig) -> dict:
    import numpy as np

    import arcjax

    rs = np.random.RandomState(cfg.seed)
    max_len = max(cfg.shared_tokens + cfg.unique_tokens,
                  cfg.turns * (cfg.turn_tokens + cfg.max_new_tokens)) + cfg.max_new_tokens
    options = dict(max_model_len=max_len, max_num_seqs=cfg.max_num_seqs,
                   max_num_batched_tokens=cfg.max_num_batched_tokens, policy=cfg.policy,
                   num_kv_blocks=cfg.num_kv_blocks or None)
    engines = {mode: arcjax.LLM(cfg.model or None, enable_prefix_caching=mode == "on",
                                **options) for mode in ("off", "on")}
    vocab = engines["on"].config.vocab_size
    params = arcjax.SamplingParams(max_tokens=cfg.max_new_tokens, temperature=0, ignore_eos=True)
    warm = shared_prompt_workload(dataclasses.replace(cfg, num_requests=4), vocab, rs)
    for llm in engines.values():  # compile outside the measurement (executables are shared)
        llm.generate(warm, params, use_tqdm=False)
        llm.generate([w[:cfg.turn_tokens] for w in warm], params, use_tqdm=False)

    result = {"config": dataclasses.asdict(cfg), "hardware": {
        "platform": platform.platform(), "cpu_count": os.cpu_count()}}
    prompts = shared_prompt_workload(cfg, vocab, rs)
    shared_reusable = (cfg.num_requests - 1) * cfg.shared_tokens
    a, outs = {}, {}
    for mode, llm in engines.items():
        a[mode], outs[mode] = _measure(llm, prompts, params)
        a[mode]["hit_rate_of_shared_tokens"] = a[mode]["cached_tokens"] / shared_reusable
    a["identical_outputs"] = all(x.token_ids == y.token_ids
                                 for x, y in zip(outs["on"], outs["off"]))
    a["ttft_p50_ratio_on_over_off"] = a["on"]["ttft_p50_s"] / a["off"]["ttft_p50_s"]
    result["shared_prompt"] = a

    chats = {mode: [rs.randint(3, vocab, cfg.turn_tokens).tolist()
                    for _ in range(cfg.conversations)] for mode in ("off", "on")}
    chats["on"] = [list(c) for c in chats["off"]]
    b = {mode: {"turns": []} for mode in engines}
    new_turns = [[rs.randint(3, vocab, cfg.turn_tokens).tolist() for _ in range(cfg.conversations)]
                 for _ in range(cfg.turns)]
    identical = True
    for turn in range(cfg.turns):
        turn_outs = {}
        for mode, llm in engines.items():
            stats, turn_outs[mode] = _measure(llm, chats[mode], params)
            b[mode]["turns"].append(stats)
            chats[mode] = [c + list(o.token_ids) + new_turns[turn][i]
                           for i, (c, o) in enumerate(zip(chats[mode], turn_outs[mode]))]
        identical &= all(x.token_ids == y.token_ids for x, y in zip(turn_outs["on"],
                                                                   turn_outs["off"]))
    for mode in engines:
        turns = b[mode]["turns"]
        b[mode]["ttft_p50_s"] = statistics.median(t["ttft_p50_s"] for t in turns[1:] or turns)
        b[mode]["hit_rate_of_prompt_tokens"] = (sum(t["cached_tokens"] for t in turns)
                                                / sum(t["prompt_tokens"] for t in turns))
        b[mode]["output_tok_s"] = (sum(t["requests"] * cfg.max_new_tokens for t in turns)
                                   / sum(t["wall_s"] for t in turns))
    b["identical_outputs"] = identical
    result["multi_turn"] = b
    return result


def main(argv):
    del argv
    cfg = config_from_flags(PrefixBenchConfig)
    res = run(cfg)
    a, b = res["shared_prompt"], res["multi_turn"]
    print(f"(a) {cfg.num_requests} x ({cfg.shared_tokens} shared + {cfg.unique_tokens} unique) "
          f"tokens, {cfg.max_new_tokens} new each; policy {cfg.policy}, max_num_seqs "
          f"{cfg.max_num_seqs}")
    for mode in ("off", "on"):
        m = a[mode]
        print(f"  caching {mode:3}: TTFT p50 {m['ttft_p50_s']:.2f} s, p90 {m['ttft_p90_s']:.2f} s, "
              f"{m['output_tok_s']:.0f} tok/s, hit rate {100 * m['hit_rate_of_shared_tokens']:.1f}% "
              f"of shared tokens")
    print(f"  TTFT p50 on/off: {a['ttft_p50_ratio_on_over_off']:.3f}; identical outputs: "
          f"{a['identical_outputs']}")
    print(f"(b) {cfg.conversations} conversations x {cfg.turns} turns of {cfg.turn_tokens} tokens")
    for mode in ("off", "on"):
        m = b[mode]
        print(f"  caching {mode:3}: TTFT p50 (turns 2+) {m['ttft_p50_s']:.3f} s, "
              f"{m['output_tok_s']:.0f} tok/s, hit rate {100 * m['hit_rate_of_prompt_tokens']:.1f}% "
              f"of prompt tokens")
    print(f"  identical outputs: {b['identical_outputs']}")
    if cfg.out:
        with open(cfg.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    define_flags(PrefixBenchConfig)
    app.run(main)
