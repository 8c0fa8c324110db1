"""Decode-only ragged paged attention as a Pallas Mosaic GPU kernel (Hopper).

The decode step is bandwidth-bound: this kernel streams each sequence's pages with TMA
copies through `plgpu.emit_pipeline` and does both products on the tensor cores with
warpgroup matmuls (`plgpu.wgmma`).

Dataflow:
    1. XLA packs each sequence's one query row: the G query heads of KV head h become
       rows 0..G-1 of a 64-row tile (`[S, Hkv, 64, D]`; wgmma's M is 64 per warpgroup),
       and sequences with no query row this step get no keys.
    2. One program per (KV head, sequence, split) over the grid `(Hkv, S, num_splits)`:
       it copies its query tile to shared memory, then pipelines its slice of the
       sequence's pages (one page per step, page ids read from the block table in the
       index map, `MAX_CONCURRENT_STEPS` TMA copies in flight), keeping an online
       softmax in base 2 in registers. The last page of a sequence is masked (its keys
       past kv_len are set to zero in shared memory, NaN included).
    3. Programs write unnormalized partials (o, m, l) that XLA combines across splits
       (`gpu_plan.combine_splits`) and scatters to the sequences' rows.

Sliding windows, soft-caps and float8 pages are not implemented here (the Triton kernel
has them), nor float32 (`unsupported` says what is); "auto" sends such calls elsewhere.

NOTE: Mosaic GPU kernels can neither run nor be interpreted on the CPU. This one lowers
for CUDA on the CPU (tests/test_gpu_lowering_mosaic.py); its numbers are checked against
the oracle only by scripts/gpu_check.sh on a GPU, which records a passing run
(`pallas_kernels.verified`); "auto" uses it only after that.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import gpu_plan as gpu_plan_lib
from pallas_kernels.attention_inputs import AttentionInputs

ROWS = 64  # wgmma M per warpgroup: the packed query heads of one KV head, padded
KEYS_PER_STEP = 64  # keys per step (whole pages): wgmma's K for p @ v is a multiple of 64
BUFFERS = 3  # key steps in flight per program
LOG2E = math.log2(math.e)
SWIZZLE = 128  # bytes
# Shared memory: what one block may use on sm_90 (227 KB), what each mbarrier takes, and
# what the lowering adds for the cross-warp row reductions (max, sum) beside our buffers
# (297,016 bytes lowered at D=256 = 294,912 of buffers + 7 barriers + 2,048).
SMEM_LIMIT = 232_448
BARRIER_BYTES = 8
REDUCTION_SMEM = 2_048


def smem_bytes(*, head_dim: int, block_size: int, itemsize: int) -> int:
    """Shared memory one program of the kernel takes: the query tile, `BUFFERS` K and V
    steps, the float32 output tile, the barriers and the lowering's reduction scratch."""
    keys = max(KEYS_PER_STEP, block_size)
    buffers = (ROWS * head_dim * itemsize + 2 * BUFFERS * keys * head_dim * itemsize
               + ROWS * head_dim * 4)
    return buffers + (1 + 2 * BUFFERS) * BARRIER_BYTES + REDUCTION_SMEM


def unsupported(*, head_dim: int, block_size: int, num_heads: int, num_kv_heads: int,
                dtype, kv_dtype) -> str | None:
    """Why this kernel cannot take these shapes, or None if it can."""
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return f"it computes in bfloat16/float16, got {jnp.dtype(dtype).name}"
    if jnp.dtype(kv_dtype) != jnp.dtype(dtype):
        return (f"pages must have q's dtype ({jnp.dtype(dtype).name}), "
                f"got {jnp.dtype(kv_dtype).name}")
    if head_dim % 64:
        return f"head_dim must be a multiple of 64, got {head_dim}"
    if KEYS_PER_STEP % block_size and block_size % KEYS_PER_STEP:
        return f"block_size must divide {KEYS_PER_STEP} or be a multiple of it, got {block_size}"
    if num_heads // num_kv_heads > ROWS:
        return f"at most {ROWS} query heads per KV head, got {num_heads // num_kv_heads}"
    need = smem_bytes(head_dim=head_dim, block_size=block_size,
                      itemsize=jnp.dtype(dtype).itemsize)
    if need > SMEM_LIMIT:
        return (f"head_dim {head_dim} with {block_size}-token pages needs {need:,} bytes of "
                f"shared memory, over the {SMEM_LIMIT:,} a block may use")
    return None


def _smem_transforms(dtype) -> tuple:
    elems = SWIZZLE // jnp.dtype(dtype).itemsize
    return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(SWIZZLE))


