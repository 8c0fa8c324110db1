"""Times a mixture-of-experts model step beside a dense model with the same active parameters.

  1. Two random-weight models share everything but the MLP: the MoE has `--experts` experts of
     width `--expert_width`, `--top_k` per token; the dense model one MLP of width
     top_k * expert_width (the same parameters active per token).
  2. Each case is one paged step (`decoder.forward_with_stats`, KV cache donated, no
     sampling): decode at each of `--decode_rows` rows (each sequence `--context` tokens in),
     and one `--prefill`-token prompt.
  3. The MoE runs with each grouped-GEMM implementation of `arcjax.model.moe`: "ragged_dot"
     (`jax.lax.ragged_dot`), "tiled" (live row tiles, one expert's weights each) and "dense"
     (the per-expert loop: every expert over every token). Per case, every arm is compiled
     and warmed, then the arms run round-robin `--iters` times (each run synchronized) and
     each reports its median: load that drifts during the run hits every arm alike.
  4. `--layer_mlp`: also one layer's MLP alone (`layers.MoE` vs the dense gated `layers.MLP`) at
     each case's token count, to separate the grouped GEMM from the rest of the step.

CPU (what RESULTS.md reports): taskset -c 0 python scripts/bench_moe.py --out=/tmp/moe.json
Smoke test (< 1 min):          python scripts/bench_moe.py --small --out=/tmp/moe.json
"""

from __future__ import annotations

import dataclasses
import json
import platform

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from arcjax.model import binding
from arcjax.model.model_config import ModelConfig
from arcjax.bench.step_timing import BLOCK, step_call, time_round_robin
from arcjax.model.specs import init_params

_SMALL = flags.DEFINE_boolean("small", False, "tiny shapes, 1 warm-up, 3 runs: a smoke test")
_HIDDEN = flags.DEFINE_integer("hidden", 1024, "hidden size")
_LAYERS = flags.DEFINE_integer("layers", 4, "decoder layers")
_EXPERTS = flags.DEFINE_integer("experts", 8, "experts per layer")
_TOP_K = flags.DEFINE_integer("top_k", 2, "experts per token")
_WIDTH = flags.DEFINE_integer("expert_width", 1024, "each expert's intermediate size")
_DECODE = flags.DEFINE_list("decode_rows", ["1", "8", "64"], "decode cases: rows per step")
_PREFILL = flags.DEFINE_integer("prefill", 1024, "prefill case: prompt tokens (0: none)")
_CONTEXT = flags.DEFINE_integer("context", 128, "keys each decode row attends over")
_IMPLS = flags.DEFINE_list("impls", ["tiled", "ragged_dot", "dense"],
                           "MoE grouped-GEMM implementations to time")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed runs per case (the first compiles)")
_ITERS = flags.DEFINE_integer("iters", 10, "timed runs per case; the median is reported")
_LAYER_MLP = flags.DEFINE_boolean("layer_mlp", True, "also time one layer's MLP alone")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")



@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    hidden: int
    layers: int
    experts: int
    top_k: int
    expert_width: int
    decode_rows: tuple[int, ...]
    prefill: int
    context: int
    impls: tuple[str, ...]
    layer_mlp: bool
    warmup: int
    iters: int
    out: str | None


