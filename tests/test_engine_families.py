"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE), Gemma 2, Gemma 3 and gpt-oss (sinks,
alternating windows, YaRN, biased router and experts, clamped SwiGLU) through the engine, against transformers: greedy tokens and prompt log-probabilities, with prompts longer
than the sliding window, under every policy, chunk sizes, overlapped scheduling on and off,
prefix caching, KV blocks released behind the window, router statistics in the trace, chat
templates, and tensor / expert parallelism over forced CPU devices (a subprocess; gpt-oss's
MXFP4 experts too, split by expert while packed).

Engines of one architecture share one cache geometry, so they share compiled steps.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from support.device_caches import device_cache
from support.hf_models import (DEEPSEEK_V2, DEEPSEEK_V3, GPT_OSS, NEW_ARCHS, WINDOW,
                               hf_greedy, hf_logits, tiny_model_dir)
from support.hf_models import tiny_model_with_chat_template
from support.quantized_models import mxfp4_twins, quantized_checkpoint

HERE = Path(__file__).resolve().parent
# One token bucket (32) for every chunk: each engine compiles few steps.
GEOMETRY = dict(block_size=8, num_kv_blocks=64, max_model_len=128, max_num_seqs=4,
                attention_impl="auto", chunk_tile=32, max_num_batched_tokens=32)
LONG = 50  # > WINDOW: the window cuts every layer's (Mixtral) or local layers' (Gemma) view
MAX_TOKENS = 8
K = 3


def _prompts():
    rs = np.random.RandomState(21)
    return [rs.randint(3, 384, n).tolist() for n in (LONG, 9, 30)]


@functools.lru_cache(maxsize=None)
def _expected(arch: str, index: int) -> list[int]:
    return hf_greedy(tiny_model_dir(arch), _prompts()[index], MAX_TOKENS)


@device_cache
def _llm(arch: str, **options) -> LLM:
    return LLM(tiny_model_dir(arch), **{**GEOMETRY, **options})


def _log_softmax(x):
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("arch", NEW_ARCHS + (GPT_OSS,))
def test_greedy_and_prompt_logprobs_equal_transformers_then_prefix_cache(arch):
    """One prompt past the window, chunked (32-token budget): greedy tokens equal
    transformers', prompt log-probabilities are within 1e-4 of its log_softmax. Run again,
    the prefix cache serves the prompt's blocks (as far as the window needs them, for
    Mixtral) and the tokens do not change."""
    llm = _llm(arch)
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                            prompt_logprobs=K)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    assert list(first.token_ids) == _expected(arch, 0)
    ref = _log_softmax(hf_logits(tiny_model_dir(arch), prompt))
    for p in range(1, len(prompt)):
        entry = first.prompt_logprobs[p]
        assert abs(entry[prompt[p]].logprob - ref[p - 1, prompt[p]]) < 1e-4
        best = max(entry, key=lambda t: entry[t].logprob)
        assert entry[best].rank == 1 and abs(entry[best].logprob - ref[p - 1].max()) < 1e-4
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.token_ids == first.token_ids
    assert again.num_cached_tokens == (LONG - 1) // 8 * 8
    assert llm.engine.blocks_in_use() == 0
    llm.engine.check_trace()
    steps = list(llm.engine.trace)
    if llm.engine.runner.cfg.is_moe:  # tokens per expert per layer, every step
        cfg = llm.engine.runner.cfg
        for r in steps:
            assert len(r.expert_tokens) == cfg.num_layers
            computed = r.prefill_tokens + r.decode_tokens
            assert all(sum(layer) == cfg.num_experts_per_tok * computed
                       for layer in r.expert_tokens)
    else:
        assert all(r.expert_tokens is None for r in steps)


TOKEN_BUDGET = dict(policy="token_budget", async_scheduling=True)
PARTIALS_SERIAL = dict(policy="token_budget", max_num_partial_prefills=2,
                       async_scheduling=False, enable_prefix_caching=False)
ALTERNATE = dict(policy="alternate", async_scheduling=True)
WHOLE_PROMPTS = dict(policy="prefill_first", prefill_max_seqs=1, async_scheduling=False)


