"""What latent attention saves in KV memory, and one step's time per model family on this machine.

  1. KV memory (exact: the bytes `arcjax.model.specs.cache_specs` allocates): DeepSeek-V2-Lite's
     shape (27 layers, 16 heads, kv_lora_rank 512, rope 64, nope 128, v 128) with its latent
     cache, against the same model were keys and values stored per head (16 KV heads of 192
     and 128 values: what an engine without MLA caches), in `--kv_dtype`: bytes per token,
     and how many `--context`-token requests a `--kv_budget_gib` cache holds at once.
  2. Step time (measured, `arcjax.bench.step_timing`): one paged decode step of
     `--decode_rows` rows (each `--context_small` tokens in) and one `--prefill`-token prompt,
     per family at small random-weight shapes of the same kind (Llama, Mixtral, gpt-oss,
     DeepSeek-V2 and V3), the families' steps round-robin, medians of `--iters` runs.
  3. MXFP4 experts (`--mxfp4`): the device bytes of gpt-oss-20b's and -120b's experts kept
     MXFP4 (`Mxfp4Weight`: uint8 blocks and e8m0 scales) against decoded to bf16, and the
     whole model's (computed from `param_specs`, nothing downloaded); and in item 2's round
     robin the small gpt-oss with its experts MXFP4 on the device (`gpt_oss_mxfp4`: decoded
     inside the grouped GEMMs) against the same experts decoded at load
     (`gpt_oss_decoded`), side by side.

CPU:        python scripts/bench_models.py --out=/tmp/models.json
Smoke test: python scripts/bench_models.py --iters=2 --out=/tmp/models.json
"""

from __future__ import annotations

import json
import math
import os
import platform

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from arcjax.bench.step_timing import blocks_needed, step_call, time_round_robin
from arcjax.model.deepseek_config import MLAConfig
from arcjax.model.formats import mxfp4
from arcjax.model.model_config import ModelConfig
from arcjax.model.moe import EXPERT_WEIGHTS
from arcjax.model.mxfp4_weight import BLOCK, Mxfp4Weight
from arcjax.model.quant import dense
from arcjax.model.routing import RouterConfig
from arcjax.model.specs import cache_specs, init_params, is_spec, param_specs

_KV_DTYPE = flags.DEFINE_string("kv_dtype", "bfloat16", "KV cache dtype of the memory figures")
_BUDGET = flags.DEFINE_float("kv_budget_gib", 64.0, "KV cache memory of the concurrency figure")
_CONTEXT = flags.DEFINE_integer("context", 8192, "tokens per request of the concurrency figure")
_ROWS = flags.DEFINE_integer("decode_rows", 8, "decode rows of the timed step")
_CONTEXT_SMALL = flags.DEFINE_integer("context_small", 128, "tokens each decode row is in")
_PREFILL = flags.DEFINE_integer("prefill", 256, "prompt tokens of the timed prefill step")
_ITERS = flags.DEFINE_integer("iters", 10, "timed runs per step; the median is reported")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_MXFP4 = flags.DEFINE_bool("mxfp4", True, "MXFP4 experts: gpt-oss's device bytes, and the "
                           "small gpt-oss's steps packed against decoded")

V2_LITE_MLA = MLAConfig(q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                        qk_rope_head_dim=64, v_head_dim=128)


def deepseek_v2_lite() -> ModelConfig:
    """DeepSeek-V2-Lite's published shape (its config.json)."""
    return ModelConfig(
        architecture="DeepseekV2ForCausalLM", vocab_size=102400, hidden_size=2048,
        intermediate_size=10944, num_layers=27, num_heads=16, num_kv_heads=16, head_dim=192,
        mla=V2_LITE_MLA, num_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        norm_topk_prob=False, shared_expert_intermediate_size=2 * 1408,
        moe_layers=(False,) + (True,) * 26)


def kv_figures(cfg: ModelConfig, dtype, budget_gib: float, context: int) -> dict:
    """Bytes per token of `cfg`'s cache (from `cache_specs`, 16-token blocks) and the
    concurrent `context`-token requests `budget_gib` holds, latent and per-head."""
    block = 16
    itemsize = jnp.dtype(dtype).itemsize

    def per_token(c: ModelConfig) -> int:  # one block of every layer, per token
        specs = cache_specs(c, 1, block)
        return sum(math.prod(specs[k].shape) for k in ("k", "v")) * itemsize // block

    latent = per_token(cfg)
    per_head = cfg.num_layers * cfg.per_head_kv_values() * itemsize  # the heads' K and V
    budget = int(budget_gib * (1 << 30))
    blocks = -(-context // block)
    return {"kv_bytes_per_token": latent, "per_head_kv_bytes_per_token": per_head,
            "saving": round(per_head / latent, 2),
            "concurrent_requests": budget // (blocks * block * latent),
            "concurrent_requests_per_head": budget // (blocks * block * per_head)}


def small_families() -> dict[str, ModelConfig]:
    """Random-weight models of each family at one small shape (hidden 512, 4 layers)."""
    common = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=4,
                  num_heads=8, head_dim=64)
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=256, qk_nope_head_dim=64,
                    qk_rope_head_dim=32, v_head_dim=64)
    experts = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)
    deepseek = dict(common, num_kv_heads=8, head_dim=96, mla=mla,
                    shared_expert_intermediate_size=512, moe_layers=(False,) + (True,) * 3,
                    **experts)
    return {
        "llama": ModelConfig(**common, num_kv_heads=2),
        "mixtral": ModelConfig(architecture="MixtralForCausalLM", **common, num_kv_heads=2,
                               **experts),
        "gpt_oss": ModelConfig(architecture="GptOssForCausalLM", **common, num_kv_heads=2,
                               **experts, attention_sinks=True, expert_bias=True,
                               qkv_bias=True, o_bias=True, swiglu_limit=7.0,
                               sliding_window=128, sliding_layers=(True, False) * 2,
                               router=RouterConfig(scoring="topk_softmax", bias=True)),
        "deepseek_v2": ModelConfig(architecture="DeepseekV2ForCausalLM", norm_topk_prob=False,
                                   router=RouterConfig(n_group=4, topk_group=2), **deepseek),
        "deepseek_v3": ModelConfig(
            architecture="DeepseekV3ForCausalLM",
            router=RouterConfig(scoring="sigmoid", correction_bias=True, n_group=4,
                                topk_group=2, group_score="top2_sum", renormalize_eps=1e-20),
            **{**deepseek, "mla": MLAConfig(q_lora_rank=128, kv_lora_rank=256,
                                            qk_nope_head_dim=64, qk_rope_head_dim=32,
                                            v_head_dim=64)}),
    }


