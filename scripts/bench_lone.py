"""Time per output token of one request alone: arcjax (overlapped and serial loops) and,
when the `mistralrs` package is installed, mistral.rs on the same model, side by side.

Each engine generates `--new_tokens` greedy tokens (EOS ignored) after a `--prompt_tokens`
prompt, and also 1 token; time per output token = (wall(new) - wall(1)) / (new - 1), the
median over `--repeats` runs (engines alternate). Pin the process to one core for a
one-thread comparison:

  pip install mistralrs==0.9.5    # optional, not a project dependency
  RAYON_NUM_THREADS=1 taskset -c 0 python scripts/bench_lone.py --repeats=10 --out=runs/lone.json
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np
from absl import app, flags

_MODEL = flags.DEFINE_string("model", None, "HF model dir (default: the packaged model)")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 128, "prompt length")
_NEW = flags.DEFINE_integer("new_tokens", 64, "tokens generated")
_REPEATS = flags.DEFINE_integer("repeats", 10, "runs per engine (alternating)")
_ENGINES = flags.DEFINE_list("engines", ["arcjax", "arcjax_serial", "mistralrs"],
                             "arcjax (overlapped), arcjax_serial, mistralrs (if installed)")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


def _arcjax(model_dir, prompt, overlapped: bool):
    import arcjax

    llm = arcjax.LLM(model_dir, max_model_len=len(prompt) + _NEW.value + 16, max_num_seqs=8,
                     async_scheduling=overlapped)
    llm.warmup()

    def run(n: int) -> list[int]:
        params = arcjax.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        return list(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)

    return run


def _mistralrs(model_dir, prompt):
    import mistralrs

    runner = mistralrs.Runner(which=mistralrs.Which.Plain(
        model_id=model_dir, arch=mistralrs.Architecture.Llama,
        dtype=mistralrs.ModelDType.F32), max_seqs=8)
    text = runner.detokenize_text(prompt, False)  # a prompt of the same tokens

    def run(n: int) -> list[int]:
        runner.send_completion_request(mistralrs.CompletionRequest(
            prompt=text, model="default", max_tokens=n, temperature=0.0, ignore_eos=True))
        return []

    return run


def main(argv):
    del argv
    import arcjax
    from arcjax.model.formats.hf_layout import read_config

    model_dir = _MODEL.value or str(arcjax.default_model_path())
    vocab = read_config(model_dir).vocab_size
    prompt = np.random.RandomState(0).randint(3, vocab, _PROMPT.value).tolist()
    runs = {}
    for name in _ENGINES.value:
        if name == "mistralrs":
            try:
                runs[name] = _mistralrs(model_dir, prompt)
            except ImportError:
                print("mistralrs is not installed: skipped")
        elif name in ("arcjax", "arcjax_serial"):
            runs[name] = _arcjax(model_dir, prompt, name == "arcjax")
        else:
            raise app.UsageError(f"unknown engine {name!r}")
    for run in runs.values():  # first-use costs out of the figures
        run(_NEW.value)
        run(1)
    tpot = {name: [] for name in runs}
    outputs = {}
    for _ in range(_REPEATS.value):
        for name, run in runs.items():
            t0 = time.perf_counter()
            outputs[name] = run(_NEW.value)
            full = time.perf_counter() - t0
            t0 = time.perf_counter()
            run(1)
            one = time.perf_counter() - t0
            tpot[name].append(1e3 * (full - one) / (_NEW.value - 1))
    res = {"model": model_dir, "prompt_tokens": _PROMPT.value, "new_tokens": _NEW.value,
           "tpot_ms": tpot, "median_ms": {k: statistics.median(v) for k, v in tpot.items()}}
    if "arcjax" in outputs and "arcjax_serial" in outputs:
        res["arcjax_outputs_equal"] = outputs["arcjax"] == outputs["arcjax_serial"]
    for name, median in res["median_ms"].items():
        print(f"{name:>14}: {median:6.2f} ms per output token (median of {_REPEATS.value}; "
              f"all: {', '.join(f'{x:.2f}' for x in tpot[name])})")
    if "arcjax_outputs_equal" in res:
        print(f"arcjax overlapped == serial outputs: {res['arcjax_outputs_equal']}")
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    app.run(main)
