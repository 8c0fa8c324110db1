"""The compiled CPU kernel (`impl="cpu"`, pallas_kernels/cpu_attention.py) against the oracle:
random ragged batches in every head layout and dtype, each option (windows, soft-caps,
sinks, FP8 pages with scales) and their mixes, NaN wherever no row may look; padding rows
exactly zero; a row's output bitwise the same whatever shares the call (batch and chunk
invariance by construction); garbage lengths never read outside the cache; and how "auto"
and an explicit "cpu" choose it, build it, or say why not."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from pallas_kernels import (KernelArgumentError, api, choose_impl, cpu_build,
                            ragged_paged_attention, write_kv)
from pallas_kernels.testing import make_batch
from support.attention_batches import (FP8, FP8_MAX, LAYOUT_IDS, LAYOUTS, TOLERANCES,
                                       attention, attention_with_options, draw_batch,
                                       nan_outside_windows)

pytestmark = pytest.mark.skipif(cpu_build.kernels_unavailable() is not None,
                                reason=str(cpu_build.kernels_unavailable()))
# float16 outputs round to 11 significant bits
TOL = {**TOLERANCES, jnp.float16: dict(atol=3e-3, rtol=3e-3)}


def _compare(batch, dtype, out, **options):
    ref = np.asarray(ragged_paged_attention(*batch.args(), impl="reference", **options),
                     np.float32)
    assert out.dtype == batch.q.dtype
    out = np.asarray(out, np.float32)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[int(batch.cu_seqlens_q[batch.num_seqs]):], 0.0)
    np.testing.assert_allclose(out, ref, **TOL[dtype])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=LAYOUT_IDS)
@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_cpu_kernel_matches_the_oracle(layout, dtype, data):
    batch = draw_batch(data, layout, dtype)
    _compare(batch, dtype, attention(*batch.args(), impl="cpu"))


@pytest.mark.parametrize("head_dim,block_size,heads", [(8, 1, (3, 1)), (24, 5, (6, 2)),
                                                       (80, 16, (9, 3)), (4, 32, (2, 2))])
def test_odd_geometries(head_dim, block_size, heads):
    """Head dims off the 16-lane width, pages of 1 and of 5 keys, GQA 3."""
    seqs = [(1, 37), (5, 5), (17, 40), (0, 3), (1, 1), (30, 64)]
    batch = make_batch(seqs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=head_dim,
                       block_size=block_size, num_tokens=64, seq_bucket=8)
    _compare(batch, jnp.float32, attention(*batch.args(), impl="cpu"))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window,softcap,sinks", [(7, None, False), (None, 5.0, False),
                                                  (None, None, True), (20, 3.0, True)])
def test_options(dtype, window, softcap, sinks):
    seqs = [(1, 70), (9, 30), (1, 3), (0, 9), (5, 5), (1, 40), (24, 24)]
    batch = make_batch(seqs, num_heads=8, num_kv_heads=2, head_dim=32, block_size=8,
                       num_tokens=48, seq_bucket=8, dtype=dtype, seed=5)
    if window is not None:  # NaN before every row's window: never read
        k, v = nan_outside_windows(batch, window, 8)
        batch = type(batch)(**{**batch.__dict__, "k_pages": k, "v_pages": v})
    options = dict(sliding_window=None if window is None else jnp.int32(window),
                   logit_softcap=softcap,
                   sinks=jnp.asarray(np.random.default_rng(1).normal(size=8) * 2, jnp.float32)
                   if sinks else None)
    out = attention_with_options(*batch.args(), impl="cpu", **options)
    _compare(batch, dtype, out, **options)


@pytest.mark.parametrize("fp8", [FP8, jnp.float8_e5m2], ids=["e4m3", "e5m2"])
def test_fp8_pages_with_scales(fp8):
    batch = make_batch([(1, 70), (9, 30), (12, 12), (1, 5)], num_heads=4, num_kv_heads=2,
                       head_dim=16, block_size=4, num_tokens=32, seq_bucket=4, seed=2)
    ks = jnp.float32(float(np.nanmax(np.abs(np.asarray(batch.k_pages)))) / FP8_MAX)
    vs = jnp.float32(float(np.nanmax(np.abs(np.asarray(batch.v_pages)))) / FP8_MAX)
    nb, bs = batch.k_pages.shape[:2]
    flat = lambda x: x.reshape(nb * bs, *x.shape[2:])  # noqa: E731
    kq, vq = write_kv(jnp.zeros(batch.k_pages.shape, fp8), jnp.zeros(batch.v_pages.shape, fp8),
                      flat(batch.k_pages), flat(batch.v_pages),
                      jnp.arange(nb * bs, dtype=jnp.int32), k_scale=ks, v_scale=vs)
    args = (batch.q, kq, vq, *batch.args()[3:])
    out = np.asarray(attention(*args, impl="cpu", k_scale=ks, v_scale=vs))
    ref = np.asarray(ragged_paged_attention(*args, impl="reference", k_scale=ks, v_scale=vs))
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, ref, **TOLERANCES[jnp.float32])


def _bits(x):
    return np.asarray(x, np.float32).view(np.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@settings(max_examples=15, deadline=None)
@given(pos=st.integers(0, 95), chunk=st.integers(1, 40), others=st.lists(
    st.tuples(st.integers(1, 20), st.integers(0, 60)), max_size=4), slot=st.integers(0, 4),
    window=st.sampled_from([None, 9, 50]))
def test_a_row_is_bitwise_its_lone_decode(dtype, pos, chunk, others, slot, window):
    """The probe's row at `pos`, computed inside a chunk (any start) beside other sequences
    in a mixed bucket, equals its lone decode in a decode bucket bit for bit."""
    rng = np.random.default_rng(0)
    bs, blocks, hq, hkv, d = 4, 32, 6, 2, 16
    k = jnp.asarray(rng.normal(size=(8 * blocks, bs, hkv, d)), dtype)
    v = jnp.asarray(rng.normal(size=(8 * blocks, bs, hkv, d)), dtype)
    probe_q = rng.normal(size=(blocks * bs, hq, d))
    other_q = rng.normal(size=(64, hq, d))
    win = None if window is None else jnp.int32(window)

    def call(seqs, t, max_q_len):  # seqs: (rows, kv_len, pages row)
        q, cu, kv = np.zeros((t, hq, d)), [0], []
        tables = np.zeros((8, blocks), np.int32)
        for i, (rows, kv_len, row) in enumerate(seqs):
            q[cu[-1]:cu[-1] + len(rows)] = rows
            cu.append(cu[-1] + len(rows))
            kv.append(kv_len)
            tables[i] = row * blocks + np.arange(blocks)
        cu += [cu[-1]] * (9 - len(cu))
        kv += [0] * (8 - len(kv))
        return attention_with_options(jnp.asarray(q, dtype), k, v, jnp.asarray(tables),
                                      jnp.asarray(kv), jnp.asarray(cu), len(seqs), impl="cpu",
                                      max_q_len=max_q_len, sliding_window=win)

    alone = call([(probe_q[pos:pos + 1], pos + 1, 0)], 8, 1)[0]
    start = max(0, pos - chunk + 1)
    seqs = [(other_q[:n], n + extra, 1 + i) for i, (n, extra) in enumerate(others)]
    slot = min(slot, len(seqs))
    seqs.insert(slot, (probe_q[start:pos + 1], pos + 1, 0))
    first = sum(len(rows) for rows, _, _ in seqs[:slot])
    mixed = call(seqs, 128, 128)
    np.testing.assert_array_equal(_bits(mixed[first + pos - start]), _bits(alone))


def test_garbage_lengths_stay_inside_the_cache():
    """Lengths no runner would send (decreasing offsets, keys past the table, negative
    lengths, more sequences than rows) neither crash nor read outside the pages."""
    batch = make_batch([(3, 10), (2, 7)], num_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=4, num_tokens=8, seq_bucket=4, nan_fill=False)
    q, k, v, tables = batch.args()[:4]
    for kv_lens, cu in (([10, 10**6, -5, 3], [0, 3, 1, 8, 8]), ([3, 3, 3, 3], [0, 9, 50, -2, 4]),
                        ([10, 7, 0, 0], [0, 3, 5, 5, 5])):
        out = attention(q, k, v, tables, jnp.asarray(kv_lens, jnp.int32),
                        jnp.asarray(cu, jnp.int32), 4, impl="cpu")
        assert not np.isnan(np.asarray(out)).any()
    bad = jnp.full(tables.shape, 10**6, jnp.int32)  # page ids past the cache: clipped
    out = attention(q, k, v, bad, batch.kv_lens, batch.cu_seqlens_q, batch.num_seqs, impl="cpu")
    assert np.isfinite(np.asarray(out)).all()


def test_auto_runs_the_kernel_on_the_cpu_and_says_why_not():
    shapes = dict(head_dim=64, block_size=16, max_q_len=None, dtype=jnp.float32, num_heads=4,
                  num_kv_heads=2, platform="cpu")
    assert choose_impl("auto", **shapes).impl == "cpu"
    assert choose_impl("auto", **shapes, kv_dtype=FP8).impl == "cpu"
    assert choose_impl("auto", **{**shapes, "dtype": jnp.float16}).impl == "cpu"
    # int8 pages: the kernel does not read them, "auto" runs xla, "cpu" is refused
    assert choose_impl("auto", **shapes, kv_dtype=jnp.int8).impl == "xla"
    batch = make_batch([(2, 5)], num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    pages = batch.k_pages.astype(jnp.int8)
    with pytest.raises(KernelArgumentError) as err:
        ragged_paged_attention(batch.q, pages, pages, *batch.args()[3:], impl="cpu")
    assert err.value.argument == "impl" and "int8" in str(err.value)
    assert "runs on the CPU" in api.impl_unavailable("cpu", platform="gpu")
    assert api.impl_unavailable("cpu", platform="cpu") is None


def test_a_failed_build_is_a_reason(monkeypatch, tmp_path):
    monkeypatch.setenv("ARCJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")  # a compiler that fails
    with pytest.raises(RuntimeError, match="failed"):
        cpu_build.build()
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left to load
    monkeypatch.setattr(cpu_build, "kernels_unavailable", lambda: "no compiler")
    shapes = dict(head_dim=64, block_size=16, max_q_len=None, dtype=jnp.float32, num_heads=4,
                  num_kv_heads=2, platform="cpu")
    assert choose_impl("auto", **shapes).impl == "xla"
    assert api.impl_unavailable("cpu") == "no compiler"


def test_the_build_is_cached_per_source(monkeypatch, tmp_path):
    monkeypatch.setenv("ARCJAX_CACHE_DIR", str(tmp_path))
    lib = cpu_build.build()
    assert lib.parent == tmp_path / "kernels" and lib.exists()
    mtime = lib.stat().st_mtime_ns
    assert cpu_build.build() == lib and lib.stat().st_mtime_ns == mtime


def test_inside_jit_scan_and_vmap():
    """One layer's call inside a scan (the engine's layer loop) and under vmap (sequential)."""
    batch = make_batch([(1, 20), (6, 6)], num_heads=4, num_kv_heads=2, head_dim=16,
                       block_size=4, num_tokens=8, seq_bucket=2, nan_fill=False)
    args = batch.args()

    @jax.jit
    def layers(q):
        def body(x, _):
            return ragged_paged_attention(x, *args[1:], impl="cpu"), None

        return jax.lax.scan(body, q, None, length=2)[0]

    ref = ragged_paged_attention(ragged_paged_attention(*args, impl="reference"), *args[1:],
                                 impl="reference")
    np.testing.assert_allclose(layers(args[0]), ref, **TOLERANCES[jnp.float32])
    qs = jnp.stack([args[0], 2 * args[0]])
    out = jax.vmap(lambda q: ragged_paged_attention(q, *args[1:], impl="cpu"))(qs)
    np.testing.assert_allclose(out[1], ragged_paged_attention(qs[1], *args[1:],
                                                              impl="reference"),
                               **TOLERANCES[jnp.float32])
