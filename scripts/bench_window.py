"""KV blocks in use over a long generation with a sliding-window model, with and without
releasing the blocks behind the window (the pure scheduler, `scheduler/window.py`).

  1. `--requests` requests of `--prompt` tokens each generate `--generate` tokens (no EOS),
     arriving together, planned by `scheduler.schedule` and committed with fake tokens: the
     block accounting is exactly the engine's (the release is a scheduler change).
  2. Twice: `sliding_window=--window` (every layer slides, as Mistral 7B v0.1 or Mixtral with
     their window) and `sliding_window=None` (what the scheduler did before: every block kept).
  3. Blocks in use after every step; the report has the peak, the mean, a sampled curve, and
     the bytes of KV at `--kv_bytes_per_block` (default: Mistral 7B, bf16, 16-token blocks:
     2 * 32 layers * 16 tokens * 8 KV heads * 128 * 2 bytes = 2 MiB).

  python scripts/bench_window.py --out=/tmp/window.json
"""

from __future__ import annotations

import dataclasses
import json
import time

from absl import app, flags

import scheduler
from scheduler import Request, SchedulerConfig, SchedulerState

_REQUESTS = flags.DEFINE_integer("requests", 8, "requests generating at once")
_PROMPT = flags.DEFINE_integer("prompt", 1024, "prompt tokens per request")
_GENERATE = flags.DEFINE_integer("generate", 16384, "tokens each request generates")
_WINDOW = flags.DEFINE_integer("window", 4096, "the model's sliding window (tokens)")
_BLOCK = flags.DEFINE_integer("block_size", 16, "tokens per KV block")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 2048, "tokens per step")
_KV_BYTES = flags.DEFINE_integer("kv_bytes_per_block", 2 * 32 * 16 * 8 * 128 * 2,
                                 "bytes of K and V per block over all layers")
_SAMPLES = flags.DEFINE_integer("samples", 64, "points of the blocks-in-use curve reported")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    requests: int
    prompt: int
    generate: int
    window: int
    block_size: int
    max_num_batched_tokens: int
    kv_bytes_per_block: int
    samples: int
    out: str | None


def _drive(c: BenchConfig, window: int | None) -> dict:
    per_request = -(-(c.prompt + c.generate) // c.block_size)
    config = SchedulerConfig(block_size=c.block_size, num_blocks=c.requests * per_request,
                             max_num_batched_tokens=c.max_num_batched_tokens,
                             max_num_seqs=c.requests, sliding_window=window)
    state = SchedulerState.empty(config)
    for i in range(c.requests):
        state = scheduler.add_request(state, Request(
            request_id=i, prompt_token_ids=tuple((i * 7 + j) % 30000 for j in range(c.prompt)),
            max_tokens=c.generate))
    in_use, steps, start = [], 0, time.perf_counter()
    while state.has_work():
        plan = scheduler.schedule(state, config)
        state, _ = scheduler.commit(plan.state, plan, [steps % 30000] * plan.num_sampled,
                                    float(steps))
        in_use.append(plan.state.pool.num_in_use)  # held while the step runs
        steps += 1
    every = max(1, len(in_use) // c.samples)
    return {"window": window, "steps": steps, "peak_blocks": max(in_use),
            "mean_blocks": sum(in_use) / len(in_use),
            "peak_gib": max(in_use) * c.kv_bytes_per_block / 2**30,
            "curve": [(s, in_use[s]) for s in range(0, len(in_use), every)],
            "scheduler_s_per_step": (time.perf_counter() - start) / steps}


def run(c: BenchConfig) -> dict:
    arms = {"release": _drive(c, c.window), "keep_all": _drive(c, None)}
    for name, r in arms.items():
        print(f"{name:9s} steps {r['steps']:6d}  peak {r['peak_blocks']:6d} blocks "
              f"({r['peak_gib']:.2f} GiB)  mean {r['mean_blocks']:.0f}  "
              f"{1e6 * r['scheduler_s_per_step']:.0f} us/step", flush=True)
    bound = c.requests * (-(-c.window // c.block_size) + 1)
    return {"config": dataclasses.asdict(c), "arms": arms,
            "peak_ratio": arms["keep_all"]["peak_blocks"] / arms["release"]["peak_blocks"],
            "window_bound_blocks": bound}


def main(argv):
    del argv
    c = BenchConfig(requests=_REQUESTS.value, prompt=_PROMPT.value, generate=_GENERATE.value,
                    window=_WINDOW.value, block_size=_BLOCK.value,
                    max_num_batched_tokens=_BUDGET.value, kv_bytes_per_block=_KV_BYTES.value,
                    samples=_SAMPLES.value, out=_OUT.value)
    out = run(c)
    if c.out:
        with open(c.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
