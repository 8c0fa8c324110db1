"""The decoder's two modes: the engine's paged step and the dense forward, over a params pytree.

The layers are `flax.nnx` modules (`arcjax.model.layers`: embedding, attention, MLP or
experts, norms, head); each function here takes the plain params pytree, puts it into the
module tree while tracing (`_model`), and runs the same layers in one of two ways that
differ only in attention:

1. `forward(params, cache, batch, cfg=..., attn_impl=...)`: the engine's step. A flat
   ragged batch of T tokens from S sequences (decode rows and prompt chunks mixed),
   K/V written into the paged cache through `batch.slot_mapping`, attention through
   `pallas_kernels.paged_attention` (bottom-right causal) of one `AttentionInputs` per
   layer (`_attention_inputs`), logits only for `batch.logits_rows`.
2. `forward_dense(params, cfg, token_ids)`: plain causal attention over whole
   sequences `[B, L]`, for training and as an independent check.

The layer loop is one `lax.scan` over the stacked layers (`Decoder.scan_layers`), or, on
the CPU, the layers unrolled over weights held one array per layer (`layer_loop`,
arcjax/model/layer_arrays.py). Per-layer
differences ride along it as arrays: each layer's attention window (sliding or global,
`ModelConfig.layer_windows`), which rope it uses (Gemma 3's local and global bases), and its
KV cache group and slot (arcjax/model/kv_layout.py: a hybrid model's sliding and full layers
read their own block tables over one pool). Mixture-of-experts layers (`arcjax.model.moe`)
also return how many tokens each expert received, per layer (`forward_with_stats`).

Every parameter is declared once, by its module (`arcjax.model.layers`); the cache layout
in `arcjax.model.specs`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels import mla as mla_kernels
from pallas_kernels.backends import Choice
from pallas_kernels.mla_inputs import MLAInputs
from arcjax.model.lora_delta import LoRAWeights
from arcjax.model.kv_layout import KVLayout, kv_layout
from arcjax.model.model_config import ModelConfig, rope_inv_freq
from arcjax.model.row_tiles import RowTiles
from arcjax.model.specs import Cache, Params

KV_AXES = (None, "kv_heads", None)  # logical axes of this step's keys / values [T, Hkv, D]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepBatch:
    """Device inputs of one engine step, padded to a (T, S) bucket."""

    token_ids: jax.Array  # [T] int32
    positions: jax.Array  # [T] int32, absolute position of each token
    # [G, T] int32, per KV cache group the slot of each token (block * block_size +
    # offset in that group's table); padding: out of range
    slot_mapping: jax.Array
    cu_seqlens_q: jax.Array  # [S+1] int32
    kv_lens: jax.Array  # [S] int32, keys per sequence, this step's included
    block_tables: jax.Array  # [G, S, max_blocks] int32, per KV cache group
    num_seqs: jax.Array  # [] int32, real sequences (the rest is padding)
    logits_rows: jax.Array  # [S] int32, token row whose logits sequence s needs


def layer_constants(cfg: ModelConfig, layout: KVLayout | None = None) -> dict:
    """What differs between layers besides their weights, stacked on the layer axis:
    `window` [L] int32 (only when some layer slides), `inv_freq` [L, D/2] float32, and
    with a KV `layout` each layer's KV cache group and slot, `kv_group`, `kv_slot` [L]
    int32 (arcjax/model/kv_layout.py)."""
    out = {}
    if layout is not None:
        out["kv_group"] = jnp.asarray(layout.layer_group, jnp.int32)
        out["kv_slot"] = jnp.asarray(layout.layer_slot, jnp.int32)
    windows = cfg.layer_windows()
    if windows is not None:
        out["window"] = jnp.asarray(windows, jnp.int32)
    inv = jnp.asarray(rope_inv_freq(cfg), jnp.float32)
    if cfg.local_rope_theta is not None and cfg.sliding_layers:
        local = jnp.asarray(rope_inv_freq(cfg, local=True), jnp.float32)
        sliding = jnp.asarray(cfg.sliding_layers)[:, None]
        out["inv_freq"] = jnp.where(sliding, local, inv)  # [L, D/2]
    else:
        out["inv_freq"] = jnp.broadcast_to(inv, (cfg.num_layers, inv.shape[0]))
    return out


def _model(cfg: ModelConfig, params: Params):
    """The decoder module of `cfg` holding `params` (`arcjax.model.binding.bind`), built where
    a step is traced: flax is imported here, not by `import arcjax`."""
    from arcjax.model import binding

    return binding.bind(cfg, params)


def lm_head(params: Params, cfg: ModelConfig, h: jax.Array, parallel=None,
            matmul_impl: str = "xla") -> jax.Array:
    """Final norm, vocabulary projection and (Gemma 2) soft-cap: h [..., H] (the last
    layer's output) -> logits [..., V] float32, whole rows on every device."""
    return _model(cfg, params).head(h, parallel, matmul_impl)


def _attention_inputs(cfg: ModelConfig, *, q: jax.Array, k_pages: jax.Array,
                     v_pages: jax.Array, block_tables: jax.Array, kv_lens: jax.Array,
                     cu_seqlens_q: jax.Array, num_seqs: jax.Array, window: jax.Array | None,
                     k_scale: jax.Array | None, v_scale: jax.Array | None,
                     max_q_len: int | None, sinks: jax.Array | None = None,
                     batch_invariant: bool = False) -> pallas_kernels.AttentionInputs:
    """One layer's attention call as `forward_with_stats` makes it (and `attention_choice`
    resolves it): the arrays as given, with the model's softmax scale and soft-cap.

    Args:
      q: [T, Hq, D]; k_pages, v_pages: the paged cache (every slot's pages, [P * num_blocks,
        block_size, Hkv, D]); block_tables: [S, max_blocks] this layer's page ids; kv_lens,
        cu_seqlens_q, num_seqs: the step's (`StepBatch`); window: [] int32, the layer's
        window (None when no layer slides); k_scale, v_scale: [] float32, FP8 pages'
        scales of this layer (None for unscaled pages); max_q_len: the bucket's chunk bound;
        sinks: [Hq] float32, the layer's attention sinks (gpt-oss; None without);
        batch_invariant: the xla path's fixed tiles (`AttentionInputs.batch_invariant`).
    """
    return pallas_kernels.AttentionInputs.create(
        q=q, k_pages=k_pages, v_pages=v_pages, block_tables=block_tables, kv_lens=kv_lens,
        cu_seqlens_q=cu_seqlens_q, num_seqs=num_seqs, sm_scale=cfg.sm_scale,
        sliding_window=window, logit_softcap=cfg.attn_logit_softcap, k_scale=k_scale,
        v_scale=v_scale, max_q_len=max_q_len, sinks=sinks, batch_invariant=batch_invariant)


def attention_impl(cache: Cache, **bucket) -> str:
    """The attention implementation `forward_with_stats` runs for a bucket:
    `attention_choice(cache, **bucket).impl`."""
    return attention_choice(cache, **bucket).impl


def attention_choice(cache: Cache, *, cfg: ModelConfig, attn_impl: str, tokens: int,
                     max_q_len: int | None, dtype, parallel=None,
                     platform: str | None = None, batch_invariant: bool = False) -> Choice:
    """The attention implementation `forward_with_stats` runs for a bucket of `tokens`
    rows whose chunks are at most `max_q_len` long: `attn_impl` itself, or what "auto"
    resolves to for the same inputs, per device under `parallel`, and whether a recorded
    GPU pass vouches for it (`pallas_kernels.choose_inputs`).

    Args:
      cache: the paged cache the step runs over (its page shape and dtype, its scales).
      dtype: the compute dtype (q's).
      platform: where the step runs; None = the default backend.
      batch_invariant: the step's batch-invariant mode ("auto" picks among the
        implementations that have one).
    """
    k = cache["k"]  # [P * num_blocks, block_size, Hkv, D] (P slots)
    tp = parallel.tp if parallel is not None else 1
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    if cfg.is_mla:  # latent attention: its own implementations (`pallas_kernels.mla`)
        return _latent_choice(cache, cfg=cfg, attn_impl=attn_impl, tokens=tokens,
                              max_q_len=max_q_len, dtype=dtype, platform=platform, tp=tp)
    q = sds((tokens, cfg.num_heads // tp, cfg.head_dim), dtype)
    pages = sds((k.shape[0], k.shape[1], k.shape[2] // tp, k.shape[3]), k.dtype)
    scale = sds((), jnp.float32) if "k_scale" in cache else None
    # The batch's index arrays are one-sequence stand-ins: resolving reads only q's and the
    # pages' shapes and dtypes, the settings, and which options are given.
    inputs = _attention_inputs(
        cfg, q=q, k_pages=pages, v_pages=pages, block_tables=sds((1, 1), i32),
        kv_lens=sds((1,), i32), cu_seqlens_q=sds((2,), i32), num_seqs=sds((), i32),
        window=sds((), i32) if cfg.layer_windows() is not None else None, k_scale=scale,
        v_scale=scale, max_q_len=max_q_len,
        sinks=sds((cfg.num_heads // tp,), jnp.float32) if cfg.attention_sinks else None,
        batch_invariant=batch_invariant)
    return pallas_kernels.choose_inputs(attn_impl, inputs, platform=platform)


def _latent_inputs(cfg: ModelConfig, *, q_latent, q_rope, latent_pages, rope_pages,
                   block_tables, kv_lens, cu_seqlens_q, num_seqs, max_q_len) -> MLAInputs:
    """One latent attention layer's call (pages [P * num_blocks, block_size, D] each)."""
    return MLAInputs.create(q_latent=q_latent, q_rope=q_rope, latent_pages=latent_pages,
                            rope_pages=rope_pages, block_tables=block_tables, kv_lens=kv_lens,
                            cu_seqlens_q=cu_seqlens_q, num_seqs=num_seqs,
                            sm_scale=cfg.sm_scale, max_q_len=max_q_len)


def _latent_choice(cache: Cache, *, cfg: ModelConfig, attn_impl: str, tokens: int,
                   max_q_len: int | None, dtype, platform: str | None, tp: int) -> Choice:
    """`attention_choice` of a latent attention model (`pallas_kernels.mla.MLA_IMPLS`,
    `choose_mla_impl`: verified when a recorded GPU pass vouches for the kernel): per
    device, its `num_heads // tp` heads over the whole latent pages."""
    sds, i32 = jax.ShapeDtypeStruct, jnp.int32
    latent, rope = cache["k"], cache["v"]  # [P * num_blocks, block_size, 1, Dl / Dr]
    heads = cfg.num_heads // tp
    inputs = _latent_inputs(
        cfg, q_latent=sds((tokens, heads, latent.shape[3]), dtype),
        q_rope=sds((tokens, heads, rope.shape[3]), dtype),
        latent_pages=sds(latent.shape[:2] + latent.shape[3:], latent.dtype),
        rope_pages=sds(rope.shape[:2] + rope.shape[3:], rope.dtype),
        block_tables=sds((1, 1), i32), kv_lens=sds((1,), i32), cu_seqlens_q=sds((2,), i32),
        num_seqs=sds((), i32), max_q_len=max_q_len)
    return mla_kernels.choose_mla_impl(attn_impl, inputs, platform=platform)


def forward(params: Params, cache: Cache, batch: StepBatch, *, cfg: ModelConfig,
            attn_impl: str = "auto", dtype=jnp.float32,
            max_q_len: int | None = None, parallel=None,
            kv: KVLayout | None = None) -> tuple[jax.Array, Cache]:
    """One ragged step over the paged cache (`forward_with_stats` without the statistics).

    Returns:
      logits [S, V] float32 at `batch.logits_rows`, and the updated cache.
    """
    logits, cache, _ = forward_with_stats(params, cache, batch, cfg=cfg, attn_impl=attn_impl,
                                          dtype=dtype, max_q_len=max_q_len, parallel=parallel,
                                          kv=kv)
    return logits, cache


def forward_with_stats(params: Params, cache: Cache, batch: StepBatch, *, cfg: ModelConfig,
                       attn_impl: str = "auto", dtype=jnp.float32,
                       max_q_len: int | None = None, parallel=None, moe_impl: str = "auto",
                       head: bool = True, kv: KVLayout | None = None,
                       lora: LoRAWeights | None = None, lora_impl: str = "masked",
                       matmul_impl: str = "xla", batch_invariant: bool = False,
                       layer_loop: str = "scan"
                       ) -> tuple[jax.Array, Cache, jax.Array | None]:
    """One ragged step over the paged cache.

    `max_q_len` (static) bounds every sequence's chunk length in this batch (1 for a
    decode-only bucket); it lets the attention kernel size its query tiles.
    `parallel` (static; an `arcjax.parallel.TensorParallel` or None): with it, `write_kv`
    and attention run under `shard_map` over the KV-head axis (a Pallas kernel cannot be
    partitioned by GSPMD), experts under `shard_map` over the expert axis
    (`arcjax.model.moe.moe_mlp`), and the logits are gathered to every device.
    `moe_impl` (static): the grouped GEMM of expert layers (`arcjax.model.moe.IMPLS`).
    `head` (static): False returns the last layer's hidden states at `batch.logits_rows`
    [S, H] instead of logits, for a caller that applies `lm_head` to a few rows at a time
    (prompt log-probabilities over a 256k vocabulary).
    `kv` (static): the KV layout (arcjax/model/kv_layout.py); None = one table for every
    layer. Layer l reads group `layer_group[l]`'s tables and slot mapping and owns the
    pages of slot `layer_slot[l]`: both ride along the layer scan (traced per layer), so
    one executable serves every layer.
    `lora`: the LoRA adapters' slots and each token's slot (`arcjax.model.lora_delta`), or
    None; `lora_impl` (static): their delta's implementation (`lora_delta.IMPLS`).
    `matmul_impl` (static): how packed projections multiply (`packed_matmul.IMPLS`,
    resolved: "xla", or the W4A16 kernel in decode-sized matmuls).
    `batch_invariant` (static): every row computed the same way whatever else the step
    holds (docs/design/batch-invariance.md): the row-wise parts of each layer and the head
    over fixed row tiles (`token_rows`, `head_rows`), attention on the xla path's fixed
    tiles and key blocks; not with LoRA or a mesh.
    `layer_loop` (static): "scan" (one `lax.scan` over the layers) or "unrolled" (the
    layers one after the other, over layer parameters held one array per layer:
    arcjax/model/layer_arrays.py); the same values either way.

    Returns:
      logits [S, V] float32 at `batch.logits_rows` (or hidden states, see `head`), the
      updated cache, and tokens per expert [L, E] int32 (None for a dense model).
    """
    model = _model(cfg, params)
    x = model.embed(batch.token_ids, dtype)  # [T, H]
    kv = kv if kv is not None else kv_layout(cfg, hybrid=False)
    block_size = cache["k"].shape[1]
    num_blocks = cache["k"].shape[0] // kv.num_slots  # blocks per slot
    layer_slots = num_blocks * block_size
    # padding rows carry an out-of-range slot (in every group)
    valid_slot = batch.slot_mapping[0] < layer_slots  # [T]

    scaled = "k_scale" in cache  # FP8 pages: one K and one V scale per layer
    rows = token_rows(batch) if batch_invariant else None

    def paged(inputs: pallas_kernels.AttentionInputs, k: jax.Array, v: jax.Array,
              slots: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This step's keys and values into the pages, then attention over them.
        k, v: [T, Hkv, D]; slots: [T]. Returns (out [T, Hq, D], k_pages, v_pages)."""
        kc, vc = pallas_kernels.write_kv(inputs.k_pages, inputs.v_pages, k, v, slots,
                                         k_scale=inputs.k_scale, v_scale=inputs.v_scale,
                                         impl="cpu" if attn_impl == "cpu" else "xla")
        out = pallas_kernels.paged_attention(
            dataclasses.replace(inputs, k_pages=kc, v_pages=vc), impl=attn_impl)
        return out.astype(inputs.q.dtype), kc, vc

    def paged_latent(inputs: MLAInputs, latent: jax.Array, k_pe: jax.Array,
                     slots: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """This step's latents and rope keys into the pages, then latent attention over
        them. latent [T, Dl], k_pe [T, Dr]; slots [T]. Returns (out [T, Hq, Dl] in the
        latent space, latent_pages, rope_pages)."""
        lat, rope = mla_kernels.write_latent(inputs.latent_pages, inputs.rope_pages, latent,
                                             k_pe, slots)
        out = mla_kernels.mla_attention(
            dataclasses.replace(inputs, latent_pages=lat, rope_pages=rope), impl=attn_impl)
        return out.astype(inputs.q_latent.dtype), lat, rope

    def layer(block, carry, xs):
        x, k_cache, v_cache = carry
        l, const, lora_ab = xs
        layer_lora = None if lora is None else lora.layer(*lora_ab, lora_impl)
        group, slot = const["kv_group"], const["kv_slot"]  # [] int32 each
        slots = jnp.where(valid_slot, batch.slot_mapping[group] + slot * layer_slots,
                          kv.num_slots * layer_slots)  # [T]; still out of range if padding

        def attend(q, k, v):
            inputs = _attention_inputs(
                cfg, q=q, k_pages=k_cache, v_pages=v_cache,
                block_tables=batch.block_tables[group] + slot * num_blocks,  # [S, max_blocks]
                kv_lens=batch.kv_lens, cu_seqlens_q=batch.cu_seqlens_q,
                num_seqs=batch.num_seqs, window=const.get("window"),  # [] int32 or None
                # [] float32 each, or None: quantized on write, upcast inside attention.
                k_scale=cache["k_scale"][l] if scaled else None,
                v_scale=cache["v_scale"][l] if scaled else None, max_q_len=max_q_len,
                sinks=block.attn.sink_logits(),  # [Hq] or None
                batch_invariant=batch_invariant)
            if parallel is None:
                out, kc, vc = paged(inputs, k, v, slots)
            else:  # per device: its heads, its KV heads, its cache shard
                out, kc, vc = parallel.attention_map(paged, inputs, k, v, slots,
                                                     args_axes=(KV_AXES, KV_AXES, ()))
            return out, (kc, vc)

        def attend_latent(q, latent, k_pe):  # q [T, Hq, dn+dr], latent / k_pe [T, 1, D]
            lat_pages, rope_pages = (c.reshape(c.shape[0], c.shape[1], c.shape[3])
                                     for c in (k_cache, v_cache))  # drop the unit head axis
            q_latent, q_rope = block.attn.absorb(q)  # [T, Hq, Dl], [T, Hq, Dr]
            inputs = _latent_inputs(
                cfg, q_latent=q_latent, q_rope=q_rope, latent_pages=lat_pages,
                rope_pages=rope_pages,
                block_tables=batch.block_tables[group] + slot * num_blocks,
                kv_lens=batch.kv_lens, cu_seqlens_q=batch.cu_seqlens_q,
                num_seqs=batch.num_seqs, max_q_len=max_q_len)
            if parallel is None:
                out, lat_pages, rope_pages = paged_latent(inputs, latent[:, 0], k_pe[:, 0],
                                                          slots)
            else:  # per device: its heads over the whole (replicated) latent pages
                out, lat_pages, rope_pages = parallel.attention_map(
                    paged_latent, inputs, latent[:, 0], k_pe[:, 0], slots,
                    args_axes=((None, None), (None, None), ()))
            return block.attn.values(out), (lat_pages.reshape(k_cache.shape),
                                            rope_pages.reshape(v_cache.shape))

        x, (k_cache, v_cache), stats = block(x, batch.positions, const["inv_freq"],
                                             attend_latent if cfg.is_mla else attend,
                                             valid=valid_slot, layer=l, moe_impl=moe_impl,
                                             parallel=parallel, lora=layer_lora,
                                             matmul_impl=matmul_impl, rows=rows)
        return (x, k_cache, v_cache), stats

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    lora_ab = None if lora is None else (lora.a, lora.b)  # [L, S, ...]: one layer each
    (x, k_new, v_new), stats = model.scan_layers(layer, (x, cache["k"], cache["v"]),
                                                 (layer_ids, layer_constants(cfg, kv), lora_ab),
                                                 unrolled=layer_loop == "unrolled")
    x = x[batch.logits_rows]  # [S, H]: the rows some caller reads, never all T
    if head:
        x = (model.head(x, parallel, matmul_impl) if not batch_invariant
             else head_rows(batch, x.shape[0]).map(
                 lambda h: model.head(h, parallel, matmul_impl), x))
    return x, {**cache, "k": k_new, "v": v_new}, stats


def token_rows(batch: StepBatch) -> RowTiles:
    """The fixed row tiles over a step's token rows: its real tokens are live."""
    return RowTiles(batch.cu_seqlens_q[batch.num_seqs])


def head_rows(batch: StepBatch, rows: int) -> RowTiles:
    """The fixed row tiles over `rows` sampled positions (S * W): the real sequences'
    positions are live."""
    return RowTiles(batch.num_seqs * (rows // batch.kv_lens.shape[0]))


def dense_mask(length: int, window: jax.Array) -> jax.Array:
    """[L, L] bool: query i sees key j iff i - window < j <= i."""
    i, j = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    return (j <= i) & (j > i - window)


def forward_dense(params: Params, cfg: ModelConfig, token_ids: jax.Array,
                  dtype=jnp.float32, moe_impl: str = "auto", kv_amax: bool = False):
    """Causal full-sequence forward. token_ids [B, L] -> logits [B, L, V] float32;
    with `kv_amax` (static) also each layer's max |K| and max |V|, [2, L] float32 (the
    FP8 KV cache's calibration, `arcjax.model.kv_scales`)."""
    B, L = token_ids.shape
    positions = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    model = _model(cfg, params)
    x = model.embed(token_ids, dtype)  # [B, L, H]
    valid = jnp.ones((B, L), bool)

    def layer(block, x, xs):
        index, const = xs
        allowed = dense_mask(L, const.get("window", jnp.int32(L)))

        def attend(q, k, v):  # q [B, L, Hq, D], k/v [B, L, Hkv, D]
            if cfg.is_mla:  # k, v: the latent and the rope key; every head's K and V
                k, v = block.attn.expand(k, v)
            k = jnp.repeat(k, cfg.q_per_kv, axis=2)
            v = jnp.repeat(v, cfg.q_per_kv, axis=2)
            s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
            s = s * cfg.sm_scale
            if cfg.attn_logit_softcap is not None:
                s = cfg.attn_logit_softcap * jnp.tanh(s / cfg.attn_logit_softcap)
            s = jnp.where(allowed, s, -jnp.inf)
            sinks = block.attn.sink_logits()  # [Hq] or None
            if sinks is not None:  # one more logit per head in the denominator, no value
                sink = jnp.broadcast_to(sinks[:, None, None], s.shape[:-1] + (1,))
                p = jax.nn.softmax(jnp.concatenate([s, sink], -1), axis=-1)[..., :-1]
            else:
                p = jax.nn.softmax(s, axis=-1)
            p = p.astype(v.dtype)
            amax = jnp.stack([jnp.max(jnp.abs(k)), jnp.max(jnp.abs(v))]).astype(jnp.float32)
            return jnp.einsum("bhqk,bkhd->bqhd", p, v), amax

        x, amax, _ = block(x, positions, const["inv_freq"], attend, valid=valid, layer=index,
                           moe_impl=moe_impl, parallel=None)
        return x, amax

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    x, amax = model.scan_layers(layer, x, (layer_ids, layer_constants(cfg)))  # [L, 2]
    logits = model.head(x)
    return (logits, amax.T) if kv_amax else logits
