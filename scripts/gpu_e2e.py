"""End-to-end task of `scripts/gpu_check.py` (run by gpu_child.py): the engine serving.

  1. A Llama-3-8B-shaped model (bf16, 32 layers, 32:8 heads, D=128, vocab 128,256) with
     random weights is built on the device (`init_params`; no checkpoint on disk), with an
     engine over it (`ModelRunner` + `Engine`, the packaged engine code, attention "auto").
     `--cpu_smoke` uses a tiny model of the same family.
  2. Offline throughput: N prompts of P tokens, M new tokens each (greedy, EOS ignored),
     under token_budget 2048.
  3. One arm of the seed's burst (K=128 users, 380-token prompts, 64 new tokens):
     token_budget 2048 in a 60 s window: TTFT p50/p90/max, users with a first token in
     the window, longest decode stall (`arcjax.bench.burst`).

Each part is budget-checked before it starts (the task's deadline; a burst window that
no longer fits shrinks to what is left, and says so) and its row is written as it
finishes, with the attention implementation its steps ran per bucket kind and whether a
recorded GPU pass vouches for it (`arcjax.engine.trace.attention_report`), not the
configured "auto". Every part warms exactly the buckets the planner says it will use,
one at a time while the budget lasts, so compiles stay out of the measurement.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gpu_child import Emitter, Task

ARM = "token_budget:budget=2048"


@dataclasses.dataclass(frozen=True, kw_only=True)
class E2EConfig:
    throughput_requests: int
    throughput_prompt: int
    throughput_new: int
    burst_users: int
    burst_prompt: int
    burst_new: int
    window_s: float
    throughput_min_s: float  # seconds left needed to start the throughput part
    burst_min_s: float  # ... and the burst (beyond its window)

    @classmethod
    def make(cls, smoke: bool, window_s: float | None = None) -> "E2EConfig":
        if smoke:
            return cls(throughput_requests=4, throughput_prompt=24, throughput_new=4,
                       burst_users=4, burst_prompt=20, burst_new=3,
                       window_s=window_s or 20.0, throughput_min_s=5, burst_min_s=2)
        return cls(throughput_requests=64, throughput_prompt=512, throughput_new=64,
                   burst_users=128, burst_prompt=380, burst_new=64,
                   window_s=window_s or 60.0, throughput_min_s=60, burst_min_s=30)


def _model(smoke: bool):
    from arcjax.model.model_config import ModelConfig

    if smoke:
        return ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=16,
                           max_position_embeddings=512)
    return ModelConfig(vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                       num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                       rope_theta=500_000.0, max_position_embeddings=8192)


def _warm(engine, config, requests, task: Task, reserve_s: float) -> tuple[float, int, int]:
    """Compiles the buckets the planner says `requests` under `config` select, one at a
    time while more than `reserve_s` is left. Returns (seconds, compiled, needed)."""
    from arcjax.bench import burst

    needed = sorted(burst.planned_buckets(engine.runner.buckets, config, requests))
    start, done = time.perf_counter(), 0
    for bucket in needed:
        if task.seconds_left() < reserve_s:
            break
        engine.runner.warm([bucket])
        done += 1
    return time.perf_counter() - start, done, len(needed)


def _attention(engine, records) -> dict:
    from arcjax.engine.trace import attention_report

    runner = engine.runner
    report = attention_report(runner.attn_impl, dict(runner.attention_impls), records,
                              dict(runner.attention_verified))
    return {k: report[k] for k in ("configured", "decode", "prefill", "verified")}


def run(task: Task, emit: Emitter) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import scheduler
    from arcjax.bench import burst
    from arcjax.engine.engine import Engine
    from arcjax.model.specs import init_params
    from arcjax.runtime.buckets import BucketSet
    from arcjax.runtime.executable_cache import ExecutableCache
    from arcjax.runtime.runner import ModelRunner
    from arcjax.sampling_params import SamplingParams

    cfg = E2EConfig.make(task.smoke, task.params.get("window_s"))
    model = _model(task.smoke)
    emit.start("model")
    rng = np.random.RandomState(0)
    params = init_params(model, jax.random.key(0), dtype=jnp.bfloat16)
    jax.block_until_ready(params)
    users, plen, new = cfg.burst_users, cfg.burst_prompt, cfg.burst_new
    max_len = -(-(max(plen, cfg.throughput_prompt) + max(new, cfg.throughput_new)) // 16) * 16
    seqs = max(users, cfg.throughput_requests)
    base = scheduler.SchedulerConfig(policy="token_budget", max_num_batched_tokens=2048,
                                     max_num_seqs=seqs, chunk_tile=128, block_size=16,
                                     num_blocks=seqs * (max_len // 16) + 16,
                                     enable_prefix_caching=False)
    buckets = BucketSet.create(tile=base.chunk_tile, max_tokens=max(2048, max_len),
                               max_seqs=base.max_num_seqs)
    runner = ModelRunner(model, params, num_blocks=base.num_blocks, block_size=base.block_size,
                         max_blocks_per_seq=max_len // base.block_size, buckets=buckets,
                         dtype=jnp.bfloat16, attn_impl="auto", executables=ExecutableCache())
    engine = Engine(runner, None, base, max_model_len=max_len)
    info = dict(params=int(sum(x.size for x in jax.tree.leaves(params))),
                model=dataclasses.asdict(model))

    # (a) offline throughput under token_budget 2048
    prompts = [rng.randint(3, model.vocab_size, cfg.throughput_prompt).tolist()
               for _ in range(cfg.throughput_requests)]
    row = dict(part="throughput", requests=len(prompts), prompt=cfg.throughput_prompt,
               new=cfg.throughput_new)
    if task.seconds_left() < cfg.throughput_min_s:
        emit.row(row | dict(skipped=f"{task.seconds_left():.0f} s left, needs "
                                    f"{cfg.throughput_min_s:.0f}"))
    else:
        emit.start("throughput")
        reqs = tuple(scheduler.Request(request_id=str(i), prompt_token_ids=tuple(p),
                                       max_tokens=cfg.throughput_new)
                     for i, p in enumerate(prompts))
        warm_s, done, needed = _warm(engine, base, reqs, task, reserve_s=cfg.throughput_min_s / 3)
        if done < needed:
            emit.row(row | dict(skipped=f"time budget: {done} of {needed} buckets compiled "
                                        f"in {warm_s:.0f} s", warmup_s=warm_s))
        else:
            tp = Engine(engine.runner, None, base, max_model_len=max_len)
            greedy = SamplingParams(max_tokens=cfg.throughput_new, temperature=0, ignore_eos=True)
            t0 = time.perf_counter()
            for p in prompts:
                tp.add_request(p, greedy, sink=lambda out: None)
            while tp.has_unfinished():
                tp.run_step()
            wall = time.perf_counter() - t0
            emit.row(row | dict(warmup_s=warm_s, buckets=needed, wall_s=wall,
                                prefill_tok_s=len(prompts) * cfg.throughput_prompt / wall,
                                output_tok_s=len(prompts) * cfg.throughput_new / wall,
                                attention=_attention(tp, list(tp.trace))))

    # (b) the burst, one token_budget arm
    burst_prompts = [rng.randint(3, model.vocab_size, plen).tolist() for _ in range(users)]
    row = dict(part="burst", arm=ARM, users=users, prompt=plen, new=new)
    if task.seconds_left() < cfg.burst_min_s + min(cfg.window_s, 10.0):
        emit.row(row | dict(skipped=f"{task.seconds_left():.0f} s left, needs "
                                    f"{cfg.burst_min_s + min(cfg.window_s, 10.0):.0f}"))
        return info
    emit.start("burst")
    arm = scheduler.parse_arm(ARM)
    requests = tuple(scheduler.Request(request_id=str(i), prompt_token_ids=tuple(p),
                                       max_tokens=new) for i, p in enumerate(burst_prompts))
    warm_s, done, needed = _warm(engine, arm.config(base), requests, task,
                                 reserve_s=cfg.burst_min_s / 2 + 5)
    window = min(cfg.window_s, task.seconds_left() - 5)
    if done < needed or window < 1:
        emit.row(row | dict(skipped=f"time budget: {done} of {needed} buckets compiled in "
                                    f"{warm_s:.0f} s, {window:.0f} s left for the window",
                            warmup_s=warm_s))
        return info
    run_, arm_engine = burst.run_arm(engine, arm, base, burst_prompts, new, window)
    m = burst.burst_metrics(run_)
    emit.row(row | dict(warmup_s=warm_s, buckets=needed, window_s=window,
                        window_shrunk=window < cfg.window_s,
                        ttft_p50_s=m["ttft_p50_s"], ttft_p90_s=m["ttft_p90_s"],
                        ttft_max_s=m["ttft_max_s"],
                        users_with_first_token=m["users_with_first_token"],
                        users_first_token_within_2s=sum(t <= 2.0 for t in m["ttft_s"]),
                        max_stall_s=m["max_stall_s"], tokens_per_s=m["tokens_per_s"],
                        attention=_attention(arm_engine, list(arm_engine.trace))))
    return info
