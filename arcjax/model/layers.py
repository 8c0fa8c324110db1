"""The decoder's layers as `flax.nnx` modules, each declaring its own parameters.

Every parameter is declared once, where its layer uses it: its shape (one layer's), its
initializer and the logical name of each axis (`nnx.with_partitioning`). The layer stack is
one `Block` built under `nnx.vmap`, which prefixes every layer parameter with the `layers`
axis. The module tree:

  Decoder
    embed           Embed      embedding [V, H] (vocab, embed)
    layers          Block      every parameter stacked [L, ...] (layers, ...)
      attn_norm       RMSNorm  scale [H] (embed)
      attn            Attention  wq [H, Hq*D] (embed, heads), wk, wv [H, Hkv*D] (embed,
                               kv_heads), wo [Hq*D, H] (heads, embed); Qwen2: bq, bk, bv;
                               Llama's attention_bias: bo; Qwen3: q_norm, k_norm [D] (None);
                               gpt-oss: sinks [Hq] (heads)
                      or MLAAttention  DeepSeek's latent attention (arcjax/model/mla_layers.py):
                               wq or wq_a, q_a_norm, wq_b; wkv_a, kv_a_norm, wkv_b, wo
      post_attn_norm  RMSNorm  (Gemma's sandwich norms)
      mlp_norm        RMSNorm
      mlp             MLP      w_gate, w_up [H, I] (embed, mlp), w_down [I, H] (mlp, embed)
                      or MoE   router [H, E] (embed, None); we_gate, we_up [E, H, Im],
                               we_down [E, Im, H] (expert, embed/moe_mlp), `ExpertWeight`s;
                               Qwen2-MoE's shared expert ws_gate, ws_up, ws_down, ws_router;
                               gpt-oss: router_bias [E], be_gate, be_up [E, Im], be_down
                               [E, H] (`ExpertWeight`s); DeepSeek-V3: router_correction [E]
    dense_layers    Block      DeepSeek's first_k_dense_replace layers, stacked [K, ...]
                               apart (their MLP dense; `layers` then holds the other L - K)
      post_mlp_norm   RMSNorm  (Gemma)
    final_norm      RMSNorm
    lm_head         LMHead     kernel [H, V] (embed, vocab); None when tied to the embedding

The params pytree (`arcjax.model.specs.Params`: what every loader produces and every step
takes) is this tree's state laid out flat per layer; `arcjax.model.binding` maps one to the
other (`binding.bind` inside a traced step, `binding.declarations` for the specs).

NOTE: flax is imported by this module and `binding` alone, and they only where a model is
built or traced (`decoder`, `specs.param_specs`): `import flax.nnx` imports optax, which
`import arcjax` must not load.

NOTE: a stacked `ExpertWeight` ([L, E, ...]) is not sliced by the layer scan: the scan hands
each layer its slice of every other parameter and the experts whole, read by (layer, expert)
where they are used (see `arcjax.model.moe`'s NOTE).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from arcjax.model.layer_arrays import layer_slice, select_layer, split_state
from arcjax.model.lora_delta import LayerLoRA
from arcjax.model import moe
from arcjax.model.expert_ffn import ExpertAct
from arcjax.model.model_config import ModelConfig, rope_attention_factor, rope_inv_freq
from arcjax.model.packed_matmul import matmul, tied_matmul
from arcjax.model.quant import embedding_rows, float_dtype
from arcjax.model.row_tiles import RowTiles

NORMAL_STD = 0.02  # the "normal" initializer's standard deviation


def initializer(name: str, std: float = NORMAL_STD):
    """The initializer a parameter declares by name: "normal" (0, std), "ones", "zeros"."""
    return {"normal": nnx.initializers.normal(std), "ones": nnx.initializers.ones,
            "zeros": nnx.initializers.zeros}[name]


class ExpertWeight(nnx.Param):
    """An expert weight, stacked [L, E, ...]: the layer scan passes it whole (see the NOTE)."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], init: str, axes: tuple[str | None, ...],
           kind: type[nnx.Param] = nnx.Param) -> nnx.Param:
    """A parameter (one layer's, for a layer): `shape` drawn by `init`, each axis named by
    `axes`. eager_sharding=False: the names are logical, mapped to a mesh by
    `arcjax.parallel`'s rules when the params are placed, not when a module is built."""
    initial = nnx.with_partitioning(initializer(init), axes)(rngs.params(), shape, jnp.float32)
    return kind(initial, init=init, eager_sharding=False)


