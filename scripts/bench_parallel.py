"""Step time of tensor parallelism against one device, same model, same greedy tokens.

  1. Build one `LLM` per `--sizes` entry (tensor_parallel_size) over the same model.
  2. `--repeats` rounds, interleaved across sizes: greedy-generate `--max_tokens` tokens for
     four prompts (40, 9, 25, 17 tokens; chunked under a 32-token budget); every size must
     return the tokens of the first.
  3. Report the median duration of the decode-only and mixed steps that did not compile.

On CPU, devices are forced host devices sharing the same cores: the figure is the overhead
of partitioning and collectives, and says nothing about GPUs.

  XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu \
      python scripts/bench_parallel.py --sizes=1,2,4
"""

from __future__ import annotations

import json
import statistics

import numpy as np
from absl import app, flags

import arcjax
from arcjax import SamplingParams

_MODEL = flags.DEFINE_string("model", None, "model directory (default: the tiny GQA Llama "
                             "of tests/support/hf_models.py)")
_SIZES = flags.DEFINE_list("sizes", ["1", "2", "4"], "tensor_parallel_size values")
_REPEATS = flags.DEFINE_integer("repeats", 4, "interleaved rounds")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 24, "tokens generated per prompt and round")
_OUT = flags.DEFINE_string("out", None, "write the JSON result here")

GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=4,
                attention_impl="xla", chunk_tile=16, max_num_batched_tokens=32,
                dtype="float32")


def main(_):
    model = _MODEL.value
    if model is None:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
        from support.hf_models import tiny_model_dir

        model = tiny_model_dir("LlamaForCausalLM")
    sizes = [int(s) for s in _SIZES.value]
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 380, size=n).tolist() for n in (40, 9, 25, 17)]
    llms = {tp: arcjax.LLM(model, tensor_parallel_size=tp, **GEOMETRY) for tp in sizes}
    times = {tp: {"decode": [], "mixed": []} for tp in sizes}
    reference = None
    for _ in range(_REPEATS.value):
        for tp in sizes:
            engine = llms[tp].engine
            before = engine.num_steps
            outs = llms[tp].generate(prompts, SamplingParams(max_tokens=_MAX_TOKENS.value,
                                                             temperature=0.0), use_tqdm=False)
            tokens = [list(o.token_ids) for o in outs]
            reference = reference or tokens
            if tokens != reference:
                raise SystemExit(f"tensor_parallel_size={tp}: tokens differ from {sizes[0]}")
            for r in list(engine.trace)[-(engine.num_steps - before):]:
                if not r.compiled:
                    kind = "decode" if r.bucket[2] == 1 else "mixed"
                    times[tp][kind].append(r.end - r.start)
    result = {str(tp): {f"{k}_ms": round(1e3 * statistics.median(v), 2) for k, v in t.items()}
              | {"decode_steps": len(t["decode"]), "mixed_steps": len(t["mixed"])}
              for tp, t in times.items()}
    print(json.dumps(result, indent=1))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    app.run(main)
