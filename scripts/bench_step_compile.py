"""Trace, lower and compile time of the paged decoder step, and the optimized HLO's op counts,
for a small dense and a small MoE config: what a change to how the model is written (the
`flax.nnx` layers) costs at compile time, and whether the compiled program changed.

Run it in two checkouts on the same machine, side by side, and compare the JSON files: equal
`ops` means the same optimized program (op for op, up to operand order).

  taskset -c 0 python scripts/bench_step_compile.py --out=runs/step_compile.json
"""

from __future__ import annotations

import collections
import json
import re
import time

from absl import app, flags

_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_ATTN = flags.DEFINE_string("attn_impl", "xla", "attention implementation of the step")

_OP = re.compile(r"= \S+ (\w[\w-]*)\(")  # `%name = type op(` in optimized HLO text


def _configs():
    from arcjax.model.model_config import ModelConfig

    return {
        "dense": ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                             num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16,
                             qkv_bias=True, qk_norm=True),
        "moe": ModelConfig(architecture="Qwen2MoeForCausalLM", vocab_size=256, hidden_size=64,
                           intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=16, num_experts=4, num_experts_per_tok=2,
                           moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           shared_expert_gate=True,
                           tie_word_embeddings=True),
    }


def _measure(cfg, attn_impl: str) -> dict:
    import jax
    import jax.numpy as jnp

    from arcjax.model import decoder
    from arcjax.model.specs import is_spec, make_cache, param_specs

    num_blocks, block_size, tokens, seqs = 16, 8, 8, 4
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                          param_specs(cfg), is_leaf=is_spec)
    cache = jax.eval_shape(lambda: make_cache(cfg, num_blocks, block_size))

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    batch = decoder.StepBatch(
        token_ids=i32(tokens), positions=i32(tokens), slot_mapping=i32(1, tokens),  # one group
        cu_seqlens_q=i32(seqs + 1), kv_lens=i32(seqs), block_tables=i32(1, seqs, 4),
        num_seqs=i32(), logits_rows=i32(seqs))
    step = jax.jit(lambda p, c, b: decoder.forward(p, c, b, cfg=cfg, attn_impl=attn_impl),
                   donate_argnums=1)
    t0 = time.perf_counter()
    traced = step.trace(params, cache, batch)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    ops = collections.Counter(m.group(1) for m in _OP.finditer(compiled.as_text()))
    return {"trace_s": t1 - t0, "lower_s": t2 - t1, "compile_s": t3 - t2,
            "num_ops": sum(ops.values()), "ops": dict(sorted(ops.items()))}


def main(argv):
    del argv
    res = {name: _measure(cfg, _ATTN.value) for name, cfg in _configs().items()}
    for name, r in res.items():
        print(f"{name:>6}: trace {r['trace_s']:.3f} s, lower {r['lower_s']:.3f} s, "
              f"compile {r['compile_s']:.3f} s, {r['num_ops']} optimized HLO ops")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
