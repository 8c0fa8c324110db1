"""Where one request's logprobs stop being bitwise identical to its solo run.

For each model and dtype, a probe request (a 300-token prompt, 12 greedy tokens, the
sampled tokens' logprobs) runs alone, then under each variation of
`arcjax.bench.invariance.variations()`: inside batches of random other requests, its prompt
chunked at 16, 64 and 256 tokens, after a prefix-cache hit of 16, 64 and 256 tokens, with
n-gram speculation, overlapped. Each row says whether the greedy tokens and the logprobs'
bits equal the solo run's and, with --locate, the first layer and operation whose output
differs (`arcjax.bench.step_replay`: the steps that computed the probe's rows replayed
equation by equation, its rows digested per absolute position).

    python scripts/invariance_report.py --models=llama,gemma2,qwen3_moe,default \
        --dtypes=float32,bfloat16 --locate --out=runs/invariance.json

Models: the tiny random-weight models of tests/support/hf_models.py by short name (llama,
mistral, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe, gemma2, gemma3) and "default" (the
packaged model). Prints a markdown table (the one in RESULTS.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

from absl import app, flags

_MODELS = flags.DEFINE_list("models", ["llama", "default"], "models (see the docstring)")
_DTYPES = flags.DEFINE_list("dtypes", ["float32", "bfloat16"], "compute dtypes")
_ONLY = flags.DEFINE_list("variations", None, "names of the variations to run (default all)")
_LOCATE = flags.DEFINE_bool("locate", False, "replay differing runs to name the first "
                            "differing layer and operation (minutes per run on a CPU)")
_NEW = flags.DEFINE_integer("new_tokens", 12, "tokens the probe generates")
_PROMPT = flags.DEFINE_integer("prompt_len", 300, "the probe's prompt length")
_OPS = flags.DEFINE_bool("ops", True, "also survey each operation compiled alone "
                         "(`arcjax.bench.op_survey`) at each model's shapes")
_INVARIANT = flags.DEFINE_bool("batch_invariant", False, "run every engine (the baseline "
                               "too) with batch_invariant=True")
_KV = flags.DEFINE_enum("kv_cache_dtype", "auto", ["auto", "fp8"], "every engine's KV pages")
_OUT = flags.DEFINE_string("out", None, "write the rows as JSON here")
_CC = flags.DEFINE_string("compilation_cache_dir", None, "JAX persistent compilation cache")


def _model_dir(name: str) -> str | None:
    if name == "default":
        return None
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from support.hf_models import ARCHS, NEW_ARCHS, tiny_model_dir

    archs = {a.replace("ForCausalLM", "").lower(): a for a in ARCHS + NEW_ARCHS}
    archs = {k.replace("moe", "_moe") if k.endswith("moe") and k != "moe" else k: v
             for k, v in archs.items()}
    if name not in archs:
        raise app.UsageError(f"--models: unknown model {name!r}; one of "
                             f"{sorted(archs) + ['default']}")
    return tiny_model_dir(archs[name])


def _located(base, run, replay, cache: dict, key) -> str:
    from arcjax.bench import step_replay

    if key not in cache:
        cache[key] = replay.probe_taps(base.runner, base.steps)
    diff = step_replay.first_difference(cache[key], replay.probe_taps(run.runner, run.steps))
    if diff is None:
        return "not reproduced by the replay"
    return f"position {diff.position}: {diff.key.describe(run.runner.cfg.num_layers)}"


def _config(model: str | None):
    from arcjax.model.model_config import ModelConfig

    folder = Path(model) if model else Path(__file__).resolve().parent.parent / "arcjax" / \
        "default_model"
    return ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))


def _survey(names: list[str], dtypes: list[str]) -> list[dict]:
    """The operation survey's table (printed) and rows."""
    from arcjax.bench import op_survey

    rows = []
    print("\n| model | dtype | operation (compiled alone) | row counts where the probe row "
          "differs from its one-row result |")
    print("|---|---|---|---|")
    for name in names:
        cfg = _config(_model_dir(name))
        for dtype in dtypes:
            found = [(op.name, op_survey.row_variance(op, dtype)) for op in op_survey.row_ops(cfg)]
            found += [(f"attention [{cfg.num_heads}x{cfg.head_dim}]: {case}",
                       "differs" if differs else "")
                      for case, differs in op_survey.attention_variance(cfg, dtype).items()]
            for op, where in found:
                text = (", ".join(map(str, where)) if isinstance(where, list) else where)
                print(f"| {name} | {dtype} | {op} | {text or 'none'} |", flush=True)
                rows.append(dict(model=name, dtype=dtype, op=op, differs=where))
    return rows


def main(_):
    from arcjax.bench import invariance, step_replay
    from arcjax.bench.report import machine
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    if _CC.value:
        enable_persistent_compilation_cache(_CC.value)
    workload = invariance.Workload(prompt_len=_PROMPT.value, new_tokens=_NEW.value)
    chosen = [v for v in invariance.variations()
              if _ONLY.value is None or v.name in _ONLY.value]
    rows, taps, replay = [], {}, step_replay.Replay()
    mode = ((("batch_invariant", True),) if _INVARIANT.value else ()) + (
        (("kv_cache_dtype", _KV.value),) if _KV.value != "auto" else ())
    print(f"machine: {machine()}; engine options of every run: {dict(mode)}", flush=True)
    print("| model | dtype | variation | tokens equal | logprobs bitwise | differing "
          "(first) | max abs diff | first difference (replay) |")
    print("|---|---|---|---|---|---|---|---|")
    for name in _MODELS.value:
        model = _model_dir(name)
        for dtype in _DTYPES.value:
            base = invariance.run_probe(model, dtype, invariance.BASELINE, workload, mode)
            for variation in chosen:
                t0 = time.perf_counter()
                run = invariance.run_probe(model, dtype, variation, workload, mode)
                cmp = invariance.compare(base, run)
                where = ""
                if _LOCATE.value and not cmp.bitwise:
                    where = _located(base, run, replay, taps, (name, dtype))
                label = variation.name + (f" ({run.verify_steps} verification steps)"
                                          if "speculation" in variation.name else "")
                first = "" if cmp.first is None else f" (token {cmp.first})"
                row = dict(model=name, dtype=dtype, variation=variation.name,
                           verify_steps=run.verify_steps, tokens_equal=cmp.tokens_equal,
                           bitwise=cmp.bitwise, differing=cmp.differing, first=cmp.first,
                           max_abs=cmp.max_abs, located=where,
                           seconds=round(time.perf_counter() - t0, 1))
                rows.append(row)
                print(f"| {name} | {dtype} | {label} | {'yes' if cmp.tokens_equal else 'NO'} | "
                      f"{'yes' if cmp.bitwise else 'NO'} | {cmp.differing}/{len(base.logprobs)}"
                      f"{first} | {cmp.max_abs:.3g} | {where} |", flush=True)
    survey = _survey(_MODELS.value, _DTYPES.value) if _OPS.value else []
    if _OUT.value:
        os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
        with open(_OUT.value, "w") as f:
            json.dump({"machine": machine(), "argv": sys.argv,
                       "mode": dict(mode),
                       "workload": dataclasses.asdict(workload), "rows": rows,
                       "survey": survey}, f, indent=1)


if __name__ == "__main__":
    app.run(main)
