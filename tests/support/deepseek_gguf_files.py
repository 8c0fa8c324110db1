"""DeepSeek-V2/V3 GGUF files (`deepseek2`) written from the tiny Hugging Face models the way
llama.cpp's converter writes them: MLA served as MQA (`head_count_kv` 1, `key_length`
kv_lora_rank + rope, the per-head widths in `key_length_mla` / `value_length_mla`) with
`kv_b_proj` split into `attn_k_b` [Hq, Dl, dn] (transposed) and `attn_v_b` [Hq, dv, Dl], or
with `split_kv_b=False` the layout of files converted before that (`attn_kv_b` as stored,
per-head `key_length` / `value_length`); nothing permuted; experts merged per layer;
`e_score_correction_bias` as `exp_probs_b.bias`; YaRN's mscale_all_dim as
`rope.scaling.yarn_log_multiplier` = 0.1 * mscale_all_dim. `drop` leaves metadata keys out
(for the typed errors). Test-only.
"""

from __future__ import annotations

import json
import os

import numpy as np

from support.gguf_files import add_weight
from support.scratch import scratch_dir

_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj": "attn_q",
          "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm.weight":
          "attn_q_a_norm.weight", "self_attn.q_b_proj": "attn_q_b",
          "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa",
          "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
          "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate.weight":
          "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.shared_experts.gate_proj": "ffn_gate_shexp",
          "mlp.shared_experts.up_proj": "ffn_up_shexp",
          "mlp.shared_experts.down_proj": "ffn_down_shexp"}
_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
        "output_norm.weight", "lm_head.weight": "output.weight"}


def _gguf_name(name: str) -> str:
    if name in _TOP:
        return _TOP[name]
    _, _, i, rest = name.split(".", 3)
    for hf, gg in sorted(_NAMES.items(), key=lambda kv: -len(kv[0])):  # longest prefix
        if rest.startswith(hf):
            return f"blk.{i}.{gg}{rest[len(hf):]}"
    raise KeyError(name)


def _metadata(w, cfg: dict, split_kv_b: bool) -> None:
    import gguf

    heads, rope = cfg["num_attention_heads"], cfg["qk_rope_head_dim"]
    qk, rank = cfg["qk_nope_head_dim"] + rope, cfg["kv_lora_rank"]
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1 if split_kv_b else heads)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    params = cfg.get("rope_parameters") or {}
    w.add_rope_freq_base(params.get("rope_theta", 10000.0))
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank"):
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(rank)
    if split_kv_b:  # MQA over the latent: one "head" of the cached width
        w.add_key_length(rank + rope)
        w.add_value_length(rank)
        w.add_key_length_mla(qk)
        w.add_value_length_mla(cfg["v_head_dim"])
    else:
        w.add_key_length(qk)
        w.add_value_length(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    v3 = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3
                             else gguf.ExpertGatingFuncType.SOFTMAX)
    if cfg.get("n_group", 1) > 1:
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_rope_dimension_count(rope)
    if params.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(params["factor"])
        w.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])


def write_deepseek_gguf(hf_dir: str, qtype_name: str = "F32", path: str | None = None, *,
                        split_kv_b: bool = True, drop: tuple[str, ...] = ()) -> str:
    """Writes the DeepSeek model `hf_dir` as a `deepseek2` GGUF file (2-D and 3-D weights in
    `qtype_name` where their rows fit its block, routers and 1-D tensors F32); returns its
    path. `drop`: metadata keys (without the `deepseek2.` prefix) left out."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    path = path or os.path.join(scratch_dir("arcjax-gguf-deepseek-"),
                                f"model-{qtype_name}.gguf")
    w = gguf.GGUFWriter(path, "deepseek2")
    _metadata(w, cfg, split_kv_b)
    for key in drop:
        del w.kv_data[0][f"deepseek2.{key}"]
    heads, dn = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        t = np.asarray(t, np.float32)
        if ".mlp.experts." in name:  # model.layers.N.mlp.experts.E.gate_proj.weight
            _, _, layer, _, _, e, kind, _ = name.split(".")
            experts.setdefault((layer, kind.split("_")[0]), {})[int(e)] = t
            continue
        gname = _gguf_name(name)
        if "ffn_gate_inp" in gname or "exp_probs_b" in gname:
            w.add_tensor(gname, t)
        elif ".attn_kv_b." in gname and split_kv_b:  # [Hq * (dn + dv), Dl]
            kv_b = t.reshape(heads, -1, t.shape[-1])
            add_weight(w, gname.replace("attn_kv_b", "attn_k_b"),
                       np.ascontiguousarray(kv_b[:, :dn].swapaxes(1, 2)), qtype_name)
            add_weight(w, gname.replace("attn_kv_b", "attn_v_b"),
                       np.ascontiguousarray(kv_b[:, dn:]), qtype_name)
        else:
            add_weight(w, gname, t, qtype_name)
    for (layer, kind), by_expert in sorted(experts.items()):
        add_weight(w, f"blk.{layer}.ffn_{kind}_exps.weight",
                   np.stack([by_expert[e] for e in sorted(by_expert)]), qtype_name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
