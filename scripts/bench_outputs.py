"""Output-building cost per step, at a short and a long generated length, per output kind.

One request is driven through the engine's own output path (`engine/output_processor.py`:
`append_token` with the packaged model's detokenizer, a logprob entry of top-k per token,
then `request_output`) without a device: per step one token is appended and the step's
output built. Measured per kind (DELTA, CUMULATIVE) at each --lengths point: the mean
microseconds spent building the step's output (appending the token is not timed), over
--steps steps taken once the request already holds that many tokens. "copy" is the build the engine did before outputs became deltas and views: the
cumulative output plus a copy of every per-token list (token ids, logprobs, token times),
O(tokens so far) per step; it is measured by the same harness for comparison.

  python scripts/bench_outputs.py --lengths=100,4000 --out=runs/outputs.json
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import sys
import time

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchConfig:
    lengths: tuple[int, ...] = (100, 4000)
    steps: int = 50  # steps per timed chunk
    repeats: int = 40  # chunks per point: the median chunk is reported (a busy machine
    # preempts some chunks; the median ignores them)
    logprobs: int = 5  # top-k entries per token (0 = none)
    out: str | None = None


_LENGTHS = flags.DEFINE_list("lengths", ["100", "4000"], "generated lengths to measure at")
_STEPS = flags.DEFINE_integer("steps", 50, "steps per timed chunk")
_REPEATS = flags.DEFINE_integer("repeats", 40, "chunks per point (the median is reported)")
_LOGPROBS = flags.DEFINE_integer("logprobs", 5, "top-k logprob entries per token")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")


def _config() -> BenchConfig:
    return BenchConfig(lengths=tuple(int(x) for x in _LENGTHS.value), steps=_STEPS.value,
                       repeats=_REPEATS.value, logprobs=_LOGPROBS.value, out=_OUT.value)


def _copying_output(req):
    """The former build: the cumulative output with every per-token list copied."""
    from arcjax.engine.output_processor import request_output

    out = request_output(req)
    tuple(req.token_ids), tuple(req.token_times)
    if req.logprobs is not None:
        list(req.logprobs)
    return out


def _measure(cfg: BenchConfig, tok, kind: str, length: int) -> float:
    """Mean µs per step building the step's output, at `length` tokens generated."""
    from arcjax.engine.input_processor import InputProcessor
    from arcjax.engine.output_processor import append_token, request_output
    from arcjax.outputs import Logprob
    from arcjax.sampling_params import RequestOutputKind, SamplingParams
    import scheduler

    output_kind = (RequestOutputKind.DELTA if kind == "delta"
                   else RequestOutputKind.CUMULATIVE)
    params = SamplingParams(max_tokens=length + cfg.steps + 1, ignore_eos=True,
                            logprobs=cfg.logprobs or None, output_kind=output_kind)
    inputs = InputProcessor(tok, tok.vocab_size, 1 << 20,
                            scheduler.SchedulerConfig(num_blocks=1 << 16), 0)
    prompt = tuple(tok.encode("def fibonacci(n):"))
    req = inputs.state("r", None, prompt, params, 0, 0.0)
    vocab = range(10, min(tok.vocab_size, 4000))
    build = _copying_output if kind == "copy" else request_output
    eos = frozenset()

    def step(i):
        token = vocab[(i * 7919) % len(vocab)]
        entry = None
        if cfg.logprobs:
            entry = (-1.0, {token: Logprob(-1.0, 1, "x"),
                            **{t: Logprob(-2.0, r + 2, "y")
                               for r, t in enumerate(vocab[i % 50:i % 50 + cfg.logprobs])}})
        append_token(req, token, float(i), eos, entry)

    for i in range(length):  # reach the length, then hand everything out once
        step(i)
    build(req)
    gc.collect()
    gc.disable()  # the collector's pauses depend on the heap, not on the build measured
    try:
        timings = _timed(cfg, req, step, build, length)
    finally:
        gc.enable()
    return statistics.median(timings)


def _timed(cfg: BenchConfig, req, step, build, length: int) -> list[float]:
    """Mean µs per build over each chunk of `cfg.steps` steps, `cfg.repeats` chunks."""
    timings = []
    for r in range(cfg.repeats):
        spent = 0.0
        for i in range(cfg.steps):
            step(length + r * cfg.steps + i)  # not timed: the same for every kind
            t0 = time.perf_counter()
            build(req)
            spent += time.perf_counter() - t0
        timings.append(spent / cfg.steps * 1e6)
    return timings


def main(argv):
    del argv
    from arcjax.bench.report import write_json

    cfg = _config()
    from arcjax.engine.build import default_model_path
    from arcjax.engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(default_model_path())
    results = {}
    for kind in ("delta", "cumulative", "copy"):
        results[kind] = {str(n): round(_measure(cfg, tok, kind, n), 2) for n in cfg.lengths}
        short, long_ = (results[kind][str(n)] for n in (cfg.lengths[0], cfg.lengths[-1]))
        print(f"{kind:>10}: " + ", ".join(f"{n} tokens {results[kind][str(n)]:.1f} us/step"
                                          for n in cfg.lengths)
              + f"  (x{long_ / short:.2f})")
    write_json(cfg.out, cfg, us_per_step=results)

if __name__ == "__main__":
    app.run(main)