def value(param: nnx.Variable):
    """A parameter's value: an array, or a quantized weight (`arcjax.model.quant`).
    (flax 0.12 reads it with `get_value`; earlier versions with `.value`.)"""
    return param.get_value() if hasattr(param, "get_value") else param.value


def rms_norm(x: jax.Array, w: jax.Array, eps: float, unit_offset: bool = False) -> jax.Array:
    """RMSNorm in float32, scaled by `w` (by `1 + w` with `unit_offset`, Gemma's)."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    scale = w.astype(jnp.float32)
    return (xf * (1.0 + scale if unit_offset else scale)).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, cfg: ModelConfig,
         inv_freq: jax.Array | None = None) -> jax.Array:
    """Rotary embedding, Hugging Face's rotate-half layout. x: [..., T, Hx, D];
    inv_freq: [D/2] (default: the model's global rope)."""
    if inv_freq is None:
        inv_freq = jnp.asarray(rope_inv_freq(cfg), jnp.float32)  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., T, D/2]
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]
    factor = rope_attention_factor(cfg)  # YaRN's attention factor (1: none)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis (width `dim`, logical axis `axis`); Gemma's (1 + w) form
    starts at zero, every other at one: each starts as the identity scale."""

    def __init__(self, cfg: ModelConfig, dim: int, axis: str | None, *, rngs: nnx.Rngs,
                 eps: float | None = None):
        # eps: the model's rms_norm_eps unless given (DeepSeek's latent norms: 1e-6)
        self.eps = cfg.rms_norm_eps if eps is None else eps
        self.unit_offset = cfg.norm_unit_offset
        self.scale = _param(rngs, (dim,), "zeros" if cfg.norm_unit_offset else "ones", (axis,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, value(self.scale), self.eps, self.unit_offset)


class Embed(nnx.Module):
    """Token embeddings [V, H]; Gemma scales them by sqrt(hidden)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedding = _param(rngs, (cfg.vocab_size, cfg.hidden_size), "normal",
                                ("vocab", "embed"))

    def __call__(self, token_ids: jax.Array, dtype) -> jax.Array:
        """token_ids [...] int32 -> [..., H] in `dtype`."""
        table = value(self.embedding)  # [V, H]; packed: [H, V] (`quant.embedding_rows`)
        x = embedding_rows(table, token_ids, dtype)
        if self.cfg.scale_embeddings:  # sqrt(hidden) rounded to the table's dtype, as HF does
            x = x * jnp.asarray(self.cfg.hidden_size ** 0.5,
                                float_dtype(table, dtype)).astype(dtype)
        return x