@pytest.mark.parametrize("arch, schedules", [
    ("MixtralForCausalLM", (TOKEN_BUDGET, PARTIALS_SERIAL, ALTERNATE, WHOLE_PROMPTS)),
    ("Gemma2ForCausalLM", (TOKEN_BUDGET, PARTIALS_SERIAL, ALTERNATE)),
    (GPT_OSS, (TOKEN_BUDGET, PARTIALS_SERIAL, ALTERNATE)),
], ids=["Mixtral", "Gemma2", "GptOss"])
def test_every_policy_and_overlap_equal_transformers(arch, schedules):
    """Three prompts (one past the window) under each policy (chunks of 32 tokens, whole
    prompts, several prompts chunked at once), overlapped or serial, prefix caching on or
    off: the same greedy tokens as transformers."""
    want = [_expected(arch, i) for i in range(3)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    for schedule in schedules:
        llm = _llm(arch, **schedule)
        outs = llm.generate(_prompts(), params, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == want, schedule
        assert llm.engine.blocks_in_use() == 0


def test_sliding_window_model_returns_blocks_behind_the_window():
    """Mixtral slides in every layer: a 50-token prompt generating 40 tokens holds, once it
    decodes, at most the window's blocks plus one (8-token blocks, window 24: 4), where a
    model without the window would end holding 12; the tokens equal transformers'."""
    llm = _llm("MixtralForCausalLM", async_scheduling=False)
    engine = llm.engine
    assert engine.sched_config.sliding_window == WINDOW
    prompt = _prompts()[0]
    engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    held, outs = [], []
    while engine.has_unfinished():
        outs += engine.step()
        held.append(engine.blocks_in_use())
    assert list([o for o in outs if o.finished][0].token_ids) == hf_greedy(
        tiny_model_dir("MixtralForCausalLM"), prompt, 40)
    decoding = held[2:-1]  # after the two prompt chunks, before the finish frees everything
    assert max(decoding) == WINDOW // 8 + 1 and held[-1] == 0
    assert _llm("Gemma2ForCausalLM").engine.sched_config.sliding_window is None  # global layer


GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if "
                  "m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] }}"
                  "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>"
                  "model\n{% endif %}")


def test_chat_template_on_gemma3():
    # prompt_logprobs: the same compiled steps as the parity test above (same model config)
    path = tiny_model_with_chat_template(GEMMA_TEMPLATE, arch="Gemma3ForCausalLM")
    llm = LLM(path, **GEOMETRY)
    conv = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
    out = llm.chat(conv, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True,
                                        prompt_logprobs=1), use_tqdm=False)[0]
    assert out.prompt.startswith("<s><start_of_turn>user\n")
    ids = llm.tokenizer.encode(out.prompt, add_special_tokens=False)
    assert list(out.token_ids) == hf_greedy(path, ids, MAX_TOKENS)


# ---- tensor and expert parallelism (a subprocess with 2 forced CPU devices) -------------------

@pytest.mark.parametrize("arch, options, match", [
    ("Gemma2ForCausalLM", dict(expert_parallel_size=2), "no experts"),
    ("MixtralForCausalLM", dict(expert_parallel_size=3), "divide the model's 4 experts"),
    ("MixtralForCausalLM", dict(expert_parallel_size=2), "exceeds the 1 available devices"),
    ("MixtralForCausalLM", dict(expert_parallel_size=0), "must be >= 1"),
])
def test_bad_expert_parallel_size_is_a_typed_error(arch, options, match):
    from arcjax.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match=match) as e:
        LLM(tiny_model_dir(arch), **{**GEOMETRY, **options})
    assert e.value.field == "expert_parallel_size"


# (architecture, tensor_parallel_size, expert_parallel_size); DeepSeek: latent attention
# split by head over whole latent pages (docs/decisions/0025-latent-attention-replicated.md),
# V3's dense first layer and shared experts split like dense MLPs, the experts by "ep"
PARALLEL_CASES = (("MixtralForCausalLM", 2, 2), ("Qwen2MoeForCausalLM", 1, 2),
                  ("Gemma2ForCausalLM", 2, 1), (GPT_OSS, 2, 2), (DEEPSEEK_V2, 2, 2),
                  (DEEPSEEK_V3, 2, 2))
