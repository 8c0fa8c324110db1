"""FP8 KV-cache scales calibrated from one prefill, for checkpoints that bring none.

FP8 pages hold `k / k_scale` and `v / v_scale` in e4m3 (one scale per layer for K, one for
V; `pallas_kernels.write_kv`). e4m3 keeps 3 mantissa bits from 2**-6 up to 448 and has
subnormals below: with a scale of 1.0, values much smaller than one (V in most layers) lose
their relative precision, and values past 448 saturate. Where scales come from:

1. the checkpoint's `self_attn.k_scale` / `v_scale` (`quantized_checkpoint.read_kv_scales`);
2. otherwise `calibrated_kv_scales`: the engine's first prefill, run when it is built on a
   fixed calibration prompt (`CALIBRATION_TEXT`, or fixed token ids without a tokenizer),
   gives each layer's max |K| and max |V| (`decoder.forward_dense(kv_amax=True)`); the
   scale is the power of two at or above `HEADROOM * amax / 448`, so values up to
   HEADROOM times the calibration's largest still fit (beyond it they saturate, never
   NaN).

A power of two moves e4m3's range without moving its grid: every value inside both ranges
rounds exactly as it would at scale 1.0 (and dequantizes exactly), so calibrated scales
never cost precision against 1.0; they gain it for values below e4m3's smallest normal at
1.0 (2**-6: V in many layers) and keep values past 448 from saturating. A scale that is not
a power of two shifts every value against the grid: on SmolLM2-135M, HEADROOM * amax / 448
itself gave +0.69% perplexity against +0.57% at 1.0 (RESULTS.md).

The prefill runs once, at build time, on a fixed prompt rather than on the first request's:
the scales then never depend on which request came first, a run is reproducible, and no
step changes its scales mid-run.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.model.decoder import forward_dense
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import Params

FP8_MAX = 448.0  # e4m3fn's largest finite value
HEADROOM = 2.0
CALIBRATION_TOKENS = 256
CALIBRATION_TEXT = (
    "The committee met on Tuesday to review the budget for the coming year. After a long "
    "discussion about roads, schools and the new library, the members agreed to postpone "
    "the final vote until more figures were available.\n\n"
    "def moving_average(values, window):\n"
    "    \"\"\"Return the mean of each run of `window` consecutive values.\"\"\"\n"
    "    total = sum(values[:window])\n"
    "    out = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        out.append(total / window)\n"
    "    return out\n\n"
    "Q: What is the capital of France?\nA: Paris is the capital and largest city of France, "
    "on the river Seine. In 2024 it hosted the Summer Olympic Games; about 2.1 million "
    "people live in the city itself and over 12 million in its metropolitan area.\n"
)


def calibration_ids(tokenizer, cfg: ModelConfig) -> np.ndarray:
    """[1, n] token ids of the calibration prompt: `CALIBRATION_TEXT` through the model's
    tokenizer (its BOS first when it has one), else fixed ids spread over the vocabulary;
    at most CALIBRATION_TOKENS and the model's context."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT, add_special_tokens=True)
    else:
        ids = (np.arange(CALIBRATION_TOKENS) * 7919 + 3) % cfg.vocab_size
    ids = [i for i in ids if 0 <= i < cfg.vocab_size]
    n = min(CALIBRATION_TOKENS, cfg.max_position_embeddings, len(ids))
    return np.asarray(ids[:n], np.int32).reshape(1, n)


@functools.partial(jax.jit, static_argnames=("cfg", "dtype"))
def _kv_amax(params: Params, token_ids: jax.Array, *, cfg: ModelConfig, dtype) -> jax.Array:
    _, amax = forward_dense(params, cfg, token_ids, dtype, kv_amax=True)
    return amax  # [2, L]


def calibrated_kv_scales(cfg: ModelConfig, params: Params, token_ids: np.ndarray,
                         dtype) -> np.ndarray:
    """[2, L] float32 K and V scales per layer from one prefill of `token_ids` [1, n]:
    powers of two (see the module docstring); a layer whose K or V is all zero keeps 1.0."""
    amax = np.asarray(jax.device_get(_kv_amax(params, jnp.asarray(token_ids), cfg=cfg,
                                              dtype=jnp.dtype(dtype))), np.float32)
    wanted = HEADROOM * np.where(amax > 0, amax, FP8_MAX / HEADROOM) / FP8_MAX
    return np.exp2(np.ceil(np.log2(wanted))).astype(np.float32)
