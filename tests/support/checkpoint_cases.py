"""The checkpoint-format tests' shared cases (GGUF, quantized checkpoints, the Hub): two
prompts, their greedy parameters, one small engine geometry, and two greedy references:
transformers reading a GGUF file, and arcjax's `forward_dense` on loaded params."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np

import arcjax

PROMPTS = ([5, 17, 42, 99, 3, 250], [300, 7, 7, 120, 64, 11, 200, 9, 31, 1, 77])
GREEDY = arcjax.SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
ENGINE = dict(max_model_len=128, max_num_seqs=4, num_kv_blocks=64, async_scheduling=False)
_FORWARD_DENSE = jax.jit(arcjax.model.forward_dense, static_argnums=1)  # one compile per cfg


@functools.lru_cache(maxsize=2)  # a test asks for a few continuations of one file in a row
def _gguf_hf_model(path: str):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()


def gguf_hf_greedy(path: str, ids, n: int) -> list[int]:
    """transformers' greedy continuation (n tokens, EOS ignored) of the GGUF file `path`."""
    import torch

    with torch.no_grad():
        out = _gguf_hf_model(path).generate(torch.tensor([list(ids)]), do_sample=False,
                                            max_new_tokens=n, min_new_tokens=n,
                                            pad_token_id=0, eos_token_id=None)
    return out[0, len(ids):].tolist()


def dense_greedy(cfg, params, ids, n: int) -> list[int]:
    """Greedy continuation with `forward_dense` over one fixed padded length (one compile;
    causal attention keeps the padding out of every real position)."""
    length = len(ids) + n
    tokens = np.zeros((1, length), np.int32)
    tokens[0, :len(ids)] = ids
    for pos in range(len(ids), length):
        logits = _FORWARD_DENSE(params, cfg, tokens)
        tokens[0, pos] = int(np.argmax(np.asarray(logits)[0, pos - 1]))
    return tokens[0, len(ids):].tolist()
