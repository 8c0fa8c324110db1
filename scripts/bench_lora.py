"""Times LoRA serving: the per-token delta of one projection, and whole engines.

Delta (default): the per-token LoRA delta of one projection (`arcjax.model.lora_delta`),
every implementation side by side.

  1. One projection of width `--dims` (in,out), `--slots` adapters of rank `--rank` (slot 0,
     the base model's, zeros, as in the engine), at each of `--tokens` token counts.
  2. Tokens are spread over the adapters round-robin, with `--base_share` of them on the
     base model (slot 0).
  3. Per case, every implementation is compiled and warmed, then they run round-robin
     `--iters` times (each run synchronized) and each reports its median: load that drifts
     during the run hits every arm alike. The dense base projection `x @ W` of the same
     shape is timed beside them, as the yardstick the delta adds to.

Engine (`--engine`): `--requests` greedy requests (`--prompt_len` tokens, `--max_tokens` out)
on the model (`--model`; default the packaged one), run three ways in one process: all on the
base model; spread over `--adapters` random adapters of rank `--rank` on all seven projections
with a slot each; and the same adapters in `--swap_slots` slots (slots swap). Each arm gets a
fresh engine (prefix caching off, every bucket compiled), one untimed run of the same
requests, then one timed run; it reports
generated tokens per second, its ratio to the base model's, and the slot swaps with the host
seconds they took.

CPU (what docs/design/lora.md reports): python scripts/bench_lora.py --out=/tmp/lora.json
Engine on the CPU:                      python scripts/bench_lora.py --engine --out=/tmp/e.json
Smoke test (seconds):                   python scripts/bench_lora.py --small
"""

from __future__ import annotations

import functools
import json
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from arcjax.model.lora_delta import IMPLS, lora_delta

_SMALL = flags.DEFINE_boolean("small", False, "tiny shapes, 3 runs: a smoke test")
_TOKENS = flags.DEFINE_list("tokens", ["8", "64", "512"], "token counts (rows of x)")
_DIMS = flags.DEFINE_list("dims", ["2048", "2048"], "the projection's in and out widths")
_SLOTS = flags.DEFINE_integer("slots", 8, "adapter slots (slot 0 comes on top)")
_RANK = flags.DEFINE_integer("rank", 16, "every slot's rank")
_BASE_SHARE = flags.DEFINE_float("base_share", 0.25, "share of tokens on the base model")
_IMPLS = flags.DEFINE_list("impls", list(IMPLS), "implementations to time")
_DTYPE = flags.DEFINE_string("dtype", "float32", "compute dtype")
_WARMUP = flags.DEFINE_integer("warmup", 2, "untimed runs per case (the first compiles)")
_ITERS = flags.DEFINE_integer("iters", 20, "timed runs per case; the median is reported")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_ENGINE = flags.DEFINE_boolean("engine", False, "time whole engines instead of the delta")
_MODEL = flags.DEFINE_string("model", None, "engine: model directory (None: the packaged one)")
_REQUESTS = flags.DEFINE_integer("requests", 64, "engine: requests per run")
_ADAPTERS = flags.DEFINE_integer("adapters", 8, "engine: adapters the requests spread over")
_SWAP_SLOTS = flags.DEFINE_integer("swap_slots", 2, "engine: slots of the swapping arm")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 64, "engine: prompt tokens")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 32, "engine: tokens generated per request")


@functools.partial(jax.jit, static_argnames="impl")
def _delta(x, a, b, slots, *, impl):
    return lora_delta(x, a, b, slots, impl=impl)


@jax.jit
def _base(x, w):
    return x @ w


def _case(tokens: int, d_in: int, d_out: int, dtype) -> dict:
    rng = np.random.default_rng(tokens)
    num = _SLOTS.value + 1
    x = jnp.asarray(rng.normal(size=(tokens, d_in)), dtype)
    a = rng.normal(size=(num, d_in, _RANK.value)) * 0.02
    b = rng.normal(size=(num, _RANK.value, d_out)) * 0.02
    a[0], b[0] = 0, 0
    a, b = jnp.asarray(a, dtype), jnp.asarray(b, dtype)
    w = jnp.asarray(rng.normal(size=(d_in, d_out)) * 0.02, dtype)
    slots = np.arange(tokens) % _SLOTS.value + 1
    slots[rng.random(tokens) < _BASE_SHARE.value] = 0
    slots = jnp.asarray(slots, jnp.int32)
    arms = {impl: functools.partial(_delta, x, a, b, slots, impl=impl) for impl in _IMPLS.value}
    arms["base_matmul"] = functools.partial(_base, x, w)
    for fn in arms.values():
        for _ in range(_WARMUP.value):
            fn().block_until_ready()
    times: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(_ITERS.value):
        for name, fn in arms.items():
            t0 = time.perf_counter()
            fn().block_until_ready()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}  # microseconds


