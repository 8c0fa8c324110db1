"""Multi-head latent attention (DeepSeek-V2/V3) as a `flax.nnx` module: its projections, the
latent and rope key it caches, and the two ways its heads are formed.

Shapes (`MLAConfig`): Hq heads; dn = qk_nope_head_dim, dr = qk_rope_head_dim, dv =
v_head_dim, Dl = kv_lora_rank; H the hidden width.

  wq [H, Hq*(dn+dr)] (no query bottleneck), or wq_a [H, r], q_a_norm [r], wq_b [r, Hq*(dn+dr)]
  wkv_a [H, Dl+dr]: the latent (RMS-normed by kv_a_norm [Dl]) and the rope key k_pe
  wkv_b [Dl, Hq*(dn+dv)]: per head, W_uk [Dl, dn] (key up-projection) and W_uv [Dl, dv]
  wo [Hq*dv, H]

`qkv` gives the per-head query [.., T, Hq, dn+dr] (rope on its last dr), the latent
[.., T, 1, Dl] and the roped rope key [.., T, 1, dr]: the two are what the paged cache holds
(`arcjax.model.specs.cache_specs`), one "head" per token and layer. Head h's key is
`[W_uk_h latent, k_pe]`, its value `W_uv_h latent`; attention forms them two ways:

  * absorbed (`absorb`, `values`; the engine's paged step, decode rows and prefill chunks
    alike): `W_uk_h` folds into the query (`q_latent_h = W_uk_h q_nope_h`), so attention is
    one multi-query pass over the latent pages (`pallas_kernels.mla`), and `W_uv_h` folds
    into its output;
  * expanded (`expand`; the dense forward, the independent check): every head's keys and
    values formed explicitly, as transformers does.

Rope: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (`rope_interleave`); the
rope dims are de-interleaved first and rotated in rotate-half layout, which gives every
q . k dot product of the interleaved rotation (both sides are permuted alike).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arcjax.model.layers import RMSNorm, _param, rope, value
from arcjax.model.lora_delta import LayerLoRA
from arcjax.model.model_config import ModelConfig
from arcjax.model.packed_matmul import matmul
from arcjax.model.quant import dense

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm (not rms_norm_eps)


class MLAAttention(nnx.Module):
    """DeepSeek's latent attention projections (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        mla, H, Hq = cfg.mla, cfg.hidden_size, cfg.num_heads
        q_dim = Hq * mla.qk_head_dim
        norm = dict(rngs=rngs, eps=LATENT_NORM_EPS)
        if mla.q_lora_rank is None:
            self.wq = _param(rngs, (H, q_dim), "normal", ("embed", "heads"))
            self.wq_a = self.q_a_norm = self.wq_b = None
        else:
            r = mla.q_lora_rank
            self.wq = None
            self.wq_a = _param(rngs, (H, r), "normal", ("embed", None))
            self.q_a_norm = RMSNorm(cfg, r, None, **norm)
            self.wq_b = _param(rngs, (r, q_dim), "normal", (None, "heads"))
        dl, dr = mla.kv_lora_rank, mla.qk_rope_head_dim
        self.wkv_a = _param(rngs, (H, dl + dr), "normal", ("embed", None))
        self.kv_a_norm = RMSNorm(cfg, dl, None, **norm)
        self.wkv_b = _param(rngs, (dl, Hq * (mla.qk_nope_head_dim + mla.v_head_dim)),
                            "normal", (None, "heads"))
        self.wo = _param(rngs, (Hq * mla.v_head_dim, H), "normal", ("heads", "embed"))

    def sink_logits(self) -> None:
        """Latent attention has no attention sinks."""
        return None

    def _rope(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
        """x [..., T, Hx, dr] -> roped, in rotate-half layout (de-interleaved first when
        the model rotates interleaved pairs)."""
        if self.cfg.mla.rope_interleave:
            x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
        return rope(x, positions, self.cfg, inv_freq)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
            lora: LayerLoRA | None = None, matmul_impl: str = "xla"):
        """x: [..., T, H] normalized -> (q [..., T, Hq, dn+dr], latent [..., T, 1, Dl],
        k_pe [..., T, 1, dr]), rope applied to q's last dr dims and to k_pe.
        `lora`: refused earlier (the engine builds no adapters for latent attention);
        `matmul_impl`: as `Attention.qkv`'s (`arcjax.model.packed_matmul`)."""
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on latent attention")
        cfg, mla = self.cfg, self.cfg.mla
        if self.wq is not None:
            q = matmul(x, value(self.wq), matmul_impl)
        else:
            q = matmul(self.q_a_norm(matmul(x, value(self.wq_a), matmul_impl)),
                       value(self.wq_b), matmul_impl)
        lead, dn, dl = x.shape[:-1], mla.qk_nope_head_dim, mla.kv_lora_rank
        q = q.reshape(*lead, cfg.num_heads, mla.qk_head_dim)
        q = jnp.concatenate([q[..., :dn], self._rope(q[..., dn:], positions, inv_freq)], -1)
        kv = matmul(x, value(self.wkv_a), matmul_impl)  # [..., T, Dl + dr]
        latent = self.kv_a_norm(kv[..., :dl])[..., None, :]  # [..., T, 1, Dl]
        k_pe = self._rope(kv[..., None, dl:], positions, inv_freq)  # [..., T, 1, dr]
        return q, latent, k_pe

    def _up(self, dtype) -> tuple[jax.Array, jax.Array]:
        """(W_uk [Dl, Hq, dn], W_uv [Dl, Hq, dv]) in `dtype`."""
        mla = self.cfg.mla
        w = dense(value(self.wkv_b), dtype).reshape(
            mla.kv_lora_rank, self.cfg.num_heads, mla.qk_nope_head_dim + mla.v_head_dim)
        return w[..., :mla.qk_nope_head_dim], w[..., mla.qk_nope_head_dim:]

    def absorb(self, q: jax.Array) -> tuple[jax.Array, jax.Array]:
        """q [..., T, Hq, dn+dr] -> (q_latent [..., T, Hq, Dl] = W_uk_h q_nope_h, q_rope
        [..., T, Hq, dr]): the query of `pallas_kernels.mla`'s absorbed attention."""
        w_uk, _ = self._up(q.dtype)
        dn = self.cfg.mla.qk_nope_head_dim
        q_latent = jnp.einsum("...hd,lhd->...hl", q[..., :dn], w_uk,
                              preferred_element_type=jnp.float32).astype(q.dtype)
        return q_latent, q[..., dn:]

    def values(self, attn_latent: jax.Array) -> jax.Array:
        """attn_latent [..., T, Hq, Dl] (softmax-weighted latents) -> each head's value
        output [..., T, Hq, dv] (W_uv_h applied)."""
        _, w_uv = self._up(attn_latent.dtype)
        return jnp.einsum("...hl,lhv->...hv", attn_latent, w_uv,
                          preferred_element_type=jnp.float32).astype(attn_latent.dtype)

    def expand(self, latent: jax.Array, k_pe: jax.Array) -> tuple[jax.Array, jax.Array]:
        """latent [..., T, 1, Dl], k_pe [..., T, 1, dr] -> every head's key [..., T, Hq,
        dn+dr] and value [..., T, Hq, dv] (the per-head form transformers computes)."""
        w_uk, w_uv = self._up(latent.dtype)
        c = latent[..., 0, :]  # [..., T, Dl]
        k_nope = jnp.einsum("...l,lhd->...hd", c, w_uk)
        pe = jnp.broadcast_to(k_pe, (*k_nope.shape[:-1], k_pe.shape[-1]))
        return jnp.concatenate([k_nope, pe], -1), jnp.einsum("...l,lhv->...hv", c, w_uv)

    def out(self, attn: jax.Array, lora: LayerLoRA | None = None,
            matmul_impl: str = "xla") -> jax.Array:
        """attn [..., T, Hq, dv] (in the layer input's dtype) -> [..., T, H]."""
        return matmul(attn.reshape(*attn.shape[:-2], -1), value(self.wo), matmul_impl)
