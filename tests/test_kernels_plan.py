"""The tiling plan: every real query row belongs to exactly one live tile."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import gpu_plan, plan


S_BUCKET, T_BUCKET = 9, 256  # fixed bucket shapes: one compile per tile size


@functools.partial(jax.jit, static_argnums=(0, 4))
def _metadata(tiles, kv_lens, cu, num_seqs, ordered):
    meta = plan.tile_metadata(tiles, kv_lens, cu, num_seqs)
    return plan.longest_first(tiles, meta) if ordered else meta


@settings(max_examples=60)
@given(q_lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
       block_q=st.sampled_from([1, 4, 16, 128]), block_k=st.sampled_from([16, 64]),
       cached=st.integers(0, 50), ordered=st.booleans())
def test_tiles_cover_each_real_row_once(q_lens, block_q, block_k, cached, ordered):
    n = len(q_lens)
    s_max, t = S_BUCKET, T_BUCKET
    cu = np.zeros(s_max + 1, np.int32)
    cu[1:n + 1] = np.cumsum(q_lens)
    cu[n + 1:] = cu[n]
    kv_lens = np.zeros(s_max, np.int32)
    kv_lens[:n] = np.array(q_lens) + cached
    tiles = plan.make_plan(num_tokens=t, num_seqs=s_max, page_size=8, max_blocks=16,
                           max_q_len=64, block_q=block_q, block_k=block_k)
    meta = _metadata(tiles, jnp.asarray(kv_lens), jnp.asarray(cu), jnp.int32(n), ordered)
    meta = {k: np.asarray(v) for k, v in meta._asdict().items()}
    num_live = int(meta["num_live"])
    assert num_live <= tiles.num_tiles

    owner = np.full(t, -1)
    steps = []
    for w in range(tiles.num_tiles):
        start, end = meta["q_start"][w], meta["q_end"][w]
        rows = np.arange(start, min(start + tiles.block_q, end))
        if w >= num_live:
            assert len(rows) == 0
            continue
        s = meta["seq"][w]
        assert cu[s] <= start < cu[s + 1] and end == cu[s + 1]
        # Bottom-right: row r sits at kv_len - q_len + (r - cu[s]).
        assert meta["first_pos"][w] == kv_lens[s] - q_lens[s] + (start - cu[s])
        assert (owner[rows] == -1).all()
        owner[rows] = w
        unmasked, total = plan.kv_steps(tiles, meta["first_pos"][w], np.int32(len(rows)))
        last_key = meta["first_pos"][w] + len(rows) - 1
        assert int(total) * tiles.block_k > last_key >= (int(total) - 1) * tiles.block_k
        assert int(unmasked) * tiles.block_k <= meta["first_pos"][w] + 1
        steps.append(int(total))
    if ordered:  # longest first
        assert steps == sorted(steps, reverse=True), steps
    assert (owner[:cu[n]] >= 0).all() and (owner[cu[n]:] == -1).all()


def test_gpu_plan_shapes_are_powers_of_two():
    for group, max_q_len, page_size, max_blocks in [(4, 1, 16, 64), (1, 300, 16, 3),
                                                    (8, 2048, 4, 1000), (2, 7, 32, 1)]:
        p = gpu_plan.make_gpu_plan(num_tokens=512, num_seqs=64, num_heads=8 * group,
                                   num_kv_heads=8, head_dim=128, page_size=page_size,
                                   max_blocks=max_blocks, max_q_len=max_q_len)
        for n in (p.rows, p.tiles.block_q, p.tiles.pages_per_step, p.tiles.block_k):
            assert plan.is_pow2(n), p
        assert p.rows >= gpu_plan.MIN_DOT and p.tiles.block_k >= gpu_plan.MIN_DOT
        assert p.rows >= p.tiles.block_q * p.group


def test_gpu_plan_defaults():
    kwargs = dict(num_tokens=2048, num_seqs=64, num_heads=32, num_kv_heads=8, head_dim=128,
                  page_size=16)
    prefill = gpu_plan.make_gpu_plan(max_blocks=64, max_q_len=2048, **kwargs)
    assert (prefill.rows, prefill.tiles.block_k, prefill.num_splits) == (128, 64, 1)
    # A table wide enough for long decode rows splits them inside a mixed batch too.
    long_rows = gpu_plan.make_gpu_plan(max_blocks=8192, max_q_len=2048, **kwargs)
    assert long_rows.num_splits == gpu_plan.MIXED_MAX_SPLITS and long_rows.split_max_q_len == 1
    f32 = gpu_plan.make_gpu_plan(max_blocks=64, max_q_len=2048, itemsize=4, **kwargs)
    assert (f32.rows, f32.tiles.block_k) == (64, 32)
    decode = gpu_plan.make_gpu_plan(max_blocks=128, max_q_len=1, **(kwargs | dict(num_seqs=8)))
    assert decode.rows == 16 and decode.num_splits > 1 and decode.tiles.block_q == 1
