"""GGUF files written from the tiny Hugging Face test models, as llama.cpp's converter would.

`write_gguf(hf_dir, qtype)` writes the model's config as GGUF metadata, its tokenizer (when
the directory has a byte-level BPE tokenizer.json) and chat template, and its tensors:
q/k permuted for the `llama` architecture, 2-D weights quantized to `qtype` with the `gguf`
package's quantizers, or with the K-quant encoders below (the package only decodes
Q4_K/Q5_K/Q6_K), 1-D tensors in F32. Mixtures of experts get their experts merged per
layer into `ffn_{gate,up,down}_exps` [E, out, in] (routers kept F32, as llama-quantize
keeps them); Gemma's norms are written as 1 + w. Test-only: torch/transformers are not
needed here.
"""

from __future__ import annotations

import functools
import json
import os
import re

import numpy as np

from support.scratch import scratch_dir

QK_K = 256
_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
         "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
         "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
         "Qwen3MoeForCausalLM": "qwen3moe", "Gemma2ForCausalLM": "gemma2",
         "Gemma3ForCausalLM": "gemma3"}


def _f16(x) -> np.ndarray:
    return np.asarray(x, np.float16)


def _pack_k_scales(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """12 bytes holding eight 6-bit scales and mins (the inverse of get_scale_min). [n, 12]"""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    d = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    md = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d, m, md], axis=1)


