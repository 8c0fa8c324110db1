"""Embeddings: pooling requests as prefill-only rows of the same scheduler.

The planner's side (chunks, no sampled row, finish and freed blocks, no prefix cache, the
overlapped fill), the sentence-transformers files (`pooler_config`), the device's pooled
sums against numpy, and end to end: `LLM.embed` on a random Qwen3 with a last-token
pooling config and a random Llama with mean pooling equals transformers' pooled hidden
states (cosine > 0.9999 in float32) while generation requests run in the same steps and
keep their greedy tokens.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import scheduler
from arcjax import LLM, PoolingParams, SamplingParams
from arcjax.errors import ModelConfigError, PoolingParamsError, RequestError
from arcjax.model.formats.pooler_config import PoolerConfig, read_pooler_config
from arcjax.runtime.pooling_inputs import PoolingRow, pool_rows, pooling_inputs
from support.hf_models import hf_greedy, hf_pooled, tiny_embedding_model_dir
from support.running_server import GEOMETRY  # the server tests' (a tiny Llama's steps are shared)
from support.scratch import scratch_dir


# --- the planner ------------------------------------------------------------------------
def _config(**kw) -> scheduler.SchedulerConfig:
    values = dict(max_num_batched_tokens=16, chunk_tile=8, block_size=4, num_blocks=32,
                  max_num_seqs=4, enable_prefix_caching=True)
    return scheduler.SchedulerConfig(**{**values, **kw})


def _pooling(rid, n=20) -> scheduler.Request:
    return scheduler.Request(request_id=rid, prompt_token_ids=tuple(range(1, n + 1)),
                             max_tokens=0, pooling=True)


def test_a_pooling_request_is_chunked_samples_nothing_and_keeps_no_kv():
    config = _config()
    gen = scheduler.Request(request_id="g", prompt_token_ids=(5, 6, 7), max_tokens=6)
    state = scheduler.add_request(scheduler.SchedulerState.empty(config), gen)
    state = scheduler.add_request(state, _pooling("p"))
    rows, finished = [], []
    for _ in range(8):
        plan = scheduler.schedule(state, config)
        if plan.is_empty:
            break
        rows += [(rid, start, n, s) for rid, start, n, s in zip(
            plan.request_ids, plan.starts, plan.lengths, plan.samples) if rid == "p"]
        state, done = scheduler.commit(plan.state, plan, [9] * plan.num_sampled, 1.0)
        finished += done
    # chunked (beside the prompt, then the decode), never sampling, the final chunk included
    assert [r[1:] for r in rows] == [(0, 8, False), (8, 12, False)]
    pooled = next(f for f in finished if f.request_id == "p")
    assert pooled.reason == scheduler.FINISH_STOP and pooled.output_token_ids == ()
    assert "p" not in state.held
    assert state.pool.num_in_use == 0  # the generation request finished too: nothing held


def test_pooling_requests_never_read_or_fill_the_prefix_cache():
    config = _config(max_num_batched_tokens=32)
    state = scheduler.add_request(scheduler.SchedulerState.empty(config), _pooling("a"))
    plan = scheduler.schedule(state, config)
    state, _ = scheduler.commit(plan.state, plan, [], 1.0)
    state = scheduler.add_request(state, _pooling("b"))
    plan = scheduler.schedule(state, config)
    assert plan.num_cached == (0,) and plan.starts == (0,)  # the same prompt: no hit
    state, done = scheduler.commit(plan.state, plan, [], 1.0)
    assert [f.num_cached_tokens for f in done] == [0]
    # a generation request with that prompt finds nothing cached either
    gen = scheduler.Request(request_id="g", prompt_token_ids=tuple(range(1, 21)), max_tokens=2)
    plan = scheduler.schedule(scheduler.add_request(state, gen), config)
    assert plan.num_cached == (0,)


def test_an_advanced_pooling_row_finishes_at_the_fill():
    config = _config(max_num_batched_tokens=32)
    state = scheduler.add_request(scheduler.SchedulerState.empty(config), _pooling("p", 12))
    plan = scheduler.schedule(state, config)
    ahead = scheduler.advance(plan.state, plan)
    assert "p" in ahead.held and scheduler.schedule(ahead, config).is_empty
    state, done = scheduler.commit(ahead, plan, [], 1.0)
    assert [(f.request_id, f.reason, f.output_token_ids) for f in done] == [("p", "stop", ())]
    assert not state.held and state.pool.num_in_use == 0


def test_pooling_requests_are_validated():
    config = _config()
    with pytest.raises(RequestError) as e:
        scheduler.validate_request(scheduler.Request(
            request_id="p", prompt_token_ids=(1, 2), max_tokens=1, pooling=True), config)
    assert e.value.field == "max_tokens"
    with pytest.raises(RequestError) as e:
        scheduler.validate_request(scheduler.Request(
            request_id="g", prompt_token_ids=(1, 2), max_tokens=0), config)
    assert e.value.field == "max_tokens"


# --- the sentence-transformers files ------------------------------------------------------
def _st_dir(modules, pooling_cfg=None, model_cfg=None) -> str:
    path = scratch_dir("arcjax-st-")
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(model_cfg or {}, f)
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump([{"idx": i, "name": str(i), "path": p, "type": f"sentence_transformers.models.{t}"}
                   for i, (t, p) in enumerate(modules)], f)
    if pooling_cfg is not None:
        os.makedirs(os.path.join(path, "1_Pooling"))
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump(pooling_cfg, f)
    return path


def test_pooler_config_from_sentence_transformers_files():
    base = [("Transformer", ""), ("Pooling", "1_Pooling")]
    cfg = read_pooler_config(_st_dir(base + [("Normalize", "2_Normalize")],
                                     {"pooling_mode_lasttoken": True}))
    assert cfg == PoolerConfig(pooling_type="LAST", normalize=True)
    cfg = read_pooler_config(_st_dir(base, {"pooling_mode_mean_tokens": True},
                                     {"matryoshka_dimensions": [16, 32]}))
    assert cfg == PoolerConfig(pooling_type="MEAN", normalize=False,
                               matryoshka_dimensions=(16, 32), is_matryoshka=True)
    assert read_pooler_config(_st_dir(base, {"pooling_mode_cls_token": True})).pooling_type == "CLS"
    bare = scratch_dir("arcjax-bare-")
    with open(os.path.join(bare, "config.json"), "w") as f:
        json.dump({"is_matryoshka": True}, f)
    assert read_pooler_config(bare) == PoolerConfig(is_matryoshka=True)  # LAST, normalized
    refused = [(base + [("Dense", "2_Dense")], {"pooling_mode_lasttoken": True}, "Dense"),
               (base, {"pooling_mode_max_tokens": True}, "pooling_mode_max_tokens"),
               (base, {"pooling_mode_lasttoken": True, "pooling_mode_mean_tokens": True},
                "exactly one"),
               ([("Transformer", "")], None, "no sentence_transformers Pooling")]
    for modules, pooling_cfg, words in refused:
        with pytest.raises(ModelConfigError, match=words):
            read_pooler_config(_st_dir(modules, pooling_cfg))


def test_pooled_sums_equal_numpy_for_every_pooling_type():
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    hidden = rng.standard_normal((16, 8)).astype(np.float32)  # [T, H], 3 rows + padding
    params = {"final_norm": jnp.asarray(rng.standard_normal(8), jnp.float32)}

    class Cfg:
        rms_norm_eps, norm_unit_offset = 1e-6, False

    starts, lengths = (4, 0, 8), (5, 3, 4)  # a middle chunk, a whole prompt, a last chunk
    rows = (PoolingRow("MEAN", 9), PoolingRow("CLS", 3), PoolingRow("LAST", 12))
    pooled = np.asarray(pool_rows(params, Cfg, jnp.asarray(hidden), pooling_inputs(
        starts, lengths, rows, np.array([4, 7, 11]), 16), 4))
    h = hidden / np.sqrt((hidden ** 2).mean(-1, keepdims=True) + 1e-6) * np.asarray(
        params["final_norm"])
    np.testing.assert_allclose(pooled[0], h[0:5].sum(0) / 9, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled[1], h[5], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(pooled[2], h[11], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(pooled[3], 0)


# --- end to end ---------------------------------------------------------------------------
def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _prompts(seed: int, lengths) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(map(int, rng.integers(3, 384, n))) for n in lengths]


def _mixed_steps(llm) -> list[bool]:
    """Records, per step the runner packs, whether it pooled and sampled at once."""
    runner, seen = llm.engine.runner, []
    prepare = runner.prepare

    def spy(plan, rows, prompts=None, pooling=None, *rest):
        seen.append(pooling is not None and plan.num_sampled > 0)
        return prepare(plan, rows, prompts, pooling, *rest)

    runner.prepare = spy
    return seen


@pytest.mark.parametrize("arch,mode,pooling,normalize,overlapped", [
    ("Qwen3ForCausalLM", "lasttoken", "LAST", True, True),
    ("LlamaForCausalLM", "mean_tokens", "MEAN", False, False),
])
def test_embeddings_equal_transformers_beside_generation(arch, mode, pooling, normalize,
                                                         overlapped):
    path = tiny_embedding_model_dir(arch, mode, normalize)
    llm = LLM(path, runner="pooling", async_scheduling=overlapped, **GEOMETRY)
    mixed = _mixed_steps(llm)
    gens = _prompts(1, (9, 30))
    gen_ids = [llm.add_request(p, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
               for p in gens]
    prompts = _prompts(0, (5, 150, 200, 17))  # 150 and 200 span several chunks
    outs = llm.embed(prompts, use_tqdm=False)
    for p, out in zip(prompts, outs):
        assert out.finished and out.finish_reason == "stop"
        assert out.outputs.hidden_size == 64 and out.prompt_token_ids == tuple(p)
        ref = hf_pooled(path, p, pooling, normalize)
        assert _cosine(out.outputs.embedding, ref) > 0.9999
        np.testing.assert_allclose(np.linalg.norm(out.outputs.embedding),
                                   np.linalg.norm(ref), rtol=1e-3)
    assert any(mixed)  # pooling rows and sampled rows ran in the same steps
    done = {}
    while llm.has_unfinished():
        done.update({o.request_id: o for o in llm.step() if o.finished})
    for rid, p in zip(gen_ids, gens):
        assert list(done[rid].token_ids) == hf_greedy(path, p, 12)
    assert llm.engine.blocks_in_use() == 0  # no KV kept after the last chunk
    # normalization asked against the model's default
    flipped = llm.embed(prompts[:1], PoolingParams(normalize=not normalize), use_tqdm=False)[0]
    assert _cosine(flipped.outputs.embedding, outs[0].outputs.embedding) > 0.9999
    assert bool(abs(np.linalg.norm(flipped.outputs.embedding) - 1) < 1e-5) is (not normalize)
    with pytest.raises(PoolingParamsError) as e:  # no matryoshka in these configs
        llm.embed(prompts[:1], PoolingParams(dimensions=16), use_tqdm=False)
    assert e.value.field == "dimensions"
    with pytest.raises(RequestError) as e:
        llm.embed(prompts[:1], SamplingParams(), use_tqdm=False)
    assert e.value.field == "pooling_params"


def test_dimensions_truncate_before_normalizing_and_generate_runners_refuse():
    src = tiny_embedding_model_dir("Qwen3ForCausalLM", "lasttoken", True)
    path = scratch_dir("arcjax-matryoshka-")
    shutil.copytree(src, path, dirs_exist_ok=True)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**cfg, "matryoshka_dimensions": [16, 32]}, f)
    llm = LLM(path, runner="pooling", **GEOMETRY)
    prompt = _prompts(2, (21,))[0]
    out = llm.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)[0]
    full = hf_pooled(path, prompt, "LAST", False)[:16]
    np.testing.assert_allclose(out.outputs.embedding, full / np.linalg.norm(full), atol=2e-5)
    with pytest.raises(PoolingParamsError) as e:
        llm.embed([prompt], PoolingParams(dimensions=24), use_tqdm=False)
    assert e.value.field == "dimensions"
    with pytest.raises(RequestError) as e:
        LLM(path, **GEOMETRY).embed([prompt], use_tqdm=False)
    assert e.value.field == "params" and "runner='pooling'" in str(e.value)
