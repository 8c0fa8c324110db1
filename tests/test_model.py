"""The decoder against transformers: logits, chunk invariance, greedy decoding,
isolation of sequences sharing a batch, and the loader's errors."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.errors import ModelConfigError, ModelFileError
from arcjax.runtime.batching import build_batch
from arcjax.runtime.buckets import Bucket
from arcjax.model import forward, forward_dense, make_cache
from arcjax.errors import WeightsError
from arcjax.model.formats.hf_checkpoint import load_hf, save_hf
from support.device_caches import device_cache
from support.hf_models import ARCHS, hf_greedy, hf_logits, tiny_model_dir

BLOCK = 4
NUM_BLOCKS = 64
MAX_BLOCKS = 32


def _tol(ref):
    return 1e-4 * max(1.0, float(np.abs(ref).max()))


@device_cache
def _load(arch):
    return load_hf(tiny_model_dir(arch))


_step = jax.jit(forward, static_argnames=("cfg", "attn_impl", "dtype"))


class PagedRunner:
    """Drives the paged forward for a few sequences with scrambled block tables."""

    def __init__(self, arch, seed=0, impl="xla"):
        self.cfg, self.params = _load(arch)
        self.cache = make_cache(self.cfg, NUM_BLOCKS, BLOCK)
        self.free = list(np.random.RandomState(seed).permutation(NUM_BLOCKS))
        self.tables: dict[int, list[int]] = {}
        self.impl = impl

    def step(self, chunks):
        """chunks: list of (seq, token_ids, start). Returns logits [len(chunks), V]."""
        packed = []
        for seq, ids, start in chunks:
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK < start + len(ids):
                table.append(int(self.free.pop()))
            packed.append((ids, start, table))
        ids, starts, tables = zip(*packed)
        batch = build_batch([t for i in ids for t in i], starts, [len(i) for i in ids], tables,
                            bucket=Bucket(64, 8, 64), max_blocks=MAX_BLOCKS,
                            block_size=BLOCK, num_blocks=NUM_BLOCKS)
        batch = jax.tree.map(jnp.asarray, batch)
        logits, self.cache = _step(self.params, self.cache, batch, cfg=self.cfg,
                                   attn_impl=self.impl)
        return np.asarray(logits)[:len(chunks)]


def _prompt(seed, n, vocab=384):
    return np.random.RandomState(seed).randint(3, vocab, n).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch):
    cfg, params = _load(arch)
    ids = _prompt(1, 24)
    ref = hf_logits(tiny_model_dir(arch), ids)  # [L, V]
    dense = np.asarray(forward_dense(params, cfg, jnp.asarray([ids], jnp.int32)))[0]
    np.testing.assert_allclose(dense, ref, atol=_tol(ref), rtol=0)
    paged = PagedRunner(arch).step([(0, ids, 0)])[0]
    np.testing.assert_allclose(paged, ref[-1], atol=_tol(ref), rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_chunk_invariance(arch):
    """1 token, then 7, then the rest, through the paged cache == one shot == transformers."""
    impl = "xla"
    ids = _prompt(2, 30)
    ref = hf_logits(tiny_model_dir(arch), ids)[-1]
    one_shot = PagedRunner(arch, seed=3, impl=impl).step([(0, ids, 0)])[0]
    runner = PagedRunner(arch, seed=4, impl=impl)
    for start, end in ((0, 1), (1, 8), (8, 30)):
        last = runner.step([(0, ids[start:end], start)])[0]
    np.testing.assert_allclose(last, one_shot, atol=_tol(ref), rtol=0)
    np.testing.assert_allclose(last, ref, atol=_tol(ref), rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_32_tokens_match_transformers(arch):
    ids = _prompt(5, 11)
    expected = hf_greedy(tiny_model_dir(arch), ids, 32)
    runner = PagedRunner(arch, seed=6)
    logits = runner.step([(0, ids, 0)])[0]
    tokens = ids[:]
    for _ in range(32):
        tokens.append(int(np.argmax(logits)))
        logits = runner.step([(0, tokens[-1:], len(tokens) - 1)])[0]
    assert tokens[len(ids):] == expected


def test_sequences_sharing_a_batch_do_not_leak():
    """One sequence decodes while another prefills in the same step; each equals its
    own single-sequence result."""
    arch = "Qwen3ForCausalLM"
    a, b = _prompt(7, 13), _prompt(8, 21)
    alone_a = PagedRunner(arch, seed=1)
    alone_a.step([(0, a[:-1], 0)])
    want_a = alone_a.step([(0, a[-1:], len(a) - 1)])[0]
    want_b = PagedRunner(arch, seed=2).step([(1, b, 0)])[0]
    mixed = PagedRunner(arch, seed=9)
    mixed.step([(0, a[:-1], 0)])
    got_a, got_b = mixed.step([(0, a[-1:], len(a) - 1), (1, b, 0)])
    tol = _tol(want_a)
    np.testing.assert_allclose(got_a, want_a, atol=tol, rtol=0)
    np.testing.assert_allclose(got_b, want_b, atol=tol, rtol=0)


def test_save_hf_roundtrip_and_orbax_cache(tmp_path):
    cfg, params = _load("Qwen2ForCausalLM")
    save_hf(params, cfg, tmp_path / "m")
    cfg2, params2 = load_hf(tmp_path / "m", cache_dir=tmp_path / "cache")
    assert cfg2 == cfg
    assert any((tmp_path / "cache").iterdir())
    cfg3, params3 = load_hf(tmp_path / "m", cache_dir=tmp_path / "cache")
    for x, y, z in zip(jax.tree.leaves(params), jax.tree.leaves(params2), jax.tree.leaves(params3)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
        np.testing.assert_array_equal(np.asarray(x), np.asarray(z))


def test_bfloat16_load_and_export(tmp_path):
    cfg, params = load_hf(tiny_model_dir("LlamaForCausalLM"), dtype=jnp.bfloat16)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    save_hf(params, cfg, tmp_path, dtype=jnp.bfloat16)
    ids = _prompt(3, 9)
    ref = hf_logits(str(tmp_path), ids)
    out = np.asarray(forward_dense(params, cfg, jnp.asarray([ids], jnp.int32)))[0]
    np.testing.assert_allclose(out, ref, atol=1e-3 * max(1, np.abs(ref).max()), rtol=0)


def test_sharded_checkpoint(tmp_path):
    import transformers

    src = tiny_model_dir("LlamaForCausalLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    cfg, params = load_hf(tmp_path)
    _, want = _load("LlamaForCausalLM")
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _copy(tmp_path, arch="LlamaForCausalLM"):
    dst = tmp_path / "model"
    shutil.copytree(tiny_model_dir(arch), dst)
    return dst


def test_error_unsupported_architecture(tmp_path):
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        load_hf(d)


def test_error_missing_files(tmp_path):
    with pytest.raises(ModelConfigError, match="config.json") as err:
        load_hf(tmp_path)
    assert err.value.path.endswith("config.json")
    d = _copy(tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_hf(d)


def test_error_missing_tensor_and_shape_mismatch(tmp_path):
    from safetensors.numpy import load_file, save_file as write_safetensors

    d = _copy(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj.weight"
    bad = dict(tensors)
    bad[name] = bad[name][:, :-1]
    write_safetensors(bad, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=rf"model.safetensors: tensor {name} has shape"):
        load_hf(d)
    del bad[name]
    write_safetensors(bad, str(d / "model.safetensors"))
    with pytest.raises(WeightsError, match=rf"tensor {name} is missing"):
        load_hf(d)


def test_error_corrupt_header(tmp_path):
    d = _copy(tmp_path)
    Path(d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        load_hf(d)


def test_error_truncated_file_and_absurd_header_name_the_file(tmp_path):
    d = _copy(tmp_path)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    path.write_bytes(raw[:len(raw) // 2])
    with pytest.raises(WeightsError, match="model.safetensors: not a readable") as err:
        load_hf(d)
    assert err.value.path == str(path)
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")  # a header of 2**62 bytes
    with pytest.raises(WeightsError, match="model.safetensors"):
        load_hf(d)


@pytest.mark.parametrize("text, match", [("[1, 2]", "expected a JSON object, got list"),
                                         ("{not json", "not valid JSON"),
                                         ('{"architectures": ["LlamaForCausalLM"]}',
                                          "required field")])
def test_error_malformed_config_names_the_file(tmp_path, text, match):
    d = _copy(tmp_path)
    (d / "config.json").write_text(text)
    with pytest.raises(ModelFileError, match=match) as err:
        load_hf(d)
    assert err.value.path == str(d / "config.json")
