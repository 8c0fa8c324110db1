"""End-to-end section of `scripts/gpu_check.py`: the engine on a random-weight model.

  1. A Llama-3-8B-shaped model (bf16, 32 layers, 32:8 heads, D=128, vocab 128,256) with
     random weights is built on the device (`init_params`; no checkpoint on disk), with an
     engine over it (`ModelRunner` + `Engine`, the packaged engine code, attention "auto":
     the Pallas kernel on a GPU). `--cpu_smoke` uses a tiny model of the same family and
     attention "xla" (the kernel is covered by the correctness section in interpret mode).
  2. Offline throughput: N prompts of P tokens, M new tokens each (greedy, EOS ignored).
  3. The seed's burst (K=128 users, 380-token prompts, 64 new tokens, 140 s window) for
     token_budget vs prefill_first with and without cap 8: TTFT p50/p90/max, users with a
     first token in the window, longest decode stall (`arcjax.bench.burst`).

Every run warms exactly the buckets the planner says it will use (compiles outside the
measurement); a part is skipped, and says so, when the time left is too short.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

import scheduler
from arcjax.bench import burst
from arcjax.engine.engine import Engine
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import init_params
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.executable_cache import ExecutableCache
from arcjax.runtime.runner import ModelRunner
from arcjax.sampling_params import SamplingParams

LLAMA3_8B = ModelConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        rope_theta=500_000.0, max_position_embeddings=8192)
TINY = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512)
ARMS = ("token_budget:budget=2048", "prefill_first", "prefill_first:cap=8")


@dataclasses.dataclass(frozen=True, kw_only=True)
class E2EConfig:
    model: ModelConfig
    attention_impl: str
    throughput_requests: int
    throughput_prompt: int
    throughput_new: int
    burst_users: int
    burst_prompt: int
    burst_new: int
    window_s: float
    legacy_budget: int  # whole prompts per legacy prefill step (about ten 380-token prompts)

    @classmethod
    def make(cls, smoke: bool) -> "E2EConfig":
        if smoke:
            return cls(model=TINY, attention_impl="xla", throughput_requests=4,
                       throughput_prompt=24, throughput_new=4, burst_users=4,
                       burst_prompt=20, burst_new=3, window_s=60.0, legacy_budget=64)
        return cls(model=LLAMA3_8B, attention_impl="auto", throughput_requests=64,
                   throughput_prompt=512, throughput_new=64, burst_users=128,
                   burst_prompt=380, burst_new=64, window_s=140.0, legacy_budget=4096)


def _engine(cfg: E2EConfig, params, base: scheduler.SchedulerConfig, max_len: int) -> Engine:
    budgets = [scheduler.parse_arm(a).config(base).max_num_batched_tokens for a in ARMS]
    buckets = BucketSet.create(tile=base.chunk_tile, max_tokens=max(*budgets, max_len),
                               max_seqs=base.max_num_seqs)
    runner = ModelRunner(cfg.model, params, num_blocks=base.num_blocks,
                         block_size=base.block_size,
                         max_blocks_per_seq=-(-max_len // base.block_size), buckets=buckets,
                         dtype=jnp.bfloat16, attn_impl=cfg.attention_impl,
                         executables=ExecutableCache())
    return Engine(runner, None, base, max_model_len=max_len)


def _warm(engine: Engine, configs, requests) -> float:
    """Compiles the buckets the planner (run alone, deterministic) says these runs select."""
    needed = set()
    for config in configs:
        needed |= burst.planned_buckets(engine.runner.buckets, config, requests)
    return engine.runner.warm(needed)


def run(smoke: bool, seconds_left) -> dict:
    """The section's dict: ok, the model, rows of throughput and burst results."""
    cfg = E2EConfig.make(smoke)
    rng = np.random.RandomState(0)
    params = init_params(cfg.model, jax.random.key(0), dtype=jnp.bfloat16)
    jax.block_until_ready(params)
    n_params = sum(x.size for x in jax.tree.leaves(params))
    users, plen, new = cfg.burst_users, cfg.burst_prompt, cfg.burst_new
    max_len = -(-(max(plen, cfg.throughput_prompt) + max(new, cfg.throughput_new)) // 16) * 16
    blocks = max(users, cfg.throughput_requests) * (max_len // 16) + 16
    base = scheduler.SchedulerConfig(max_num_batched_tokens=cfg.legacy_budget,
                                     max_num_seqs=max(users, cfg.throughput_requests),
                                     chunk_tile=min(128, cfg.legacy_budget), block_size=16,
                                     num_blocks=blocks, enable_prefix_caching=False)
    engine = _engine(cfg, params, base, max_len)
    rows: list[dict] = []
    out = dict(ok=True, model=dataclasses.asdict(cfg.model), params=int(n_params),
               attention_impl=cfg.attention_impl, rows=rows)

    # (a) offline throughput under token_budget 2048
    prompts = [rng.randint(3, cfg.model.vocab_size, cfg.throughput_prompt).tolist()
               for _ in range(cfg.throughput_requests)]
    tp_config = dataclasses.replace(base, policy="token_budget",
                                    max_num_batched_tokens=min(2048, cfg.legacy_budget))
    reqs = tuple(scheduler.Request(request_id=str(i), prompt_token_ids=tuple(p),
                                   max_tokens=cfg.throughput_new) for i, p in enumerate(prompts))
    warm_s = _warm(engine, [tp_config], reqs)
    tp_engine = Engine(engine.runner, None, tp_config, max_model_len=max_len)
    params_greedy = SamplingParams(max_tokens=cfg.throughput_new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    for p in prompts:
        tp_engine.add_request(p, params_greedy, sink=lambda out: None)
    while tp_engine.has_unfinished():
        tp_engine.run_step()
    wall = time.perf_counter() - t0
    rows.append(dict(part="throughput", requests=len(prompts), prompt=cfg.throughput_prompt,
                     new=cfg.throughput_new, warmup_s=warm_s, wall_s=wall,
                     prefill_tok_s=len(prompts) * cfg.throughput_prompt / wall,
                     output_tok_s=len(prompts) * cfg.throughput_new / wall))

    # (b) the burst, one arm at a time while time is left
    burst_prompts = [rng.randint(3, cfg.model.vocab_size, plen).tolist() for _ in range(users)]
    requests = tuple(scheduler.Request(request_id=str(i), prompt_token_ids=tuple(p),
                                       max_tokens=new) for i, p in enumerate(burst_prompts))
    for spec in ARMS:
        arm = scheduler.parse_arm(spec)
        if seconds_left() < cfg.window_s + 30:
            rows.append(dict(part="burst", arm=spec, skipped="not enough time left"))
            continue
        warm_s = _warm(engine, [arm.config(base)], requests)
        run_, _ = burst.run_arm(engine, arm, base, burst_prompts, new, cfg.window_s)
        m = burst.burst_metrics(run_)
        rows.append(dict(part="burst", arm=spec, users=users, warmup_s=warm_s,
                         ttft_p50_s=m["ttft_p50_s"], ttft_p90_s=m["ttft_p90_s"],
                         ttft_max_s=m["ttft_max_s"],
                         users_with_first_token=m["users_with_first_token"],
                         users_first_token_within_2s=sum(t <= 2.0 for t in m["ttft_s"]),
                         max_stall_s=m["max_stall_s"], tokens_per_s=m["tokens_per_s"]))
    return out