class Attention(nnx.Module):
    """Projections, q/k norms, rope, and the output projection around an `attend` function
    (the paged or the dense attention: the only difference between the two modes)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        H = cfg.hidden_size
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.wq = _param(rngs, (H, q_dim), "normal", ("embed", "heads"))
        self.wk = _param(rngs, (H, kv_dim), "normal", ("embed", "kv_heads"))
        self.wv = _param(rngs, (H, kv_dim), "normal", ("embed", "kv_heads"))
        self.wo = _param(rngs, (q_dim, H), "normal", ("heads", "embed"))
        bias = cfg.qkv_bias
        self.bq = _param(rngs, (q_dim,), "zeros", ("heads",)) if bias else None
        self.bk = _param(rngs, (kv_dim,), "zeros", ("kv_heads",)) if bias else None
        self.bv = _param(rngs, (kv_dim,), "zeros", ("kv_heads",)) if bias else None
        self.bo = _param(rngs, (H,), "zeros", ("embed",)) if cfg.o_bias else None
        norm = functools.partial(RMSNorm, cfg, cfg.head_dim, None, rngs=rngs)
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None
        # gpt-oss: one logit per query head that joins every softmax denominator
        self.sinks = (_param(rngs, (cfg.num_heads,), "zeros", ("heads",))
                      if cfg.attention_sinks else None)

    def sink_logits(self) -> jax.Array | None:
        """[Hq] float32 attention sinks, or None."""
        return None if self.sinks is None else value(self.sinks).astype(jnp.float32)

    def qkv(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
            lora: LayerLoRA | None = None, matmul_impl: str = "xla"):
        """x: [..., T, H] normalized -> q [..., T, Hq, D], k and v [..., T, Hkv, D].
        `lora`: the LoRA adapters' per-token deltas (x is then [T, H]); `matmul_impl`:
        how packed weights multiply (`arcjax.model.packed_matmul.IMPLS`, resolved)."""
        cfg, dt = self.cfg, x.dtype
        # a quantized or packed weight is dequantized inside the step (or read packed by
        # the W4A16 kernel: `packed_matmul`)
        q, k, v = (matmul(x, value(w), matmul_impl) for w in (self.wq, self.wk, self.wv))
        if lora is not None:
            q, k, v = lora.add("wq", x, q), lora.add("wk", x, k), lora.add("wv", x, v)
        if self.bq is not None:
            q, k, v = (q + value(self.bq).astype(dt), k + value(self.bk).astype(dt),
                       v + value(self.bv).astype(dt))
        lead = x.shape[:-1]
        q = q.reshape(*lead, cfg.num_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_kv_heads, cfg.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return rope(q, positions, cfg, inv_freq), rope(k, positions, cfg, inv_freq), v

    def out(self, attn: jax.Array, lora: LayerLoRA | None = None,
            matmul_impl: str = "xla") -> jax.Array:
        """attn [..., T, Hq, D] (in the layer input's dtype) -> [..., T, H]."""
        dtype = attn.dtype
        attn = attn.reshape(*attn.shape[:-2], -1)
        out = matmul(attn, value(self.wo), matmul_impl)
        if lora is not None:
            out = lora.add("wo", attn, out)
        if self.bo is not None:
            out = out + value(self.bo).astype(dtype)
        return out


class MLP(nnx.Module):
    """The gated MLP: act(h @ w_gate) * (h @ w_up) @ w_down (SwiGLU or GeGLU)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.act = cfg.hidden_act
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.w_gate = _param(rngs, (H, I), "normal", ("embed", "mlp"))
        self.w_up = _param(rngs, (H, I), "normal", ("embed", "mlp"))
        self.w_down = _param(rngs, (I, H), "normal", ("mlp", "embed"))

    def __call__(self, h: jax.Array, lora: LayerLoRA | None = None,
                 matmul_impl: str = "xla") -> jax.Array:
        """h [..., H] -> [..., H]; `lora`: the LoRA adapters' deltas (h is then [T, H])."""
        gate, up = (matmul(h, value(self.w_gate), matmul_impl),
                    matmul(h, value(self.w_up), matmul_impl))
        if lora is not None:
            gate, up = lora.add("w_gate", h, gate), lora.add("w_up", h, up)
        h = moe.activation(gate, self.act) * up
        out = matmul(h, value(self.w_down), matmul_impl)
        return out if lora is None else lora.add("w_down", h, out)


class MoE(nnx.Module):
    """A mixture of experts (`arcjax.model.moe.moe_mlp`: route, grouped GEMMs), plus
    Qwen2-MoE's sigmoid-gated shared expert."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        H, E, Im = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        self.router = _param(rngs, (H, E), "normal", ("embed", None))
        expert = functools.partial(_param, rngs, init="normal", kind=ExpertWeight)
        self.we_gate = expert((E, H, Im), axes=("expert", "embed", "moe_mlp"))
        self.we_up = expert((E, H, Im), axes=("expert", "embed", "moe_mlp"))
        self.we_down = expert((E, Im, H), axes=("expert", "moe_mlp", "embed"))
        Is = cfg.shared_expert_intermediate_size
        shared = bool(Is)
        self.ws_gate = _param(rngs, (H, Is), "normal", ("embed", "mlp")) if shared else None
        self.ws_up = _param(rngs, (H, Is), "normal", ("embed", "mlp")) if shared else None
        self.ws_down = _param(rngs, (Is, H), "normal", ("mlp", "embed")) if shared else None
        gated = shared and cfg.shared_expert_gate  # Qwen2-MoE's; DeepSeek's are ungated
        self.ws_router = _param(rngs, (H, 1), "normal", ("embed", None)) if gated else None
        # DeepSeek-V3's noaux_tc score correction bias (moves the choice, not the weights)
        self.router_correction = (_param(rngs, (E,), "zeros", (None,))
                                  if cfg.router.correction_bias else None)
        # gpt-oss: the router's bias and every expert's gate, up and down biases
        self.router_bias = (_param(rngs, (E,), "zeros", (None,)) if cfg.router.bias
                            else None)
        bias = functools.partial(_param, rngs, init="zeros", kind=ExpertWeight)
        on = cfg.expert_bias
        self.be_gate = bias((E, Im), axes=("expert", "moe_mlp")) if on else None
        self.be_up = bias((E, Im), axes=("expert", "moe_mlp")) if on else None
        self.be_down = bias((E, H), axes=("expert", "embed")) if on else None
        self.act = (ExpertAct(cfg.expert_act) if cfg.swiglu_limit is None
                    else ExpertAct(cfg.expert_act, cfg.swiglu_alpha, cfg.swiglu_limit))

    def __call__(self, h: jax.Array, *, valid: jax.Array, layer: jax.Array, impl: str,
                 parallel) -> tuple[jax.Array, jax.Array]:
        """h [..., H]; valid [...] bool, real tokens (padding goes to no expert); layer: []
        int32, which of the stack's layers' experts (they are stacked [L, E, ...] over the
        stack's layers, `Block.first_layer`); impl: `moe.IMPLS`;
        parallel: an `arcjax.parallel.TensorParallel` or None.
        Returns (out [..., H], tokens per expert [E] int32)."""
        cfg = self.cfg
        names = ("router", "router_bias", "router_correction", "ws_gate", "ws_up", "ws_down",
                 "ws_router")
        weights = {name: value(getattr(self, name)) for name in names
                   if getattr(self, name) is not None}
        experts = {name: value(getattr(self, name))
                   for name in moe.EXPERT_WEIGHTS + moe.EXPERT_BIASES
                   if getattr(self, name) is not None}
        lead = h.shape[:-1]
        out, counts = moe.moe_mlp(h.reshape(-1, h.shape[-1]), weights, experts, layer,
                                  num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
                                  renormalize=cfg.norm_topk_prob, act=self.act,
                                  valid=valid.reshape(-1), impl=impl, parallel=parallel,
                                  router=cfg.router, shared_act=cfg.hidden_act)
        return out.reshape(*lead, -1), counts


class Block(nnx.Module):
    """One decoder layer: attention (per-head, or DeepSeek's latent attention,
    `arcjax.model.mla_layers`) and MLP (or experts), each behind its norm, residuals.

    `attention`: the attention module's class (`Attention`, or `MLAAttention` for a latent
    attention model: `arcjax.model.binding` passes it, the module that imports both);
    `experts`: this layer's MLP is a mixture of experts (default: the model's kind);
    `first_layer`: the model layer its stack starts at (a model mixing dense and expert
    layers stacks each kind apart, `Decoder`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention: type | None = None,
                 experts: bool | None = None, first_layer: int = 0):
        norm = functools.partial(RMSNorm, cfg, cfg.hidden_size, "embed", rngs=rngs)
        sandwich = cfg.sandwich_norms
        experts = cfg.is_moe if experts is None else experts
        self.cfg, self.first_layer = cfg, first_layer
        self.attn_norm = norm()
        self.attn = (attention or Attention)(cfg, rngs=rngs)
        self.post_attn_norm = norm() if sandwich else None
        self.mlp_norm = norm()
        self.mlp = MoE(cfg, rngs=rngs) if experts else MLP(cfg, rngs=rngs)
        self.post_mlp_norm = norm() if sandwich else None

    def __call__(self, x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attend, *,
                 valid: jax.Array, layer: jax.Array, moe_impl: str, parallel,
                 lora: LayerLoRA | None = None, matmul_impl: str = "xla",
                 rows: RowTiles | None = None):
        """x [..., T, H] -> (x, aux, tokens per expert [E] or None).

        `attend(q, k, v) -> ([..., T, Hq, Dv], aux)` is the only difference between the
        paged and dense modes (for latent attention k and v are the latent and the rope
        key, `MLAAttention.qkv`); positions [..., T]; inv_freq [D/2] (this layer's rope);
        valid, layer (the model's layer index), moe_impl, parallel: for the experts
        (`MoE`); lora: the LoRA adapters' deltas of the projections (the paged mode's; a
        mixture of experts' attention only); matmul_impl: how packed projections multiply
        (`arcjax.model.packed_matmul`). rows: None, or the fixed row tiles
        (`arcjax.model.row_tiles`) the row-wise parts (norms, projections, MLP or experts,
        residuals) run over: batch-invariant mode, x [T, H], without LoRA."""
        with jax.named_scope("qkv"):
            if rows is None:
                q, k, v = self.attn.qkv(self.attn_norm(x), positions, inv_freq, lora,
                                        matmul_impl)
            else:
                q, k, v = rows.map(lambda x, p: self.attn.qkv(self.attn_norm(x), p, inv_freq,
                                                              None, matmul_impl), x, positions)
        with jax.named_scope("attention"):
            attn, aux = attend(q, k, v)

        def after_attention(x, attn, valid, lora):
            with jax.named_scope("o_proj"):
                x = self._o_proj(x, attn, lora, matmul_impl)
            with jax.named_scope("mlp"):
                return self._mlp(x, valid, lora, layer=layer, moe_impl=moe_impl,
                                 parallel=parallel, matmul_impl=matmul_impl)

        if rows is None:
            x, stats = after_attention(x, attn, valid, lora)
        else:  # one tile loop: the output projection, then the MLP
            x, stats = rows.map_summed(lambda x, a, v: after_attention(x, a, v, None),
                                       x, attn, valid)
        return x, aux, stats

    def _o_proj(self, x: jax.Array, attn: jax.Array, lora: LayerLoRA | None,
                matmul_impl: str) -> jax.Array:
        """The residual stream after attention: x [..., T, H], attn [..., T, Hq, D]."""
        out = self.attn.out(attn.astype(x.dtype), lora, matmul_impl)
        if self.post_attn_norm is not None:
            out = self.post_attn_norm(out)
        return x + out

    def _mlp(self, x: jax.Array, valid: jax.Array, lora: LayerLoRA | None, *,
             layer: jax.Array, moe_impl: str, parallel, matmul_impl: str):
        """The residual stream after the MLP (or experts), and tokens per expert or None."""
        h = self.mlp_norm(x)
        if isinstance(self.mlp, MoE):
            h, stats = self.mlp(h, valid=valid, layer=layer - self.first_layer,
                                impl=moe_impl, parallel=parallel)
        else:  # a dense layer of a mixture of experts routes no token: zero counts
            h = self.mlp(h, lora, matmul_impl)
            stats = (jnp.zeros(self.cfg.num_experts, jnp.int32) if self.cfg.is_moe
                     else None)
        if self.post_mlp_norm is not None:
            h = self.post_mlp_norm(h)
        return x + h, stats