LATENT_WEIGHTS = ("wkv_a", "wkv_b", "wo", "ws_up")  # the latent's own projection replicated
SUBPROCESS_TIMEOUT_S = 600


def _run_parallel(model_dirs: dict) -> dict:
    import jax

    assert jax.device_count() == 2
    out = {}
    for arch, tp, ep in PARALLEL_CASES:
        llm = LLM(model_dirs[arch], tensor_parallel_size=tp, expert_parallel_size=ep,
                  **GEOMETRY)
        res = llm.generate([_prompts()[0]], SamplingParams(max_tokens=MAX_TOKENS,
                                                           temperature=0, ignore_eos=True),
                           use_tqdm=False)
        runner = llm.engine.runner
        layers = runner.params["layers"]
        spec = (list(layers["we_gate"].sharding.spec) if "we_gate" in layers else None)
        out[f"{arch}/{tp}/{ep}"] = {"tokens": list(res[0].token_ids), "we_gate": spec,
                                    "experts": [r.expert_tokens for r in llm.engine.trace],
                                    "cache_split": runner.parallel.cache_split(runner.cfg)}
        if runner.cfg.is_mla:
            arrays = {**{n: layers[n] for n in LATENT_WEIGHTS}, "cache": runner.cache["k"],
                      **({"dense_w_gate": runner.params["dense_layers"]["w_gate"]}
                         if "dense_layers" in runner.params else {})}
            out[f"{arch}/{tp}/{ep}"]["specs"] = {
                name: ("replicated" if x.sharding.is_fully_replicated
                       else [str(a) for a in x.sharding.spec]) for name, x in arrays.items()}
    out["int8"] = _quantized_experts_split(model_dirs["MixtralForCausalLM"])
    out["mxfp4"] = _mxfp4_experts_split(model_dirs["mxfp4"])
    out["deepseek_fp8"] = _fp8_latent_split(model_dirs["deepseek_fp8"])
    out["lora"] = _lora_with_experts_split(model_dirs["MixtralForCausalLM"],
                                           model_dirs["lora"])
    return out


def _mxfp4_experts_split(model_dir: str) -> dict:
    """gpt-oss's MXFP4 experts kept packed under tp = ep = 2: the greedy tokens, and the
    shardings and dtype of the gate and down blocks."""
    llm = LLM(model_dir, tensor_parallel_size=2, expert_parallel_size=2, **GEOMETRY)
    res = llm.generate([_prompts()[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)
    layers = llm.engine.runner.params["layers"]
    return {"tokens": list(res[0].token_ids), "dtype": str(layers["we_gate"].blocks.dtype),
            **{k: [str(a) for a in layers[k].blocks.sharding.spec]
               for k in ("we_gate", "we_down")}}


def _fp8_latent_split(model_dir: str) -> dict:
    """DeepSeek-V3's block-scaled FP8 checkpoint (16 x 16 tiles) loaded as stored under
    tp = ep = 2: the greedy tokens, and how wkv_b's values and scales split."""
    llm = LLM(model_dir, tensor_parallel_size=2, expert_parallel_size=2, **GEOMETRY)
    res = llm.generate([_prompts()[0]], SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)
    w = llm.engine.runner.params["layers"]["wkv_b"]
    return {"tokens": list(res[0].token_ids), "dtype": str(w.values.dtype),
            **{k: [str(a) for a in getattr(x.sharding, "spec", ())]
               for k, x in (("values", w.values), ("scale", w.scale))}}


def _lora_with_experts_split(model_dir: str, adapter: str) -> dict:
    """Mixtral at tp=2, ep=2 with a LoRA adapter on its attention: the base model's prompt
    and the adapter's in one call; how wq's B slots split."""
    from arcjax import LoRARequest

    llm = LLM(model_dir, tensor_parallel_size=2, expert_parallel_size=2, enable_lora=True,
              max_loras=1, max_lora_rank=8, **GEOMETRY)
    prompts = _prompts()[1:]
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                ignore_eos=True), use_tqdm=False,
                        lora_request=[None, LoRARequest("attn", 1, adapter)])
    b = llm.engine.runner.lora.buffers["wq"]["b"]  # [L, S, r, Hq * D]
    wq = llm.engine.runner.params["layers"]["wq"]  # [L, H, Hq * D]
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "wq_b": [str(a) for a in getattr(b.sharding, "spec", ())],
            "wq": [str(a) for a in getattr(wq.sharding, "spec", ())]}


