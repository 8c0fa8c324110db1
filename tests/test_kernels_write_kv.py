"""write_kv: scatter through slot_mapping; out-of-range slots write nothing. Both
implementations: XLA's scatter and the CPU kernel's in-place copy (impl="cpu")."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import KernelArgumentError, cpu_build, write_kv

IMPLS = ["xla", pytest.param("cpu", marks=pytest.mark.skipif(
    cpu_build.kernels_unavailable() is not None,
    reason=str(cpu_build.kernels_unavailable())))]


def _pages(num_blocks=3, block_size=4, hkv=2, d=8, dtype=jnp.float32):
    shape = (num_blocks, block_size, hkv, d)
    k = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape).astype(dtype)
    return k, -k


@pytest.mark.parametrize("impl", IMPLS)
def test_writes_land_at_block_and_offset(impl):
    k_pages, v_pages = _pages()
    k = jnp.full((3, 2, 8), 7.0)
    v = jnp.full((3, 2, 8), -7.0)
    slots = jnp.array([0, 2 * 4 + 3, 5], jnp.int32)  # (0,0), (2,3), (1,1)
    new_k, new_v = jax.jit(functools.partial(write_kv, impl=impl))(k_pages, v_pages, k, v, slots)
    expected_k, expected_v = np.array(k_pages), np.array(v_pages)
    for block, offset in [(0, 0), (2, 3), (1, 1)]:
        expected_k[block, offset] = 7.0
        expected_v[block, offset] = -7.0
    np.testing.assert_array_equal(new_k, expected_k)
    np.testing.assert_array_equal(new_v, expected_v)


@pytest.mark.parametrize("impl", IMPLS)
def test_padding_slots_are_dropped(impl):
    k_pages, v_pages = _pages()
    k = jnp.ones((4, 2, 8))
    slots = jnp.array([12, 10**6, -1, 1], jnp.int32)  # only slot 1 is real
    new_k, new_v = jax.jit(functools.partial(write_kv, impl=impl))(k_pages, v_pages, k, k, slots)
    expected = np.array(k_pages)
    expected[0, 1] = 1.0
    np.testing.assert_array_equal(new_k, expected)
    assert np.count_nonzero(np.asarray(new_v) != np.asarray(v_pages)) == 16


@pytest.mark.parametrize("impl", IMPLS)
def test_casts_to_page_dtype(impl):
    k_pages, v_pages = _pages(dtype=jnp.bfloat16)
    new_k, _ = write_kv(k_pages, v_pages, jnp.full((1, 2, 8), 0.5), jnp.ones((1, 2, 8)),
                        jnp.array([3], jnp.int32), impl=impl)
    assert new_k.dtype == jnp.bfloat16
    assert float(new_k[0, 3, 0, 0]) == 0.5


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_the_cpu_copy_equals_the_scatter_in_place(dtype):
    """Every page dtype, FP8 scales included, inside a scan carrying donated pages (the
    step's shape: the pages aliased with the result) and outside it."""
    if cpu_build.kernels_unavailable() is not None:
        pytest.skip(cpu_build.kernels_unavailable())
    k_pages, v_pages = _pages(num_blocks=5, dtype=dtype)
    rng = np.random.default_rng(0)
    k = jnp.asarray(rng.normal(size=(2, 6, 2, 8)), jnp.float32)  # two layers' rows
    slots = jnp.asarray([[0, 19, 7, -3, 20, 8], [1, 2, 3, 4, 5, 10**6]], jnp.int32)
    scales = dict(k_scale=jnp.float32(0.5), v_scale=jnp.float32(0.25)) if (
        jnp.dtype(dtype).itemsize == 1) else {}

    @functools.partial(jax.jit, static_argnames="impl", donate_argnums=(0, 1))
    def layers(kp, vp, impl):
        def body(pages, xs):
            rows, s = xs
            return write_kv(*pages, rows, 2 * rows, s, impl=impl, **scales), None

        return jax.lax.scan(body, (kp, vp), (k, slots))[0]

    want = layers(jnp.array(k_pages), jnp.array(v_pages), "xla")
    got = layers(jnp.array(k_pages), jnp.array(v_pages), "cpu")
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    with pytest.raises(KernelArgumentError, match="^impl:"):
        write_kv(k_pages, v_pages, k[0], k[0], slots[0], impl="triton")


@pytest.mark.parametrize("argument, kwargs", [
    ("k_pages", dict(k_pages=jnp.zeros((3, 4, 2)))),
    ("v_pages", dict(v_pages=jnp.zeros((3, 4, 2, 4)))),
    ("k", dict(k=jnp.zeros((2, 3, 8)))),
    ("v", dict(v=jnp.zeros((1, 2, 8)))),
    ("slot_mapping", dict(slot_mapping=jnp.zeros((3,), jnp.int32))),
    ("slot_mapping", dict(slot_mapping=jnp.zeros((2,), jnp.float32))),
])
def test_invalid_inputs_name_the_argument(argument, kwargs):
    k_pages, v_pages = _pages()
    args = dict(k_pages=k_pages, v_pages=v_pages, k=jnp.zeros((2, 2, 8)), v=jnp.zeros((2, 2, 8)),
                slot_mapping=jnp.zeros((2,), jnp.int32))
    args.update(kwargs)
    with pytest.raises(KernelArgumentError, match=f"^{argument}:"):
        write_kv(**args)
