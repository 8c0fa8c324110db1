"""Prints the burst table of docs/motivation.md from the simulator: K users at once, P-token prompts.

Each --variants entry is one column: a policy, optionally with knob overrides, e.g.
  python scripts/simulate.py --users=32 --prompt_tokens=380 --max_num_batched_tokens=4096 \
      --variants=prefill_first,prefill_first:prefill_max_seqs=4,token_budget
  python scripts/simulate.py --users=128 --window_s=140 --variants=prefill_first,token_budget
  python scripts/simulate.py --users=32 --system_prompt_tokens=1024 --prompt_tokens=64 \
      --variants=token_budget    (add --noprefix_caching to compare)

The default cost model is the legacy H200 server of docs/motivation.md (CostModel's defaults); pass
--cost_json (a file holding CostModel.to_json(), e.g. one saved by
`scripts/bench_burst.py --save_cost_model`), the --c_* flags, or --calibrate_from=trace.jsonl
(an engine trace or calibration rows; fitted by arcjax.costmodel, its error printed) for
another machine.
"""

from __future__ import annotations

import dataclasses
import json

from absl import app, flags

from scheduler import Arm, SchedulerConfig, parse_arm
from scheduler.metrics import BurstSummary, format_table, summarize
from scheduler.simulate import CostModel, burst, shared_prefix_burst, simulate

_USERS = flags.DEFINE_integer("users", 32, "K: users arriving at once")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 380, "P: prompt tokens per user (256 words ~ 380)")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 64, "tokens generated per user")
_SYSTEM = flags.DEFINE_integer("system_prompt_tokens", 0, "S: a system prompt every user shares, "
                               "before its own prompt_tokens (0 = none)")
_CACHING = flags.DEFINE_boolean("prefix_caching", True, "automatic prefix caching")
_WINDOW = flags.DEFINE_float("window_s", 0.0, "measurement window from the burst; 0 = until done")
_VARIANTS = flags.DEFINE_list("variants", ["prefill_first", "prefill_first:prefill_max_seqs=4",
                                           "alternate", "token_budget"],
                              "columns: policy[:key=value...] (scheduler.parse_arm: keys "
                              "budget, cap, floor, tile, threshold, partials, seqs or "
                              "SchedulerConfig field names)")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 2048, "token budget per step")
_MAX_SEQS = flags.DEFINE_integer("max_num_seqs", 256, "running sequences at most")
_TILE = flags.DEFINE_integer("chunk_tile", 128, "non-final chunks are multiples of it")
_BLOCK = flags.DEFINE_integer("block_size", 16, "tokens per KV block")
_BLOCKS = flags.DEFINE_integer("num_blocks", 0, "KV blocks; 0 = enough for every user at once")
_COST_JSON = flags.DEFINE_string("cost_json", None, "file with a CostModel as JSON")
_CALIBRATE = flags.DEFINE_list("calibrate_from", [], "fit the cost model to these JSONL "
                               "files (engine traces or calibration rows)")
_C0 = flags.DEFINE_float("c0", CostModel.c0, "seconds per step")
_C_PREFILL = flags.DEFINE_float("c_prefill", CostModel.c_prefill, "seconds per prompt token")
_C_DECODE = flags.DEFINE_float("c_decode", CostModel.c_decode, "seconds per decode row")
_C_KV = flags.DEFINE_float("c_kv", CostModel.c_kv, "seconds per key read")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulateConfig:
    users: int
    prompt_tokens: int
    system_prompt_tokens: int
    max_tokens: int
    window_s: float
    variants: tuple[Arm, ...]
    base: SchedulerConfig
    cost: CostModel


def read_flags() -> SimulateConfig:
    num_blocks = _BLOCKS.value or _USERS.value * -(-(_SYSTEM.value + _PROMPT.value
                                                     + _MAX_TOKENS.value) // _BLOCK.value)
    if _CALIBRATE.value:
        from arcjax.bench import costmodel  # numpy/scipy: only for fitting, not for simulating

        rows = [r for path in _CALIBRATE.value for r in costmodel.read_rows(path)]
        cost, report = costmodel.fit_cost_model(rows)
        print(f"calibrated from {', '.join(_CALIBRATE.value)}: {report.describe()}")
    elif _COST_JSON.value:
        with open(_COST_JSON.value) as f:
            cost = CostModel.from_json(json.load(f))
    else:
        cost = CostModel(c0=_C0.value, c_prefill=_C_PREFILL.value, c_decode=_C_DECODE.value,
                         c_kv=_C_KV.value)
    base = SchedulerConfig(max_num_batched_tokens=_BUDGET.value, max_num_seqs=_MAX_SEQS.value,
                           chunk_tile=_TILE.value, block_size=_BLOCK.value, num_blocks=num_blocks,
                           enable_prefix_caching=_CACHING.value)
    return SimulateConfig(users=_USERS.value, prompt_tokens=_PROMPT.value,
                          system_prompt_tokens=_SYSTEM.value,
                          max_tokens=_MAX_TOKENS.value, window_s=_WINDOW.value,
                          variants=tuple(parse_arm(v) for v in _VARIANTS.value), base=base,
                          cost=cost)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SimulateResult:
    """Per arm (its spec): the burst summary, knob engagement and cached prompt tokens."""

    summaries: dict[str, BurstSummary]
    engaged: dict[str, dict[str, int]]
    cached_tokens: dict[str, int]


def run(sim: SimulateConfig) -> SimulateResult:
    """Simulates every arm of `sim` on its burst."""
    if sim.system_prompt_tokens:
        requests = shared_prefix_burst(sim.users, sim.system_prompt_tokens, sim.prompt_tokens,
                                       sim.max_tokens)
    else:
        requests = burst(sim.users, sim.prompt_tokens, sim.max_tokens)
    window = (0.0, sim.window_s) if sim.window_s else None
    summaries, engaged, cached = {}, {}, {}
    for arm in sim.variants:
        result = simulate(arm.config(sim.base), sim.cost, requests, until=sim.window_s or None)
        summaries[arm.name] = summarize(result.requests, result.steps, window)
        engaged[arm.name] = result.engagement()
        cached[arm.name] = result.cached_tokens
    return SimulateResult(summaries=summaries, engaged=engaged, cached_tokens=cached)


def main(argv):
    del argv
    sim = read_flags()
    res = run(sim)
    shared = (f"{sim.system_prompt_tokens}-token shared system prompt + "
              if sim.system_prompt_tokens else "")
    print(f"K = {sim.users} users at once, {shared}{sim.prompt_tokens}-token prompts, "
          f"{sim.max_tokens} tokens each; budget {sim.base.max_num_batched_tokens}, "
          f"tile {sim.base.chunk_tile}; cost {json.dumps(sim.cost.to_json())}")
    print(format_table(res.summaries))
    for variant, counts in res.engaged.items():
        print(f"knobs engaged ({variant}): "
              + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none")
              + f"; prompt tokens served by the prefix cache: {res.cached_tokens[variant]}")


if __name__ == "__main__":
    app.run(main)