def _quantized_experts_split(model_dir: str) -> dict:
    """int8 experts loaded into their shards (tp splits each expert's width: gate/up scales
    split with their output columns, down's whole beside its split rows; ep splits values
    and scales by expert) and one layer's `moe_mlp` run under the split: its output per
    (tp, ep), to compare with one device's."""
    import jax
    import jax.numpy as jnp

    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import load_model
    from arcjax.model.moe import moe_mlp
    from arcjax.model.formats.hf_layout import read_config
    from arcjax.parallel import TensorParallel

    cfg = read_config(model_dir)
    h = jax.random.normal(jax.random.key(0), (16, cfg.hidden_size), jnp.float32)
    out = {}
    for tp, ep in ((1, 1), (2, 1), (1, 2)):
        parallel = None if tp == ep == 1 else TensorParallel.create(cfg, tp, ep=ep)
        layers = load_model(resolve_model(model_dir), dtype=jnp.float32, parallel=parallel,
                            quantization="int8").params["layers"]
        experts = {k: layers[k] for k in ("we_gate", "we_up", "we_down")}
        mlp = jax.jit(functools.partial(
            moe_mlp, num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok,
            renormalize=cfg.norm_topk_prob, act=cfg.hidden_act, impl="tiled",
            parallel=parallel))
        y, _ = mlp(h, {"router": layers["router"][1]}, experts, jnp.int32(1),
                   valid=jnp.ones(16, bool))
        down = experts["we_down"]
        out[f"{tp}/{ep}"] = {"out": np.asarray(y).tolist(),
                             "values": [str(a) for a in getattr(down.values.sharding, "spec", ())],
                             "scale": [str(a) for a in getattr(down.scale.sharding, "spec", ())]}
    return out


