"""Factories for tiny random-weight Hugging Face models, saved in safetensors.

Shared by the model, engine and benchmark tests. torch/transformers are the
reference implementation only; arcjax never imports them at run time.
"""

from __future__ import annotations

import functools

from support.scratch import scratch_dir

ARCHS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Mixtures of experts, Gemma, and sliding windows. Windows are short (the tests' prompts run
# past them): Mixtral slides in every layer, Gemma alternates local and global layers.
MOE_ARCHS = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHS = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
NEW_ARCHS = MOE_ARCHS + GEMMA_ARCHS
WINDOW = 24  # the tiny sliding-window models' window
GPT_OSS = "GptOssForCausalLM"

_COMMON = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               bos_token_id=1, eos_token_id=2)
_EXTRA = {
    # llama3 rope scaling with a short original context, so scaling really acts.
    "LlamaForCausalLM": dict(rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                           "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                           "original_max_position_embeddings": 32}),
    "MistralForCausalLM": dict(num_key_value_heads=1, sliding_window=None,
                               rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "Qwen2ForCausalLM": dict(tie_word_embeddings=True, rope_theta=1e6),
    "Qwen3ForCausalLM": dict(head_dim=32),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=96,
                               sliding_window=WINDOW),
    # norm_topk_prob False (Qwen2-MoE's default): the top-k weights are not renormalized.
    "Qwen2MoeForCausalLM": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                                shared_expert_intermediate_size=80, norm_topk_prob=False),
    "Qwen3MoeForCausalLM": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                norm_topk_prob=True, head_dim=32),
    "Gemma2ForCausalLM": dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=24,
                              attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                              layer_types=["sliding_attention", "full_attention"]),
    "Gemma3ForCausalLM": dict(head_dim=32, sliding_window=WINDOW, query_pre_attn_scalar=32,
                              num_hidden_layers=3, layer_types=[
                                  "sliding_attention", "full_attention", "sliding_attention"],
                              rope_parameters={
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 1e4}}),
}
# gpt-oss: attention sinks, sliding and full layers alternating, biases on q/k/v/o, YaRN
# (a short original context, so the ramp and its attention factor really act), a biased
# router and biased experts with the clamped SwiGLU (a low limit, so the clamp acts).
_EXTRA[GPT_OSS] = dict(
    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=16,
    sliding_window=WINDOW, swiglu_limit=1.5, layer_types=["sliding_attention", "full_attention"],
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "truncate": False, "original_max_position_embeddings": 64,
                     "rope_theta": 150000.0})
# DeepSeek: latent attention (V2 without a query bottleneck, V3 with one; YaRN with mscale
# and mscale_all_dim on V3, so the softmax scale and rope factor really act), V3's dense
# first layer then expert layers (V2: experts in every layer), shared experts, V2's group-limited softmax router and V3's
# sigmoid noaux_tc router (its correction bias perturbed like every weight).
DEEPSEEK_V2, DEEPSEEK_V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"
_DEEPSEEK = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
                 qk_rope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, n_shared_experts=2, first_k_dense_replace=1,
                 n_group=4, topk_group=2, routed_scaling_factor=1.5, num_hidden_layers=3)
_EXTRA[DEEPSEEK_V2] = dict(_DEEPSEEK, q_lora_rank=None, topk_method="group_limited_greedy",
                           first_k_dense_replace=0)  # every layer experts: one layer stack
_EXTRA[DEEPSEEK_V3] = dict(
    _DEEPSEEK, q_lora_rank=24, norm_topk_prob=True,
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "mscale": 0.9, "mscale_all_dim": 0.7,
                     "original_max_position_embeddings": 64, "rope_theta": 10000.0})
_CONFIG_CLASS = {"Gemma3ForCausalLM": "Gemma3TextConfig"}


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "LlamaForCausalLM", seed: int = 0) -> str:
    """Builds, perturbs (so norms and biases are not trivial) and saves a tiny model."""
    import torch
    import transformers

    cfg_cls = getattr(transformers, _CONFIG_CLASS.get(arch, arch.replace("ForCausalLM", "Config")))
    model_cls = getattr(transformers, arch)
    cfg = cfg_cls(**{**_COMMON, **_EXTRA[arch]})
    cfg.architectures = [arch]
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = scratch_dir(f"arcjax-{arch}-")
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.lru_cache(maxsize=None)
def tiny_llama_8_heads_dir(seed: int = 0) -> str:
    """A tiny Llama with 8 query heads (head_dim 8) and 2 KV heads: tensor parallelism up
    to 8 devices (each KV head then stored on 4)."""
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**{**_COMMON, "num_attention_heads": 8})
    cfg.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = scratch_dir("arcjax-Llama8Heads-")
    model.save_pretrained(path, safe_serialization=True)
    return path


@functools.lru_cache(maxsize=None)
def hf_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


def hf_logits(path: str, ids):
    import numpy as np
    import torch

    with torch.no_grad():
        return hf_model(path)(torch.tensor([list(ids)])).logits[0].numpy().astype(np.float32)


