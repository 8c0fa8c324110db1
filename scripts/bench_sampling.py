"""Cost of the sampling features on a decode step: greedy vs every feature on.

A batch of `rows` requests (short prompts) decodes `steps` tokens each, once greedy and once
with every sampling feature on (temperature, top-k, top-p, min-p, presence/frequency/
repetition penalties, min_tokens, logprobs=5, a seed), alternating arms for `rounds` rounds
in one process on one engine (the same compiled executables). The figure is the median
wall time of full decode steps (every row decoding, the trace's start..end: plan, host
packing, the device step, reading tokens and logprobs, appending) per arm.

  taskset -c 0 python scripts/bench_sampling.py --out=runs/sampling.json
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys

from absl import app

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from arcjax.entrypoints.flags import config_from_flags, define_flags  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingBenchConfig:
    model: str = ""  # "" = the packaged default model
    rows: int = 64
    prompt_tokens: int = 8
    steps: int = 48
    rounds: int = 3
    compilation_cache_dir: str = ""
    out: str = ""


def _arm(llm, params, cfg) -> list[float]:
    """Decode-step durations (ms) of one generate call of `rows` requests."""
    start = llm.engine.num_steps
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(cfg.prompt_tokens)]
               for i in range(cfg.rows)]
    llm.generate(prompts, params, use_tqdm=False)
    recs = list(llm.engine.trace)[-(llm.engine.num_steps - start):]
    return [1e3 * (r.end - r.start) for r in recs
            if r.prefill_tokens == 0 and r.decode_tokens == cfg.rows]


def main(argv):
    del argv
    cfg = config_from_flags(SamplingBenchConfig)
    import arcjax
    from arcjax import SamplingParams
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    if cfg.compilation_cache_dir:
        enable_persistent_compilation_cache(cfg.compilation_cache_dir)
    llm = arcjax.LLM(cfg.model or None, max_num_seqs=cfg.rows,
                     max_model_len=cfg.prompt_tokens + cfg.steps + 8)
    arms = {
        "greedy": SamplingParams(max_tokens=cfg.steps, temperature=0, ignore_eos=True),
        "all_features": SamplingParams(
            max_tokens=cfg.steps, temperature=0.8, top_k=50, top_p=0.9, min_p=0.02,
            presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
            min_tokens=cfg.steps // 2, logprobs=5, seed=1),
    }
    for p in arms.values():  # warm the buckets the arms use (compiles out of the figures)
        _arm(llm, dataclasses.replace(p, max_tokens=2, min_tokens=0), cfg)
    times = {name: [] for name in arms}
    for _ in range(cfg.rounds):
        for name, p in arms.items():
            times[name] += _arm(llm, p, cfg)
    med = {name: statistics.median(t) for name, t in times.items()}
    result = {
        "config": dataclasses.asdict(cfg), "platform": platform.platform(),
        "vocab_size": llm.config.vocab_size,
        "decode_step_ms_median": med, "decode_steps": {k: len(v) for k, v in times.items()},
        "overhead_pct": 100 * (med["all_features"] / med["greedy"] - 1),
    }
    print(json.dumps(result, indent=2))
    if cfg.out:
        os.makedirs(os.path.dirname(cfg.out) or ".", exist_ok=True)
        with open(cfg.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    define_flags(SamplingBenchConfig)
    app.run(main)
