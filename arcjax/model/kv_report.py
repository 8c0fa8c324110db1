"""What the KV cache costs per token, as the trace summary and `/v1/models` report it.

`kv_cache_report(cfg, kv_dtype)`: bytes one token holds in the paged cache over all layers
(`kv_bytes_per_token`: per-head keys and values, or MLA's one latent and rope key per
layer), the layout's name, and for MLA what per-head keys and values of the same model
would cost (`per_head_kv_bytes_per_token`: the heads' keys and values expanded), so the
saving is stated where the cost is.
"""

from __future__ import annotations

import jax.numpy as jnp

from arcjax.model.model_config import ModelConfig


def kv_cache_report(cfg: ModelConfig, kv_dtype) -> dict:
    """{"kv_layout", "kv_bytes_per_token", and for MLA "per_head_kv_bytes_per_token"}.

    Args:
      cfg: the model as the cache holds it (under tensor parallelism, KV heads repeated to
        fill the devices count once per copy).
      kv_dtype: the pages' dtype.
    """
    itemsize = jnp.dtype(kv_dtype).itemsize
    out = {"kv_layout": "mla_latent" if cfg.is_mla else "per_head",
           "kv_bytes_per_token": cfg.num_layers * cfg.kv_values_per_token() * itemsize}
    if cfg.is_mla:
        out["per_head_kv_bytes_per_token"] = cfg.num_layers * cfg.per_head_kv_values() * itemsize
    return out