class LMHead(nnx.Module):
    """The vocabulary projection of an untied model."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.kernel = _param(rngs, (cfg.hidden_size, cfg.vocab_size), "normal",
                             ("embed", "vocab"))


class Decoder(nnx.Module):
    """The whole model: embedding, the stacked layers, final norm and head.

    A model whose first layers are dense and the rest mixtures of experts (DeepSeek's
    `first_k_dense_replace`, `ModelConfig.num_dense_layers`) stacks each kind apart:
    `dense_layers` [K, ...] then `layers` [L - K, ...], scanned one after the other.
    `attention`: every layer's attention class (`Block`; None: `Attention`)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, attention: type | None = None):
        self.cfg = cfg
        self.embed = Embed(cfg, rngs=rngs)

        def stack(count: int, **kind):
            @nnx.vmap(in_axes=0, out_axes=0,
                      transform_metadata={nnx.PARTITION_NAME: "layers"})
            def build(key):
                return Block(cfg, rngs=nnx.Rngs(params=key), attention=attention, **kind)

            return build(jax.random.split(rngs.params(), count))

        dense = cfg.num_dense_layers
        self.dense_layers = stack(dense, experts=False) if dense else None
        self.layers = stack(cfg.num_layers - dense, first_layer=dense)
        self.final_norm = RMSNorm(cfg, cfg.hidden_size, "embed", rngs=rngs)
        self.lm_head = None if cfg.tie_word_embeddings else LMHead(cfg, rngs=rngs)

    def _stacks(self) -> list[tuple[int, int, nnx.Module]]:
        """(first layer, layer count, stacked Blocks) of each stack, in layer order."""
        dense = self.cfg.num_dense_layers
        out = [(0, dense, self.dense_layers)] if dense else []
        return out + [(dense, self.cfg.num_layers - dense, self.layers)]

    def scan_layers(self, step, carry, xs, unrolled: bool = False):
        """`jax.lax.scan` of `step(block, carry, x) -> (carry, y)` over the layers, where
        `block` is one layer's `Block` (its expert weights whole, see the NOTE) and `x` the
        layer's slice of `xs` ([L, ...] arrays). Returns (carry, ys stacked [L, ...]).

        Parameters held one array per layer (`LayerArrays`, arcjax/model/layer_arrays.py):
        with `unrolled` (static), the layers run one after the other, each reading its own
        arrays in place; else the scan's body picks layer i's arrays (`select_layer`: one
        copy of them, as a scan's slice of a stack is). `unrolled` needs them held so."""
        ys = []
        for first, count, layers in self._stacks():
            graphdef, experts, stacked = nnx.split(layers, ExpertWeight, ...)

            def body(carry, xs, graphdef=graphdef, experts=experts):
                layer_state, x = xs
                return step(nnx.merge(graphdef, experts, layer_state), carry, x)

            part = jax.tree.map(lambda a, first=first, count=count: a[first:first + count], xs)
            split = split_state(stacked)
            if unrolled and not split:
                raise ValueError("the unrolled layer loop reads the layer parameters held "
                                 "one array per layer (layer_arrays.split_layers)")
            if unrolled:
                outs = []
                for i in range(count):
                    carry, y = body(carry, (layer_slice(stacked, i),
                                            jax.tree.map(lambda a, i=i: a[i], part)))
                    outs.append(y)
                y = jax.tree.map(lambda *y: jnp.stack(y), *outs)
            elif split:  # the scan carries layer i's index; its arrays are picked by it
                carry, y = jax.lax.scan(
                    lambda carry, xs, stacked=stacked, body=body: body(
                        carry, (select_layer(stacked, xs[0]), xs[1])),
                    carry, (jnp.arange(count), part))
            else:
                carry, y = jax.lax.scan(body, carry, (stacked, part))
            ys.append(y)
        return carry, (ys[0] if len(ys) == 1
                       else jax.tree.map(lambda *y: jnp.concatenate(y), *ys))

    def block(self, index: int) -> Block:
        """Layer `index`'s `Block` alone (its slice of each layer parameter, the experts
        whole), for a caller that runs one layer outside the scan (a benchmark)."""
        first, _, layers = next(s for s in reversed(self._stacks()) if s[0] <= index)
        graphdef, experts, stacked = nnx.split(layers, ExpertWeight, ...)
        return nnx.merge(graphdef, experts, layer_slice(stacked, index - first)
                         if split_state(stacked)
                         else jax.tree.map(lambda w: w[index - first], stacked))

    def head(self, h: jax.Array, parallel=None, matmul_impl: str = "xla") -> jax.Array:
        """Final norm, vocabulary projection and (Gemma 2) soft-cap: h [..., H] (the last
        layer's output) -> logits [..., V] float32, whole rows on every device."""
        cfg = self.cfg
        with jax.named_scope("lm_head"):
            h = self.final_norm(h)
            logits = (tied_matmul(h, value(self.embed.embedding), matmul_impl)
                      if self.lm_head is None
                      else matmul(h, value(self.lm_head.kernel), matmul_impl))  # [..., V]
            logits = logits.astype(jnp.float32)
            if cfg.final_logit_softcap is not None:
                cap = cfg.final_logit_softcap
                logits = cap * jnp.tanh(logits / cap)
        if parallel is not None:
            # Keep the projection split by vocabulary (else GSPMD may all-gather a tied
            # embedding's whole table), then gather the rows: sampling reads whole rows.
            axes = (None,) * (logits.ndim - 1) + ("vocab",)
            logits = jax.lax.with_sharding_constraint(logits, parallel.sharding(axes))
            logits = jax.lax.with_sharding_constraint(logits, parallel.replicated)
        return logits