def _write_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT adapter of `rank` on every projection of `cfg`, as PEFT saves one."""
    from safetensors.numpy import save_file

    from arcjax.lora.peft_adapter import PROJECTIONS, projection_shapes

    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, (d_in, d_out) in projection_shapes(cfg).items():
            name = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj][0]}.{proj}"
            tensors[f"{name}.lora_A.weight"] = (rng.normal(size=(rank, d_in)) * 0.02).astype(
                np.float32)
            tensors[f"{name}.lora_B.weight"] = (rng.normal(size=(d_out, rank)) * 0.02).astype(
                np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": sorted(projection_shapes(cfg))}))


def _engine_arm(model, prompts, params, requests, slots: int | None) -> dict:
    from arcjax import LLM

    options = {} if slots is None else dict(enable_lora=True, max_loras=slots,
                                            max_lora_rank=_RANK.value,
                                            max_cpu_loras=_ADAPTERS.value)
    llm = LLM(model, max_num_seqs=min(64, _REQUESTS.value), enable_prefix_caching=False,
              **options)
    llm.warmup()  # every bucket compiled: the timed run compiles nothing
    llm.generate(prompts, params, use_tqdm=False, lora_request=requests)  # host caches warm
    table = llm.engine.runner.lora
    swaps0, load0 = (table.swaps, table.load_seconds) if table else (0, 0.0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    arm = {"seconds": seconds, "tokens_per_s": tokens / seconds}
    if table is not None:
        arm |= {"slot_swaps": table.swaps - swaps0, "swap_seconds": table.load_seconds - load0}
    return arm


def _engine_main() -> dict:
    import tempfile

    from arcjax import LoRARequest, SamplingParams
    from arcjax.engine.build import default_model_path
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import model_config

    model = _MODEL.value or str(default_model_path())
    cfg = model_config(resolve_model(model))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, cfg.vocab_size, _PROMPT_LEN.value).tolist()
               for _ in range(_REQUESTS.value)]
    params = SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = []
        for i in range(_ADAPTERS.value):
            _write_adapter(Path(tmp) / f"a{i}", cfg, _RANK.value, seed=i)
            adapters.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        spread = [adapters[i % len(adapters)] for i in range(_REQUESTS.value)]
        arms = {"base": _engine_arm(model, prompts, params, None, None),
                "adapters": _engine_arm(model, prompts, params, spread, _ADAPTERS.value),
                "swapping": _engine_arm(model, prompts, params, spread, _SWAP_SLOTS.value)}
    base = arms["base"]["tokens_per_s"]
    for name, arm in arms.items():
        arm["vs_base"] = arm["tokens_per_s"] / base
        print(f"{name:9s} {arm['tokens_per_s']:9.1f} tok/s  {arm['vs_base']:.2f}x base"
              + (f"  {arm['slot_swaps']} swaps, {arm['swap_seconds']:.3f} s"
                 if "slot_swaps" in arm else ""))
    return {"platform": jax.default_backend(), "model": model, "requests": _REQUESTS.value,
            "adapters": _ADAPTERS.value, "swap_slots": _SWAP_SLOTS.value, "rank": _RANK.value,
            "prompt_len": _PROMPT_LEN.value, "max_tokens": _MAX_TOKENS.value, "arms": arms}


def main(argv):
    del argv
    if _ENGINE.value:
        if _SMALL.value:
            flags.FLAGS.requests, flags.FLAGS.adapters, flags.FLAGS.max_tokens = 8, 4, 4
        results = _engine_main()
        if _OUT.value:
            with open(_OUT.value, "w") as f:
                json.dump(results, f, indent=2)
        return
    if _SMALL.value:
        FLAGS = flags.FLAGS
        FLAGS.tokens, FLAGS.dims, FLAGS.slots, FLAGS.iters = ["8", "32"], ["64", "64"], 2, 3
    d_in, d_out = (int(d) for d in _DIMS.value)
    dtype = jnp.dtype(_DTYPE.value)
    results = {"platform": jax.default_backend(), "device": str(jax.devices()[0]),
               "host": platform.node(), "dims": [d_in, d_out], "slots": _SLOTS.value,
               "rank": _RANK.value, "dtype": str(dtype), "base_share": _BASE_SHARE.value,
               "cases": {}}
    for tokens in (int(t) for t in _TOKENS.value):
        us = _case(tokens, d_in, d_out, dtype)
        results["cases"][str(tokens)] = us
        print(f"T={tokens:5d}  " + "  ".join(f"{k} {v:9.1f} us" for k, v in us.items()))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    app.run(main)
