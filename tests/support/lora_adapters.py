"""Random PEFT LoRA adapters for the tiny test models, and PEFT's own greedy outputs.

`peft_adapter_dir(arch, rank, seed)` trains nothing: `peft.get_peft_model` with
`init_lora_weights=False` (A and B random, so the adapter changes the outputs) on a fresh
copy of the tiny model, saved with `save_pretrained` (adapter_config.json +
adapter_model.safetensors) exactly as people publish adapters. `peft_greedy` is the
reference: transformers + `peft.PeftModel`, greedy, EOS ignored. torch, transformers and
peft are test dependencies only.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

from support.hf_models import tiny_model_dir
from support.scratch import scratch_dir

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = ALL_TARGETS[:4]
# The LoRA engines of the tests (with support.engines.GEOMETRY): two device slots of rank
# 16, two host slots; one set of shapes, so every such engine of a process shares its
# compiled steps.
LORA_OPTIONS = dict(enable_lora=True, max_loras=2, max_lora_rank=16, max_cpu_loras=2,
                    policy="token_budget", chunk_tile=16, max_num_batched_tokens=64)


def _fresh_model(path: str):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()


@functools.lru_cache(maxsize=None)
def peft_adapter_dir(arch: str = "LlamaForCausalLM", rank: int = 4, seed: int = 0,
                     targets: tuple[str, ...] = ALL_TARGETS, alpha: float | None = None,
                     rslora: bool = False, model_dir: str | None = None) -> str:
    """A saved random PEFT adapter of `rank` on `targets` for the tiny `arch` model (or the
    model at `model_dir`)."""
    import peft
    import torch

    base_dir = model_dir or tiny_model_dir(arch)
    torch.manual_seed(1000 + seed)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank,
                             target_modules=list(targets), init_lora_weights=False,
                             use_rslora=rslora, lora_dropout=0.0)
    model = peft.get_peft_model(_fresh_model(base_dir), config)
    path = scratch_dir(f"arcjax-lora-{arch}-r{rank}-s{seed}-")
    model.save_pretrained(path)
    return path


def edited_adapter(src: str, *, config: dict | None = None, drop: tuple[str, ...] = (),
                   tensors: dict | None = None) -> str:
    """A copy of the adapter at `src` with adapter_config.json keys replaced (`config`),
    files removed (`drop`) or tensors replaced / added (`tensors`: name -> array, None
    removes it)."""
    from safetensors.numpy import load_file, save_file

    path = scratch_dir("arcjax-lora-edited-")
    for f in os.listdir(src):
        if f not in drop:
            shutil.copy(os.path.join(src, f), path)
    if config:
        file = os.path.join(path, "adapter_config.json")
        with open(file) as f:
            cfg = json.load(f)
        cfg.update(config)
        with open(file, "w") as f:
            json.dump(cfg, f)
    if tensors:
        file = os.path.join(path, "adapter_model.safetensors")
        weights = load_file(file)
        for name, value in tensors.items():
            if value is None:
                weights.pop(name, None)
            else:
                weights[name] = value
        save_file(weights, file)
    return path


@functools.lru_cache(maxsize=None)
def _peft_model(model_dir: str, adapter_dir: str):
    import peft

    return peft.PeftModel.from_pretrained(_fresh_model(model_dir), adapter_dir).eval()


def peft_greedy(model_dir: str, adapter_dir: str | None, ids, n: int) -> list[int]:
    """transformers + PEFT's greedy continuation of `ids` (n tokens, EOS ignored); without
    an adapter, the base model's (`hf_greedy`)."""
    import torch

    from support.hf_models import hf_greedy

    if adapter_dir is None:
        return hf_greedy(model_dir, ids, n)
    with torch.no_grad():
        out = _peft_model(model_dir, adapter_dir).generate(
            input_ids=torch.tensor([list(ids)]), do_sample=False, max_new_tokens=n,
            min_new_tokens=n, pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def peft_logprobs(model_dir: str, adapter_dir: str | None, ids, continuation) -> list[float]:
    """transformers + PEFT's log-probability of each token of `continuation` after `ids`
    (one forward pass over both; without an adapter, the base model's)."""
    import torch

    from support.hf_models import hf_model

    model = hf_model(model_dir) if adapter_dir is None else _peft_model(model_dir, adapter_dir)
    seq = [*ids, *continuation]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0].double()  # [len(seq), V]
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(ids) - 1 + i, t]) for i, t in enumerate(continuation)]