def _models(c: BenchConfig) -> dict[str, ModelConfig]:
    heads = max(1, c.hidden // 64)
    common = dict(vocab_size=4096, hidden_size=c.hidden, num_layers=c.layers,
                  num_heads=heads, num_kv_heads=max(1, heads // 4), head_dim=64,
                  max_position_embeddings=8192)
    dense = ModelConfig(architecture="LlamaForCausalLM",
                        intermediate_size=c.top_k * c.expert_width, **common)
    moe = ModelConfig(architecture="MixtralForCausalLM", intermediate_size=c.expert_width,
                      num_experts=c.experts, num_experts_per_tok=c.top_k,
                      moe_intermediate_size=c.expert_width, **common)
    return {"dense": dense, "moe": moe}


def _cases(c: BenchConfig) -> list[tuple[str, list[int], list[int]]]:
    """(name, starts, lengths) per case."""
    cases = [(f"decode_{r}", [c.context] * r, [1] * r) for r in c.decode_rows]
    if c.prefill:
        cases.append((f"prefill_{c.prefill}", [0], [c.prefill]))
    return cases


def _mlp_call(c: BenchConfig, cfg: ModelConfig, params, impl: str, tokens: int):
    """One layer's MLP alone (layer 0) over `tokens` rows, as the step reads it."""
    graphdef, state = nnx.split(binding.bind(cfg, params).block(0).mlp)
    h = jax.random.normal(jax.random.key(tokens), (tokens, c.hidden))
    valid = jnp.ones(tokens, bool)

    def mlp(state, h, layer):
        module = nnx.merge(graphdef, state)
        if not cfg.is_moe:
            return module(h)
        return module(h, valid=valid, layer=layer, impl=impl, parallel=None)[0]

    # the layer index is traced, as in the step (a constant one would slice out, i.e. copy,
    # that layer's every expert at compile time)
    step, layer = jax.jit(mlp), jnp.int32(0)
    return lambda: step(state, h, layer)


def run(c: BenchConfig) -> dict:
    models = _models(c)
    cases = _cases(c)
    max_keys = max(max(s + ln for s, ln in zip(st, lens)) for _, st, lens in cases)
    max_blocks = -(-max_keys // BLOCK)
    num_blocks = max(-(-(sum(s + ln for s, ln in zip(st, lens))) // BLOCK) + len(st)
                     for _, st, lens in cases)
    arms = [("dense", "dense", "auto")] + [(f"moe_{impl}", "moe", impl) for impl in c.impls]
    params = {model: init_params(cfg, jax.random.key(1)) for model, cfg in models.items()}
    results = []
    for name, starts, lengths in cases:
        kinds = [("", lambda arm, model, impl: step_call(
            models[model], params[model], starts, lengths, num_blocks=num_blocks,
            max_blocks=max_blocks, moe_impl=impl))]
        if c.layer_mlp:
            kinds.append(("mlp_", lambda arm, model, impl: _mlp_call(
                c, models[model], params[model], impl, sum(lengths))))
        for prefix, make in kinds:
            calls = {arm: make(arm, model, impl) for arm, model, impl in arms}
            for call in calls.values():  # compile and warm every arm first
                for _ in range(c.warmup):
                    jax.block_until_ready(call())
            for arm, ms in time_round_robin(calls, c.iters).items():
                results.append({"arm": arm, "case": prefix + name, "ms": ms})
                print(f"{arm:16s} {prefix + name:18s} {ms:9.2f} ms", flush=True)
    table = {}
    for r in results:
        table.setdefault(r["case"], {})[r["arm"]] = r["ms"]
    for row in table.values():
        for arm in list(row):
            if arm != "dense":
                row[f"{arm}_over_dense"] = row[arm] / row["dense"]
    active = 3 * c.hidden * c.top_k * c.expert_width
    return {"config": dataclasses.asdict(c), "results": results, "by_case": table,
            "active_mlp_params_per_layer": active,
            "total_mlp_params_per_layer_moe": 3 * c.hidden * c.experts * c.expert_width,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "machine": platform.machine(), "processor": platform.processor()}


def main(argv):
    del argv
    small = _SMALL.value
    c = BenchConfig(
        hidden=128 if small else _HIDDEN.value, layers=2 if small else _LAYERS.value,
        experts=4 if small else _EXPERTS.value, top_k=_TOP_K.value,
        expert_width=128 if small else _WIDTH.value,
        decode_rows=(1, 8) if small else tuple(int(r) for r in _DECODE.value),
        prefill=64 if small else _PREFILL.value, context=32 if small else _CONTEXT.value,
        impls=tuple(_IMPLS.value), layer_mlp=_LAYER_MLP.value,
        warmup=1 if small else _WARMUP.value,
        iters=3 if small else _ITERS.value, out=_OUT.value)
    out = run(c)
    if c.out:
        with open(c.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