def hf_greedy(path: str, ids, n: int) -> list[int]:
    """transformers' greedy continuation of `ids` (n new tokens, EOS ignored)."""
    import torch

    with torch.no_grad():
        out = hf_model(path).generate(torch.tensor([list(ids)]), do_sample=False,
                                      max_new_tokens=n, min_new_tokens=n,
                                      pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


_TOKENIZER_TEXT = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    "The quick brown fox jumps over the lazy dog. Naïve café, 東京, emoji 🙂 and more text.\n"
) * 20


@functools.lru_cache(maxsize=None)
def tiny_model_with_tokenizer(arch: str = "LlamaForCausalLM") -> str:
    """A tiny model directory that also has a byte-level BPE tokenizer.json (vocab 384)."""
    import json
    import os
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    src = tiny_model_dir(arch)
    path = scratch_dir(f"arcjax-tok-{arch}-")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=_COMMON["vocab_size"], special_tokens=[
        "<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TOKENIZER_TEXT], trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)
    return path


@functools.lru_cache(maxsize=None)
def tiny_model_with_chat_template(template: str | None, arch: str = "LlamaForCausalLM") -> str:
    """`tiny_model_with_tokenizer(arch)` copied with `chat_template` set in its
    tokenizer_config.json (None: no template at all)."""
    import json
    import os
    import shutil

    src = tiny_model_with_tokenizer(arch)
    path = scratch_dir("arcjax-chat-")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), path)
    cfg_path = os.path.join(path, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("chat_template", None)
    if template is not None:
        cfg["chat_template"] = template
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


# The think block's markers, added to a test tokenizer as ordinary (non-special) tokens, as
# Qwen3's and DeepSeek-R1's tokenizers have them.
MARKER_TOKENS = ("<think>", "</think>")
# harmony's (gpt-oss's) special tokens
HARMONY_TOKENS = ("<|start|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|end|>",
                  "<|call|>", "<|return|>")


@functools.lru_cache(maxsize=None)
def tiny_reasoning_model(template: str, arch: str = "LlamaForCausalLM",
                         markers: tuple[str, ...] = MARKER_TOKENS, special: bool = False) -> str:
    """`tiny_model_dir(arch)` with a byte-level BPE tokenizer whose last ids are `markers`
    (within the model's 384; special tokens with `special`), BOS added to text prompts,
    and `template` as its chat template."""
    import json
    import os
    import shutil

    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    src = tiny_model_dir(arch)
    path = scratch_dir(f"arcjax-reasoning-{arch}-")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_COMMON["vocab_size"] - len(markers),
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TOKENIZER_TEXT], trainer)
    tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in markers])
    assert tok.get_vocab_size() <= _COMMON["vocab_size"]  # the text holds fewer merges
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                   "chat_template": template}, f)
    return path


@functools.lru_cache(maxsize=None)
def with_context(model_dir: str, max_position_embeddings: int) -> str:
    """`model_dir` copied with a longer context in its config.json."""
    import json
    import os
    import shutil

    path = scratch_dir("arcjax-context-")
    for f in os.listdir(model_dir):
        shutil.copy(os.path.join(model_dir, f), path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["max_position_embeddings"] = max_position_embeddings
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return path


@functools.lru_cache(maxsize=None)
def tiny_embedding_model_dir(arch: str, pooling: str, normalize: bool) -> str:
    """`tiny_model_dir(arch)` copied with sentence-transformers files: modules.json
    (Transformer, Pooling, and Normalize when `normalize`) and 1_Pooling/config.json with
    `pooling` ("lasttoken", "mean_tokens" or "cls_token") on."""
    import json
    import os
    import shutil

    src = tiny_model_dir(arch)
    path = scratch_dir(f"arcjax-embed-{arch}-")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), path)
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling",
                "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"))
    modes = {f"pooling_mode_{m}": m == pooling for m in (
        "cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens",
        "lasttoken")}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump({"word_embedding_dimension": _COMMON["hidden_size"], **modes,
                   "include_prompt": True}, f)
    return path


@functools.lru_cache(maxsize=None)
def hf_base_model(path: str):
    """The model without its LM head (transformers' AutoModel): what embeddings pool."""
    import transformers

    return transformers.AutoModel.from_pretrained(path, dtype="float32").eval()


def hf_pooled(path: str, ids, pooling: str, normalize: bool):
    """transformers' last hidden states (after the final norm) of `ids`, pooled ("LAST",
    "MEAN", "CLS") and optionally L2-normalized, as sentence-transformers pools them."""
    import numpy as np
    import torch

    with torch.no_grad():
        hidden = hf_base_model(path)(torch.tensor([list(ids)])).last_hidden_state[0]  # [L, H]
    v = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    if normalize:
        v = torch.nn.functional.normalize(v, dim=-1)
    return v.numpy().astype(np.float32)
