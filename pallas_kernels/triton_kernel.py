"""Ragged paged attention as a raw Triton kernel (`triton.jit`, the official bindings).

The same program as the Pallas kernel in `pallas_gpu.py`, written against Triton itself,
so it survives the removal of Pallas' Triton backend. `triton_gpu.py` launches it: through
`jax_triton.triton_call` on a GPU, or in Triton's interpreter on the CPU.

One program `(h, p, w)` of the grid `(Hkv, num_splits, num_tiles)` (see `gpu_plan.py`):

1. Loads its query rows once, straight from `q [T, Hq, D]`: packed row `r` is token
   `r // GROUP` of the tile and query head `h * Q_PER_KV + r % GROUP` (GQA heads fill the
   matrix M dimension; rows of a padded group are masked).
2. Walks its key steps (`BLOCK_K` keys, whole pages) with an online softmax in base 2:
   steps on a window's lower edge and on the causal diagonal are masked, the steps in
   between are not, steps outside the window or past the last row are never visited.
   The page ids of step i + 1 are loaded during step i, so the K/V loads of the next
   step do not wait behind a table load and the pipeliner keeps them in flight.
   With ALL_MASKED (a batch-invariant plan, `GpuPlan.all_masked`) every step is masked.
3. Writes final rows, or (a split decode row's slice of keys) unnormalized partials
   that XLA combines (`gpu_plan.combine_splits`).

Scores are `(q . k) * sm_scale * k_scale`, soft-capped (`cap * tanh(s / cap)`) before
masking; the output is `softmax @ v * v_scale`. With HAS_SINKS each query head's sink logit
joins the final denominator (`2**(sink - top)`, base 2; a split row's once, in the combine). Pages may be float8: they are widened to
q's dtype before each dot. Offsets into the pages are 64-bit (a cache holding every
layer's pages easily exceeds 2**31 elements).

NOTE: this module imports `triton`, an optional dependency; `pallas_kernels` loads it only
when `impl="triton"` is asked for.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
# Finite, so a row whose keys are all masked so far keeps a finite running max.
MASK_VALUE = tl.constexpr(-0.7 * 3.4028234663852886e38)


@triton.jit
def _page_ids(tables_ptr, seq, step, offs_k, BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
              COLS: tl.constexpr, NUM_BLOCKS: tl.constexpr):
    """[BLOCK_K] page id of each key of `step`, clamped in bounds (past the table: page 0)."""
    col = (step * BLOCK_K + offs_k) // PAGE
    ids = tl.load(tables_ptr + seq * COLS + col, mask=col < COLS, other=0)
    return tl.minimum(tl.maximum(ids, 0), NUM_BLOCKS - 1)


@triton.jit
def _tanh(x):
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)  # saturates to +-1, never NaN


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, INTERPRETED_DOTS: tl.constexpr):
    """a @ b with float32 accumulation. INTERPRETED_DOTS (Triton's interpreter only) sums
    the float32 products of each output element in k order, as a tensor core reduces every
    element alike wherever its row sits in the tile: the interpreter's own dot (numpy's
    BLAS) rounds a row by its position in the tile, and multiplies the raw bits of bfloat16
    operands. Products of 2-byte floats are exact in float32."""
    if INTERPRETED_DOTS:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _kv_step(q, m, l, acc, ids, step, k_ptr, v_ptr, tables_ptr, seq, h, pos, kv_len, key_lo,
             window, qk_scale, offs_k, offs_d, BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
             COLS: tl.constexpr, NUM_BLOCKS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
             HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
             SOFTCAP: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED_DOTS: tl.constexpr,
             MASKED: tl.constexpr):
    """One key step of the online softmax; returns (m, l, acc, next step's page ids)."""
    next_ids = _page_ids(tables_ptr, seq, step + 1, offs_k, BLOCK_K, PAGE, COLS, NUM_BLOCKS)
    keys = step * BLOCK_K + offs_k  # [BK]
    slot = ids.to(tl.int64) * PAGE + keys % PAGE  # [BK] cache slot of each key
    ptrs = (slot * NUM_KV_HEADS + h) * HEAD_DIM  # [BK] int64
    ptrs = ptrs[:, None] + offs_d[None, :]  # [BK, D]
    if MASKED:  # keys no row sees are never read (past kv_len or before every window: NaN ok)
        key_ok = (keys < kv_len) & (keys >= key_lo)
        k = tl.load(k_ptr + ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + ptrs, mask=key_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + ptrs)
        v = tl.load(v_ptr + ptrs)
    s = _dot(q, tl.trans(k.to(q.dtype)), PRECISION, INTERPRETED_DOTS)  # [M, BK] float32
    if HAS_SOFTCAP:
        s = (SOFTCAP * LOG2E) * _tanh(s * (qk_scale / SOFTCAP))
    else:
        s = s * (qk_scale * LOG2E)
    if MASKED:
        ok = (keys[None, :] <= pos[:, None]) & key_ok[None, :]  # [M, BK]
        if HAS_WINDOW:
            ok = ok & (keys[None, :] > pos[:, None] - window)
        s = tl.where(ok, s, MASK_VALUE)
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    if MASKED:
        p = tl.where(ok, p, 0.0)
    l = l * alpha + tl.sum(p, axis=1)
    pv = _dot(p.to(q.dtype), v.to(q.dtype), PRECISION, INTERPRETED_DOTS)  # [M, D]
    acc = acc * alpha[:, None] + pv
    return m_new, l, acc, next_ids


@triton.jit
def ragged_paged_attention_kernel(
    meta_ptr,  # [6, W] int32: seq, q_start, q_end, first_pos, kv_len, split (1 = split tile)
    scalars_ptr,  # [2] int32: live tiles, sliding window
    scales_ptr,  # [2] float32: k_scale, v_scale
    sinks_ptr,  # [Hq] float32 sink logits (read only with HAS_SINKS)
    tables_ptr,  # [S, COLS] int32 page ids
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [num_blocks, PAGE, Hkv, D]
    v_ptr,  # [num_blocks, PAGE, Hkv, D]
    o_ptr,  # [T, Hq, D] final rows
    op_ptr,  # [P, Hkv, SPLIT_TOTAL, D] float32 partial outputs (a dummy without splits)
    mp_ptr,  # [P, Hkv, SPLIT_TOTAL] float32 running maxima (base 2)
    lp_ptr,  # [P, Hkv, SPLIT_TOTAL] float32 softmax denominators
    NUM_TILES: tl.constexpr, BLOCK_Q: tl.constexpr, GROUP: tl.constexpr,
    Q_PER_KV: tl.constexpr, ROWS: tl.constexpr, BLOCK_K: tl.constexpr, PAGE: tl.constexpr,
    COLS: tl.constexpr, NUM_BLOCKS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLIT_ROWS: tl.constexpr,
    SPLIT_TOTAL: tl.constexpr, SM_SCALE: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
    INTERPRETED_DOTS: tl.constexpr, HAS_SINKS: tl.constexpr, ALL_MASKED: tl.constexpr,
):
    h = tl.program_id(0)
    split = tl.program_id(1)
    w = tl.program_id(2)
    live = w < tl.load(scalars_ptr)
    seq = tl.load(meta_ptr + w)
    q_start = tl.load(meta_ptr + NUM_TILES + w)
    q_end = tl.load(meta_ptr + 2 * NUM_TILES + w)
    first_pos = tl.load(meta_ptr + 3 * NUM_TILES + w)
    kv_len = tl.load(meta_ptr + 4 * NUM_TILES + w)
    is_split = tl.load(meta_ptr + 5 * NUM_TILES + w) == 1
    window = tl.load(scalars_ptr + 1)
    qk_scale = SM_SCALE * tl.load(scales_ptr)
    v_scale = tl.load(scales_ptr + 1)
    # A split tile's every program computes its slice (empty ones too: the combine reads
    # them); other tiles run whole in program 0; idle tiles do nothing.
    has_work = live & (is_split | (split == 0))
    n_rows = tl.where(has_work, tl.minimum(tl.maximum(q_end - q_start, 0), BLOCK_Q), 0)

    # Key steps: [start, total) holds every key some row may see.
    last_pos = first_pos + n_rows - 1
    total = tl.where(n_rows > 0, tl.cdiv(last_pos + 1, BLOCK_K), 0)
    diagonal = tl.minimum((first_pos + 1) // BLOCK_K, total)  # steps before it: all rows see all
    if HAS_WINDOW:
        key_lo = tl.maximum(first_pos - window + 1, 0)  # the oldest key any row sees
        start = key_lo // BLOCK_K
        # From this step on, every key is inside every row's window.
        inside = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_K)
    else:
        key_lo = 0
        start = 0
        inside = 0
    ways = 1 + (NUM_SPLITS - 1) * is_split.to(tl.int32)
    per_split = tl.cdiv(tl.maximum(total - start, 0), ways)
    lo = start + split * per_split
    hi = tl.minimum(lo + per_split, total)
    lo = tl.minimum(lo, hi)
    edge = tl.minimum(tl.maximum(inside, lo), hi)  # [lo, edge): the window's lower edge
    mid = tl.minimum(tl.maximum(diagonal, edge), hi)  # [edge, mid) unmasked; [mid, hi) diagonal
    if ALL_MASKED:  # batch-invariant plans: every step in the masked body
        edge = lo
        mid = lo

    rows = tl.arange(0, ROWS)  # [M]
    token = rows // GROUP
    g = rows % GROUP
    row_ok = (token < n_rows) & (g < Q_PER_KV)  # [M]
    pos = first_pos + token  # [M] absolute position of each row
    offs_d = tl.arange(0, HEAD_DIM)
    offs_k = tl.arange(0, BLOCK_K)
    q_rows = ((q_start + token).to(tl.int64) * (NUM_KV_HEADS * Q_PER_KV) + h * Q_PER_KV + g)
    q_ptrs = q_rows[:, None] * HEAD_DIM + offs_d[None, :]  # [M, D]
    q = tl.load(q_ptr + q_ptrs, mask=row_ok[:, None], other=0.0)

    m = tl.full((ROWS,), float("-inf"), tl.float32)
    l = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, HEAD_DIM), tl.float32)
    ids = _page_ids(tables_ptr, seq, lo, offs_k, BLOCK_K, PAGE, COLS, NUM_BLOCKS)
    for i in range(lo, edge):
        m, l, acc, ids = _kv_step(q, m, l, acc, ids, i, k_ptr, v_ptr, tables_ptr, seq, h, pos,
                                  kv_len, key_lo, window, qk_scale, offs_k, offs_d, BLOCK_K,
                                  PAGE, COLS, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, HAS_WINDOW,
                                  HAS_SOFTCAP, SOFTCAP, PRECISION, INTERPRETED_DOTS, True)
    for i in range(edge, mid):
        m, l, acc, ids = _kv_step(q, m, l, acc, ids, i, k_ptr, v_ptr, tables_ptr, seq, h, pos,
                                  kv_len, key_lo, window, qk_scale, offs_k, offs_d, BLOCK_K,
                                  PAGE, COLS, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, HAS_WINDOW,
                                  HAS_SOFTCAP, SOFTCAP, PRECISION, INTERPRETED_DOTS, False)
    for i in range(mid, hi):
        m, l, acc, ids = _kv_step(q, m, l, acc, ids, i, k_ptr, v_ptr, tables_ptr, seq, h, pos,
                                  kv_len, key_lo, window, qk_scale, offs_k, offs_d, BLOCK_K,
                                  PAGE, COLS, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, HAS_WINDOW,
                                  HAS_SOFTCAP, SOFTCAP, PRECISION, INTERPRETED_DOTS, True)

    acc = acc * v_scale
    # NOTE: scalar conditions gate row counts, not masks: Triton's interpreter (3.9) turns
    # `block_bool & scalar_bool` into int32, which its stores refuse as a mask.
    n_final = tl.where(is_split | (split != 0), 0, n_rows)
    final_ok = (token < n_final) & (g < Q_PER_KV)
    if HAS_SINKS:  # one more denominator term per row: 2**sink, no value
        sink = tl.load(sinks_ptr + h * Q_PER_KV + g, mask=g < Q_PER_KV, other=0.0) * LOG2E
        top = tl.maximum(m, sink)
        rescale = tl.exp2(m - top)
        o = acc * (rescale / (l * rescale + tl.exp2(sink - top)))[:, None]
    else:
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + q_ptrs, o.to(o_ptr.dtype.element_ty), mask=final_ok[:, None])
    if NUM_SPLITS > 1:
        part_ok = (token < tl.where(is_split, n_rows, 0)) & (g < Q_PER_KV)
        slot = (split * NUM_KV_HEADS + h) * SPLIT_TOTAL + seq * SPLIT_ROWS + rows  # [M]
        tl.store(op_ptr + slot.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], acc,
                 mask=part_ok[:, None])
        tl.store(mp_ptr + slot, m, mask=part_ok)
        tl.store(lp_ptr + slot, l, mask=part_ok)
