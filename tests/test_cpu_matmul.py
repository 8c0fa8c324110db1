"""The compiled CPU product (`pallas_kernels.cpu_matmul`, packed_matmul's "cpu"): against
float64 over shapes (rows, lane tails, both weight layouts, float32 and bfloat16 weights); a
row's bits the same whatever the other rows (batch-invariant by construction); where
packed_matmul sends a product ("cpu" takes bfloat16 weights of decode-sized products, XLA
the rest; inside a batch-invariant row tile every float matrix, for the tile's live rows)
and what "auto" resolves to; `rows` (only the first rows computed, the others zeros); a
bfloat16 engine's greedy tokens with the kernel equal to XLA's products."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from arcjax import LLM, SamplingParams
from arcjax.model import packed_matmul
from arcjax.model.quant import tied_head
from arcjax.model.row_tiles import RowTiles, tile_live_rows
from pallas_kernels import KernelArgumentError, cpu_build
from pallas_kernels.cpu_matmul import cpu_matmul

pytestmark = pytest.mark.skipif(cpu_build.kernels_unavailable() is not None,
                                reason=str(cpu_build.kernels_unavailable()))
kernel = jax.jit(cpu_matmul, static_argnames="transposed")


def _operands(m, k, n, transposed, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(m, k)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(n, k) if transposed else (k, n)), dtype)
    return x, w


def _exact(x, w, transposed):
    w64 = np.asarray(w, np.float64)
    return np.asarray(x, np.float64) @ (w64.T if transposed else w64)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 70), k=st.sampled_from([1, 7, 16, 24, 64, 130]),
       n=st.sampled_from([1, 15, 32, 33, 100, 257, 530]), transposed=st.booleans(),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]))
def test_matches_float64(m, k, n, transposed, dtype):
    x, w = _operands(m, k, n, transposed, dtype)
    out = np.asarray(kernel(x, w, transposed=transposed))
    assert out.shape == (m, n) and out.dtype == np.float32
    np.testing.assert_allclose(out, _exact(x, w, transposed), rtol=1e-5, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_a_row_is_bitwise_the_same_whatever_the_other_rows(transposed, dtype):
    x, w = _operands(40, 100, 300, transposed, dtype, seed=1)
    full = np.asarray(kernel(x, w, transposed=transposed)).view(np.int32)
    for rows in ([7], [0, 7], list(range(3, 12)), [39, 7, 20], list(range(40))[::-1]):
        part = np.asarray(kernel(x[jnp.asarray(rows)], w, transposed=transposed))
        np.testing.assert_array_equal(part.view(np.int32), full[rows])


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_rows_computes_the_first_rows_and_zeros_the_rest(transposed, dtype):
    x, w = _operands(11, 40, 70, transposed, dtype, seed=2)
    full = np.asarray(kernel(x, w, transposed=transposed))
    for rows in (0, 1, 5, 11, 12, -3):  # traced: one executable; clipped to [0, M]
        got = np.asarray(kernel(x, w, transposed=transposed, rows=jnp.int32(rows)))
        live = min(max(rows, 0), 11)
        np.testing.assert_array_equal(got[:live].view(np.int32), full[:live].view(np.int32))
        assert not got[live:].any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_inside_a_row_tile_every_float_matrix_takes_the_kernel_for_the_live_rows(dtype):
    """"cpu" inside `RowTiles.map`: float32 weights too, each tile's product computed for
    its live rows only; a live row's bits are the kernel's (so the same in every bucket)."""
    x, w = _operands(13, 64, 96, False, dtype, seed=3)
    table = _operands(1, 64, 50, True, dtype, seed=4)[1]  # [50, 64]: a tied head

    @jax.jit
    def tiled(x, live):
        tiles = RowTiles(live)
        return (tiles.map(lambda t: packed_matmul.matmul(t, w, "cpu"), x),
                tiles.map(lambda t: packed_matmul.tied_matmul(t, table, "cpu"), x))

    full, head = np.asarray(kernel(x, w)), np.asarray(kernel(x, table, transposed=True))
    for live in (1, 8, 9, 13):
        got, got_head = (np.asarray(a) for a in tiled(x, jnp.int32(live)))
        np.testing.assert_array_equal(got[:live].view(np.int32), full[:live].view(np.int32))
        np.testing.assert_array_equal(got_head[:live].view(np.int32),
                                      head[:live].view(np.int32))
        assert not got[live:].any() and not got_head[live:].any()
    if dtype == jnp.float32:  # outside a tile float32 weights stay on XLA
        np.testing.assert_array_equal(packed_matmul.matmul(x, w, "cpu"), x @ w)


def test_the_live_rows_are_seen_only_inside_the_tile_being_traced_on_its_thread():
    import threading

    seen = {}

    def fn(t):
        seen["inside"] = tile_live_rows()
        other = threading.Thread(target=lambda: seen.update(other=tile_live_rows()))
        other.start()
        other.join()
        return t

    jax.jit(lambda x: RowTiles(jnp.int32(3)).map(fn, x))(jnp.ones((5, 2)))
    assert seen["inside"] is not None and seen["other"] is None
    assert tile_live_rows() is None


def test_packed_matmul_sends_bf16_decode_products_to_the_kernel():
    x, w = _operands(5, 64, 96, False, jnp.bfloat16)
    x = x.astype(jnp.bfloat16)
    got = packed_matmul.matmul(x, w, "cpu")
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(
        kernel(x, w).astype(jnp.bfloat16), np.float32))
    np.testing.assert_allclose(np.asarray(got, np.float32),
                               np.asarray(packed_matmul.matmul(x, w, "xla"), np.float32),
                               rtol=2e-2, atol=2e-2)
    # float32 weights and wide products stay on XLA: the same bits as "xla"
    x32, w32 = _operands(5, 64, 96, False, jnp.float32)
    np.testing.assert_array_equal(packed_matmul.matmul(x32, w32, "cpu"), x32 @ w32)
    wide = jnp.ones((packed_matmul.CPU_MAX_ROWS + 1, 64), jnp.bfloat16)
    np.testing.assert_array_equal(packed_matmul.matmul(wide, w, "cpu"), wide @ w)
    # the tied LM head reads the embedding table [V, H] in place
    table = _operands(1, 64, 200, True, jnp.bfloat16)[1]  # [200, 64]
    np.testing.assert_array_equal(
        np.asarray(packed_matmul.tied_matmul(x, table, "cpu"), np.float32),
        np.asarray(kernel(x, table, transposed=True).astype(jnp.bfloat16), np.float32))
    np.testing.assert_array_equal(packed_matmul.tied_matmul(x, table, "xla"),
                                  packed_matmul.matmul(x, tied_head(table), "xla"))


def test_auto_and_refusals():
    bf16 = {"layers": {"wq": jnp.zeros((4, 4), jnp.bfloat16)}}
    f32 = {"layers": {"wq": jnp.zeros((4, 4), jnp.float32)}}
    assert packed_matmul.resolve_impl("auto", bf16, platform="cpu", parallel=False) == "cpu"
    assert packed_matmul.resolve_impl("auto", f32, platform="cpu", parallel=False) == "xla"
    assert packed_matmul.resolve_impl("auto", bf16, platform="cpu", parallel=True) == "xla"
    for params in (bf16, f32):  # the batch-invariant mode: the kernel for every weight
        assert packed_matmul.resolve_impl("auto", params, platform="cpu", parallel=False,
                                          batch_invariant=True) == "cpu"
        assert packed_matmul.resolve_impl("auto", params, platform="gpu", parallel=False,
                                          batch_invariant=True) == "xla"
        assert packed_matmul.resolve_impl("xla", params, platform="cpu", parallel=False,
                                          batch_invariant=True) == "xla"
    assert "runs on the CPU" in packed_matmul.impl_unavailable("cpu", platform="gpu",
                                                               parallel=False)
    assert "one device" in packed_matmul.impl_unavailable("cpu", platform="cpu", parallel=True)
    with pytest.raises(KernelArgumentError) as err:
        cpu_matmul(jnp.ones((2, 4)), jnp.ones((4, 4), jnp.float16))
    assert err.value.argument == "w"
    with pytest.raises(KernelArgumentError) as err:
        cpu_matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 4)))
    assert err.value.argument == "w"


def test_a_bfloat16_engine_runs_the_kernel_and_computes_the_same_model():
    """The same bfloat16 model with the kernel ("auto") and with XLA's products: every
    prompt token's log-probability within bfloat16's rounding, the first greedy tokens
    equal (later ones may part at a near-tie: the two round differently)."""
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 40)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    runs = {}
    for impl in ("auto", "xla"):
        llm = LLM(dtype="bfloat16", packed_matmul_impl=impl, max_model_len=128,
                  max_num_seqs=4, num_kv_blocks=64)
        assert llm.engine.runner.matmul_impl == ("cpu" if impl == "auto" else "xla")
        runs[impl] = llm.generate(prompts, params, use_tqdm=False)
    for prompt, a, b in zip(prompts, runs["auto"], runs["xla"]):
        assert a.token_ids[:2] == b.token_ids[:2]
        for p in range(1, len(prompt)):
            assert abs(a.prompt_logprobs[p][prompt[p]].logprob
                       - b.prompt_logprobs[p][prompt[p]].logprob) < 0.15