def test_tensor_and_expert_parallel_equal_transformers():
    from support.lora_adapters import ATTENTION_TARGETS, peft_adapter_dir, peft_greedy

    dirs = {arch: tiny_model_dir(arch) for arch, _, _ in PARALLEL_CASES}
    dirs["mxfp4"], decoded = mxfp4_twins()
    dirs["deepseek_fp8"], fp8_twin = quantized_checkpoint(
        "block", src=tiny_model_dir(DEEPSEEK_V3), block=16)
    adapter = peft_adapter_dir("MixtralForCausalLM", rank=8, seed=7, targets=ATTENTION_TARGETS)
    dirs["lora"] = adapter
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, json.dumps(dirs)], env=env,
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for arch, tp, ep in PARALLEL_CASES:
        case = got[f"{arch}/{tp}/{ep}"]
        assert case["tokens"] == _expected(arch, 0), (arch, tp, ep)
    # experts split over "ep" (each one's width over what tp leaves); with ep > tp over both
    # mesh axes (attention replicated over "ep")
    assert got["MixtralForCausalLM/2/2"]["we_gate"] == [None, "ep", None, "tp"]
    assert got["Qwen2MoeForCausalLM/1/2"]["we_gate"] == [None, ["ep", "tp"], None, None]
    assert all(len(r) == 2 for r in got["MixtralForCausalLM/2/2"]["experts"])
    # latent attention: the heads' projections split, the latent's own and its pages whole
    for arch in (DEEPSEEK_V2, DEEPSEEK_V3):
        specs, tp_ep = got[f"{arch}/2/2"]["specs"], "('ep', 'tp')"
        assert specs["wkv_a"] == specs["cache"] == "replicated", arch
        assert specs["wkv_b"] == ["None", "None", tp_ep] and specs["wo"] == ["None", tp_ep,
                                                                              "None"], arch
        assert specs["ws_up"] == ["None", "None", tp_ep], arch  # shared experts: a dense MLP
    assert got[f"{DEEPSEEK_V3}/2/2"]["specs"]["dense_w_gate"] == ["None", "None", "('ep', 'tp')"]
    assert got[f"{DEEPSEEK_V3}/2/2"]["we_gate"] == [None, "ep", None, "tp"]
    # what the cache sizing divides a block's bytes by: the KV heads' split, latents' none
    assert got["MixtralForCausalLM/2/2"]["cache_split"] == 2
    assert got[f"{DEEPSEEK_V3}/2/2"]["cache_split"] == 1
    q = got["int8"]  # quantized experts split: one device's output, specs covering scales
    for key in ("2/1", "1/2"):
        np.testing.assert_allclose(q[key]["out"], q["1/1"]["out"], atol=1e-5, err_msg=key)
    assert q["2/1"]["values"] == ["None", "None", "tp", "None"]
    assert q["2/1"]["scale"] in (["None", "None", "None", "None"], [])
    assert q["1/2"]["values"][:2] == q["1/2"]["scale"][:2] == ["None", "('ep', 'tp')"]
    mx = got["mxfp4"]  # MXFP4 experts stay packed, split by expert (gate/up rows by tp)
    assert mx["tokens"] == hf_greedy(decoded, _prompts()[0], MAX_TOKENS)
    assert mx["dtype"] == "uint8"
    assert mx["we_gate"] == ["None", "ep", "tp", "None", "None"]
    assert mx["we_down"][:2] == ["None", "ep"]
    # DeepSeek-V3's FP8 format as stored: transformers on the dequantized twin; wkv_b's
    # values split by head, its tiles' scales whole on every device (`quant.scale_axes`)
    fp8 = got["deepseek_fp8"]
    assert fp8["tokens"] == hf_greedy(fp8_twin, _prompts()[0], MAX_TOKENS)
    assert fp8["dtype"] == "float8_e4m3fn"
    assert fp8["values"] == ["None", "None", "('ep', 'tp')"]
    assert fp8["scale"] == ["None", "None", "None"]
    # a LoRA adapter on the attention of experts split over "ep": the base model's row and
    # the adapter's row in one call, each its own transformers (+ PEFT) tokens; B of wq
    # splits its out axis like wq
    lora = got["lora"]
    mixtral = tiny_model_dir("MixtralForCausalLM")
    want = [peft_greedy(mixtral, a, p, MAX_TOKENS)
            for a, p in zip((None, adapter), _prompts()[1:])]
    assert want[1] != peft_greedy(mixtral, None, _prompts()[2], MAX_TOKENS)
    assert lora["tokens"] == want
    assert lora["wq_b"][:3] == ["None"] * 3 and lora["wq_b"][3] == lora["wq"][2] != "None"


if __name__ == "__main__":
    print(json.dumps(_run_parallel(json.loads(sys.argv[1]))))


@pytest.mark.parametrize("arch", ["MixtralForCausalLM", "Gemma2ForCausalLM"])
def test_speculative_decoding_with_windows_experts_and_softcaps(arch):
    """n-gram drafts on a model whose every layer slides (Mixtral: blocks behind the window go
    back to the pool while rows verify drafts) and one with local/global layers and soft-caps
    (Gemma 2), prompts past the window, overlapped on and off: transformers' greedy tokens."""
    spec = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3, "disable_by_batch_size": None}
    prompts = _prompts()
    # a prompt that repeats itself gives the n-gram proposer something to find
    prompts = [prompts[0], (prompts[1] * 6)[:LONG]]
    want = [hf_greedy(tiny_model_dir(arch), p, 24) for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for overlapped in (False, True):
        llm = LLM(tiny_model_dir(arch), speculative_config=spec, async_scheduling=overlapped,
                  **GEOMETRY)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert [list(o.token_ids) for o in outs] == want, overlapped
        assert sum(o.metrics.num_draft_tokens for o in outs) > 0
        assert llm.engine.blocks_in_use() == 0
        llm.engine.check_trace()