def gpt_oss_published(num_layers: int, num_experts: int) -> ModelConfig:
    """gpt-oss-20b's (24 layers, 32 experts) or -120b's (36, 128) shape, from the fields
    of their published config.json."""
    return ModelConfig.from_hf_dict({
        "architectures": ["GptOssForCausalLM"], "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": num_layers, "head_dim": 64,
        "num_attention_heads": 64, "num_key_value_heads": 8, "num_local_experts": num_experts,
        "num_experts_per_tok": 4, "sliding_window": 128, "swiglu_limit": 7.0,
        "attention_bias": True, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "max_position_embeddings": 131072, "rope_theta": 150000,
        "layer_types": ["sliding_attention", "full_attention"] * (num_layers // 2),
        "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 4096}})


def mxfp4_bytes(cfg: ModelConfig) -> dict:
    """GiB of `cfg`'s experts and whole params (the rest bf16) with the experts MXFP4 (a
    byte per two values and one per block of 32: `Mxfp4Weight`'s arrays) or bf16."""
    specs = param_specs(cfg)
    experts = [specs["layers"][k].shape for k in EXPERT_WEIGHTS]  # [L, E, in, out]
    values = sum(math.prod(s) for s in experts)
    packed = sum(math.prod(s[:2]) * s[3] * (s[2] // BLOCK) * (BLOCK // 2 + 1) for s in experts)
    total = sum(math.prod(s.shape) for s in jax.tree.leaves(specs, is_leaf=is_spec))
    gib = 1 << 30
    return {"expert_values": values, "experts_mxfp4_gib": round(packed / gib, 2),
            "experts_bf16_gib": round(2 * values / gib, 2),
            "bits_per_expert_weight": 8 * packed / values,
            "model_mxfp4_gib": round((packed + 2 * (total - values)) / gib, 2),
            "model_bf16_gib": round(2 * total / gib, 2)}


def mxfp4_twins(params: dict) -> tuple[dict, dict]:
    """`params` with the experts MXFP4 on the device (encoded on the host,
    `mxfp4.encode`), and the same experts decoded (what loading with
    quantization="dequantize" stores)."""
    layers = dict(params["layers"])
    for k in EXPERT_WEIGHTS:  # [L, E, in, out] -> blocks of the [L, E, out, in] rows
        blocks, scales = mxfp4.encode(np.swapaxes(np.asarray(layers[k], np.float32), -1, -2))
        layers[k] = Mxfp4Weight(jnp.asarray(blocks), jnp.asarray(scales))
    decoded = {**layers, **{k: dense(layers[k], params["layers"][k].dtype)
                            for k in EXPERT_WEIGHTS}}
    return {**params, "layers": layers}, {**params, "layers": decoded}


def step_times(iters: int, rows: int, context: int, prefill: int,
               with_mxfp4: bool = False) -> dict:
    """Median milliseconds of a decode step and a prefill step per family (and the small
    gpt-oss with MXFP4 experts packed and decoded: `with_mxfp4`)."""
    calls = {}
    models = {name: (cfg, init_params(cfg, jax.random.key(0)))
              for name, cfg in small_families().items()}
    if with_mxfp4:
        cfg, params = models["gpt_oss"]
        packed, decoded = mxfp4_twins(params)
        models.update(gpt_oss_mxfp4=(cfg, packed), gpt_oss_decoded=(cfg, decoded))
    for name, (cfg, params) in models.items():
        for case, (starts, lengths) in (("decode", ([context] * rows, [1] * rows)),
                                        ("prefill", ([0], [prefill]))):
            num_blocks, max_blocks = blocks_needed(starts, lengths)
            call = step_call(cfg, params, starts, lengths, num_blocks=num_blocks,
                             max_blocks=max_blocks)
            jax.block_until_ready(call())  # compile and warm
            calls[f"{name}/{case}"] = call
    return time_round_robin(calls, iters)


def main(argv):
    del argv
    out = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                       "load_average": os.getloadavg(), "jax": jax.__version__},
           "deepseek_v2_lite_kv": kv_figures(deepseek_v2_lite(), _KV_DTYPE.value,
                                             _BUDGET.value, _CONTEXT.value),
           "step_ms": step_times(_ITERS.value, _ROWS.value, _CONTEXT_SMALL.value,
                                 _PREFILL.value, _MXFP4.value)}
    if _MXFP4.value:
        out["mxfp4_experts"] = {name: mxfp4_bytes(gpt_oss_published(*shape))
                                for name, shape in (("gpt-oss-20b", (24, 32)),
                                                    ("gpt-oss-120b", (36, 128)))}
    out["machine"]["load_average_after"] = os.getloadavg()
    print(json.dumps(out, indent=2))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    app.run(main)
