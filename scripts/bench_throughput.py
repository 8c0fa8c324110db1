"""Offline throughput: arcjax vs transformers' batched `generate`, same model, one run.

A fixed-seed workload of ragged requests (prompt and output lengths drawn uniformly) is
generated greedily by arcjax (after warm-up) and by transformers (CPU torch, batches of
`--hf_batch` left-padded prompts, `max_new_tokens` = the batch's longest output, every
row then truncated to its own length). Prints tokens/s for each and the ratio.

  python scripts/bench_throughput.py --num_requests=256 --out=runs/throughput.json
"""

from __future__ import annotations

import dataclasses
import json
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
_SKIP_HF = flags.DEFINE_bool("skip_hf", False, "only run arcjax")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_CC = flags.DEFINE_string("compilation_cache_dir", None, "JAX persistent compilation cache")


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


def run_arcjax(model_dir, wl: Workload) -> dict:
    import arcjax
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    max_len = max(len(p) + o for p, o in zip(wl.prompts, wl.outputs))
    if _CC.value:
        enable_persistent_compilation_cache(_CC.value)
    llm = arcjax.LLM(model_dir, max_model_len=max_len, max_num_batched_tokens=_BUDGET.value,
                     max_num_seqs=_SEQS.value)
    warm = llm.warmup()
    params = [arcjax.SamplingParams(max_tokens=o, temperature=0, ignore_eos=True)
              for o in wl.outputs]
    t0 = time.perf_counter()
    outs = llm.generate(wl.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {"warmup_s": warm, "wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "steps": llm.engine.num_steps, "tokens": [list(o.token_ids) for o in outs]}


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


def main(argv):
    del argv
    import arcjax
    from arcjax.model.weights import read_config

    model_dir = _MODEL.value or str(arcjax.default_model_path())
    vocab = read_config(model_dir).vocab_size
    wl = Workload.make(_N.value, [int(x) for x in _PROMPT.value],
                       [int(x) for x in _OUTPUT.value], vocab, _SEED.value)
    res = {"model": model_dir, "num_requests": _N.value, "prompt_len": _PROMPT.value,
           "output_len": _OUTPUT.value, "seed": _SEED.value}
    res["arcjax"] = run_arcjax(model_dir, wl)
    print(f"arcjax:       {res['arcjax']['tok_s']:9.1f} tok/s  ({res['arcjax']['wall_s']:.1f} s, "
          f"warm-up {res['arcjax']['warmup_s']:.1f} s)")
    if not _SKIP_HF.value:
        res["transformers"] = run_transformers(model_dir, wl, _HF_BATCH.value)
        hf = res["transformers"]
        print(f"transformers: {hf['tok_s']:9.1f} tok/s  ({hf['wall_s']:.1f} s, batch {_HF_BATCH.value})")
        res["ratio"] = res["arcjax"]["tok_s"] / hf["tok_s"]
        same = sum(a == b for a, b in zip(res["arcjax"]["tokens"], hf["tokens"]))
        res["identical_outputs"] = same
        print(f"ratio arcjax/transformers: {res['ratio']:.2f}x; identical greedy outputs: "
              f"{same}/{_N.value}")
    for k in ("arcjax", "transformers"):
        if k in res:
            res[k].pop("tokens")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