def _launch(q_packed, k_pages, v_pages, tables, lens, *, num_splits: int, sm_scale: float):
    s_bucket, hkv, _, head_dim = q_packed.shape
    num_blocks, page_size = k_pages.shape[:2]
    max_blocks = tables.shape[1]
    dtype = q_packed.dtype
    keys_per_step = max(KEYS_PER_STEP, page_size)  # wgmma's K for p @ v: a multiple of 64
    pages_per_step = keys_per_step // page_size
    transforms = _smem_transforms(dtype)

    def kernel(q_gmem, k_gmem, v_gmem, tables_gmem, lens_gmem, o_gmem, m_gmem, l_gmem,
               scoped):
        q_smem, k_smem, v_smem, o_smem, q_bar, k_bar, v_bar = scoped
        h, s, p = lax.axis_index("h"), lax.axis_index("s"), lax.axis_index("p")
        kv_len = lens_gmem[s]
        total = (kv_len + keys_per_step - 1) // keys_per_step
        per_split = (total + num_splits - 1) // num_splits
        lo = jnp.minimum(p * per_split, total)
        steps = jnp.minimum(lo + per_split, total) - lo

        plgpu.copy_gmem_to_smem(q_gmem.at[s, h], q_smem, q_bar)

        def fetch(i, slot):  # the pages of step lo + i, one TMA copy each, into `slot`
            for j in range(pages_per_step):
                col = jnp.minimum((lo + i) * pages_per_step + j, max_blocks - 1)
                page = jnp.clip(tables_gmem[s, col], 0, num_blocks - 1)
                rows = pl.ds(j * page_size, page_size)
                plgpu.copy_gmem_to_smem(k_gmem.at[page, :, h], k_smem.at[slot, rows],
                                        k_bar.at[slot])
                plgpu.copy_gmem_to_smem(v_gmem.at[page, :, h], v_smem.at[slot, rows],
                                        v_bar.at[slot])

        for b in range(BUFFERS):
            pl.when(b < steps)(functools.partial(fetch, b, b))
        plgpu.barrier_wait(q_bar)

        def step(i, carry):
            m, l, acc = carry
            slot = lax.rem(i, BUFFERS)
            first_key = (lo + i) * keys_per_step
            plgpu.barrier_wait(k_bar.at[slot])

            def qk(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
                return acc_ref[...]

            scores = pl.run_scoped(qk, plgpu.ACC((ROWS, keys_per_step), jnp.float32))
            keys = first_key + plgpu.broadcasted_iota(
                jnp.int32, (ROWS, keys_per_step), 1, layout=plgpu.Layout.WGMMA)
            scores = jnp.where(keys < kv_len, scores * (sm_scale * LOG2E), -jnp.inf)
            m_new = jnp.maximum(m, scores.max(axis=1))
            alpha = jnp.exp2(m - m_new)
            prob = jnp.exp2(scores - lax.broadcast_in_dim(m_new, scores.shape, [0]))
            l = l * alpha + prob.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])

            @pl.when(first_key + keys_per_step > kv_len)  # keys past kv_len: zero (NaN too)
            def _():
                v = v_smem.at[slot][...]
                rows = first_key + lax.broadcasted_iota(jnp.int32, v.shape, 0)
                v_smem.at[slot][...] = jnp.where(rows < kv_len, v, jnp.zeros_like(v))
                plgpu.commit_smem()

            def pv(acc_ref):
                plgpu.wgmma(acc_ref, prob.astype(dtype), v_smem.at[slot])

            acc = pl.run_state(pv)(plgpu.ACC.init(acc))
            pl.when(i + BUFFERS < steps)(functools.partial(fetch, i + BUFFERS, slot))
            return m_new, l, acc

        m0 = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32),
                               plgpu.Layout.WGMMA.reduce(1))
        l0 = plgpu.layout_cast(jnp.zeros((ROWS,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc0 = plgpu.layout_cast(jnp.zeros((ROWS, head_dim), jnp.float32), plgpu.Layout.WGMMA)
        m, l, acc = lax.fori_loop(0, steps, step, (m0, l0, acc0))

        o_smem[...] = acc
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[p, h, s])
        plgpu.wait_smem_to_gmem(0)
        m_gmem[p, h, s] = m
        l_gmem[p, h, s] = l

    part = (num_splits, hkv, s_bucket, ROWS)
    scratch = (
        plgpu.SMEM((ROWS, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((BUFFERS, keys_per_step, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((BUFFERS, keys_per_step, head_dim), dtype, transforms=transforms),
        plgpu.SMEM((ROWS, head_dim), jnp.float32),
        plgpu.Barrier(num_arrivals=1),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=BUFFERS),
        plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=BUFFERS),
    )
    return plgpu.kernel(
        kernel,
        out_type=(jax.ShapeDtypeStruct(part + (head_dim,), jnp.float32),
                  jax.ShapeDtypeStruct(part, jnp.float32),
                  jax.ShapeDtypeStruct(part, jnp.float32)),
        scratch_types=[scratch],
        grid=(hkv, s_bucket, num_splits), grid_names=("h", "s", "p"),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )(q_packed, k_pages, v_pages, tables, lens)


def ragged_paged_attention_mosaic_gpu(inputs: AttentionInputs,
                                      plan: gpu_plan_lib.GpuPlan) -> jax.Array:  # [T, Hq, D]
    """Decode-only batches (every chunk has at most one query row), plain calls only."""
    q, cu_seqlens_q, num_seqs = inputs.q, inputs.cu_seqlens_q, inputs.num_seqs
    t, hq, d = q.shape
    s_bucket, hkv = inputs.seq_bucket, inputs.num_kv_heads
    g = hq // hkv
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]  # [S]
    live = (jnp.arange(s_bucket) < num_seqs) & (q_lens == 1)
    rows = jnp.clip(cu_seqlens_q[:-1], 0, t - 1)  # [S] each sequence's query row
    q_seq = jnp.where(live[:, None, None], q[rows], 0).reshape(s_bucket, hkv, g, d)
    q_packed = jnp.pad(q_seq, ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))  # [S, Hkv, 64, D]
    lens = jnp.where(live, inputs.kv_lens, 0).astype(jnp.int32)
    o, m, l = _launch(q_packed, inputs.k_pages, inputs.v_pages, inputs.block_tables, lens,
                      num_splits=plan.num_splits, sm_scale=inputs.sm_scale)
    out = gpu_plan_lib.combine_splits(o, m, l)  # [Hkv, S, 64, D]
    out = out[:, :, :g].transpose(1, 0, 2, 3).reshape(s_bucket, hq, d).astype(q.dtype)
    full = jnp.zeros((t, hq, d), q.dtype).at[jnp.where(live, rows, t)].set(out, mode="drop")
    return gpu_plan_lib.padding_rows_to_zero(full, cu_seqlens_q, num_seqs)