def _affine_k(blocks: np.ndarray, levels: int):
    """Q4_K/Q5_K scales: x ~ d * sc * q - dmin * mn per sub-block of 32 (8 per block)."""
    n = blocks.shape[0]
    sub = blocks.reshape(n, 8, 32)
    lo, hi = np.minimum(sub.min(-1), 0.0), sub.max(-1)
    step, offset = (hi - lo) / levels, -lo
    d = _f16(step.max(-1) / 63).astype(np.float32)
    dmin = _f16(offset.max(-1) / 63).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 0, 63)
    mn = np.clip(np.round(offset / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63)
    scale = (d[:, None] * sc)[..., None]
    q = np.clip(np.round((sub + (dmin[:, None] * mn)[..., None]) / np.where(scale > 0, scale, 1)),
                0, levels).astype(np.uint8)
    head = np.concatenate([_f16(d)[:, None].view(np.uint8), _f16(dmin)[:, None].view(np.uint8),
                           _pack_k_scales(sc, mn)], axis=1)
    return head, q  # q [n, 8, 32]


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 15)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)
    return np.concatenate([head, qs], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    head, q = _affine_k(blocks, 31)
    low, high = q & 0x0F, q >> 4
    qh = np.zeros((len(q), 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    qs = (low[:, 0::2] | (low[:, 1::2] << 4)).reshape(len(q), 128)
    return np.concatenate([head, qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    sub = blocks.reshape(n, 16, 16)
    step = np.abs(sub).max(-1) / 31
    d = _f16(step.max(-1) / 127).astype(np.float32)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), -128, 127)
    scale = (d[:, None] * sc)[..., None]
    q = (np.clip(np.round(sub / np.where(scale > 0, scale, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(n, QK_K)
    ql, qh = np.zeros((n, 128), np.uint8), np.zeros((n, 64), np.uint8)
    for h in range(2):  # value v = h * 128 + s * 64 + k: low nibble s of ql[h * 64 + k]
        for s in range(2):
            part = q[:, h * 128 + s * 64:h * 128 + (s + 1) * 64]
            ql[:, h * 64:(h + 1) * 64] |= (part & 0x0F) << (4 * s)
        for s in range(4):  # v = h * 128 + s * 32 + k: bits 2s, 2s + 1 of qh[h * 32 + k]
            part = q[:, h * 128 + s * 32:h * 128 + (s + 1) * 32]
            qh[:, h * 32:(h + 1) * 32] |= (part >> 4) << (2 * s)
    return np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8),
                           _f16(d)[:, None].view(np.uint8)], axis=1)


_K_QUANTIZERS = {"Q4_K": quantize_q4_k, "Q5_K": quantize_q5_k, "Q6_K": quantize_q6_k}


def quantize(w: np.ndarray, qtype_name: str) -> tuple[np.ndarray, int]:
    """(data, GGML type) of a float tensor [rows, cols], quantized along its rows."""
    import gguf

    qtype = gguf.GGMLQuantizationType[qtype_name]
    if qtype_name in _K_QUANTIZERS:
        rows = w.reshape(-1, QK_K).astype(np.float32)
        data = _K_QUANTIZERS[qtype_name](rows).reshape(*w.shape[:-1], -1)
        return data, qtype
    if qtype_name == "F32":
        return w.astype(np.float32), qtype
    if qtype_name == "F16":
        return w.astype(np.float16), qtype
    return gguf.quants.quantize(w.astype(np.float32), qtype), qtype


def _permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's two rotary halves interleaved."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


_NAMES = {"input_layernorm.weight": "attn_norm.weight", "self_attn.q_proj": "attn_q",
          "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm.weight": "attn_q_norm.weight",
          "self_attn.k_norm.weight": "attn_k_norm.weight",
          "post_attention_layernorm.weight": "ffn_norm.weight", "mlp.gate_proj": "ffn_gate",
          "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate.weight": "ffn_gate_inp.weight",
          "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
          "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp",
          "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight",
          "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GEMMA_NAMES = {"post_attention_layernorm.weight": "post_attention_norm.weight"}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                     r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_EXPERT_KIND = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                "down_proj": "down", "w2": "down"}


def _gguf_name(name: str, gemma: bool = False) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
           "output_norm.weight", "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, i, rest = name.split(".", 3)
    for hf, gg in ({**_NAMES, **_GEMMA_NAMES} if gemma else _NAMES).items():
        if rest.startswith(hf):
            return f"blk.{i}.{gg}{rest[len(hf):]}"
    raise KeyError(name)


def _rope(cfg: dict) -> dict:
    """rope_theta and scaling, from transformers 5's rope_parameters or the older keys."""
    params = cfg.get("rope_parameters") or {}
    return {"rope_theta": cfg.get("rope_theta", 10000.0), **(cfg.get("rope_scaling") or {}),
            **params.get("full_attention", params)}  # Gemma 3: the global layers' rope


def llama3_rope_factors(cfg: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling: one divisor per frequency."""
    import math

    s = _rope(cfg)
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    base, factor = s.get("rope_theta", 10000.0), s["factor"]
    low, high, orig = s["low_freq_factor"], s["high_freq_factor"], s[
        "original_max_position_embeddings"]
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * base ** (i / d)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_gguf(hf_dir: str, qtype_name: str, path: str | None = None, *,
               add_tokenizer: bool = True, merge_experts: bool = True) -> str:
    """Writes `hf_dir` as a GGUF file (weights in `qtype_name`); returns its path.
    `merge_experts=False`: one tensor per expert, `blk.N.ffn_gate.E.weight` (the layout of
    Mixtral files converted before llama.cpp merged them)."""
    import gguf
    from safetensors.numpy import load_file

    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    arch = _ARCH[cfg["architectures"][0]]
    path = path or os.path.join(scratch_dir("arcjax-gguf-"),
                                f"model-{qtype_name}.gguf")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_name("tiny test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(_rope(cfg)["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    scaling = _rope(cfg)
    if scaling.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(scaling["factor"])
    _add_family_metadata(w, cfg, arch)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    tok_path = os.path.join(hf_dir, "tokenizer.json")
    if add_tokenizer and os.path.isfile(tok_path):
        with open(tok_path) as f:
            tok = json.load(f)
        vocab = tok["model"]["vocab"]
        added = {t["id"]: t["content"] for t in tok["added_tokens"]}
        tokens = [added.get(i) for i in range(cfg["vocab_size"])]
        by_id = {i: t for t, i in vocab.items()}
        tokens = [t if t is not None else by_id.get(i, f"[PAD{i}]") for i, t in enumerate(tokens)]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if i in added else 1 for i in range(len(tokens))])
        merges = tok["model"]["merges"]
        w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
        w.add_add_bos_token(False)
        tcfg_path = os.path.join(hf_dir, "tokenizer_config.json")
        if os.path.isfile(tcfg_path):
            with open(tcfg_path) as f:
                template = json.load(f).get("chat_template")
            if template:
                w.add_chat_template(template)
    state = load_file(os.path.join(hf_dir, "model.safetensors"))
    if scaling.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(cfg))
    gemma = arch.startswith("gemma")
    experts: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, t in state.items():
        t = np.asarray(t, np.float32)
        m = _EXPERT.match(name)
        if m:  # merged below: blk.N.ffn_{kind}_exps [E, out, in]
            experts.setdefault((m.group(1), _EXPERT_KIND[m.group(3)]), {})[int(m.group(2))] = t
            continue
        gname = _gguf_name(name, gemma)
        if arch == "llama" and ".attn_q." in gname:
            t = _permute(t, heads)
        elif arch == "llama" and ".attn_k." in gname:
            t = _permute(t, kv_heads)
        if gemma and gname.endswith("norm.weight"):
            t = t + 1.0
        if "ffn_gate_inp" in gname:  # routers stay F32; the shared gate as [H]
            w.add_tensor(gname, t.reshape(-1) if "shexp" in gname else t)
            continue
        add_weight(w, gname, t, qtype_name)
    for (layer, kind), by_expert in sorted(experts.items()):
        if not merge_experts:
            for e in sorted(by_expert):
                add_weight(w, f"blk.{layer}.ffn_{kind}.{e}.weight", by_expert[e], qtype_name)
            continue
        merged = np.stack([by_expert[e] for e in sorted(by_expert)])
        add_weight(w, f"blk.{layer}.ffn_{kind}_exps.weight", merged, qtype_name)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def add_weight(w, name: str, t: np.ndarray, qtype_name: str) -> None:
    """A 2-D or 3-D weight in `qtype_name` when its rows fit the type's block, else F32."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype_name]][0]
    if t.ndim >= 2 and t.shape[-1] % block == 0:
        data, qtype = quantize(t, qtype_name)
        w.add_tensor(name, data, raw_dtype=qtype)
    else:
        w.add_tensor(name, t)


def _add_family_metadata(w, cfg: dict, arch: str) -> None:
    """Experts, windows and soft-caps, as llama.cpp's converter writes them."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if arch != "llama":  # Mixtral's experts are feed_forward_length wide
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch.startswith("gemma"):  # llama.cpp reads windows for Gemma only
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])


# Gemma with transformers' defaults where GGUF has no field (query_pre_attn_scalar 256 =
# head_dim, Gemma 2's soft-caps 50 / 30, Gemma 3's local rope base 10000 and every 6th layer
# global), so transformers' GGUF loader builds the same model; a window of 8 the tests'
# prompts run past.
_GGUF_EXTRA = {"Qwen2ForCausalLM": dict(tie_word_embeddings=True),
               # transformers reads no head_dim from a qwen3 GGUF (Qwen3Config's 128 applies)
               "Qwen3ForCausalLM": dict(head_dim=128),
               "Gemma2ForCausalLM": dict(head_dim=256, sliding_window=8),
               "Gemma3ForCausalLM": dict(head_dim=256, sliding_window=8, num_hidden_layers=6)}


@functools.lru_cache(maxsize=None)
def tiny_gguf_model_dir(arch: str = "LlamaForCausalLM", seed: int = 0) -> str:
    """A tiny HF model whose rows (256) fit every GGUF block size, K-quants included."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, {"Gemma3ForCausalLM": "Gemma3TextConfig"}.get(
        arch, arch.replace("ForCausalLM", "Config")))
    cfg = cfg_cls(**{**dict(vocab_size=384, hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, bos_token_id=1, eos_token_id=2),
                     **_GGUF_EXTRA.get(arch, {})})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = scratch_dir(f"arcjax-gguf-src-{arch}-")
    model.save_pretrained(path, safe_serialization=True)
    return path
