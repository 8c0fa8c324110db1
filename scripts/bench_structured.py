"""Structured outputs: host time to fill grammar bitmasks, and engine throughput.

`--masks`: host time per step to fill the bitmasks of 1, 16 and 64 constrained rows
(`--rows`), at vocabularies of 4k (the packaged model's tokenizer) and ~150k (`--vocabs`;
a synthetic byte-level vocabulary made of the 4k model's tokens joined in pairs and
triples: real subword pieces, a large token trie). Each row walks a JSON schema with
random allowed tokens (a finished row starts over); the time is the median, mean and p90
per step of `MaskFiller.fill` over `--mask_steps` steps (bimodal: a row inside a string
allows most of the vocabulary and costs far more than one between keys), plus the time of
accepting the step's tokens.

`--throughput`: `--num_requests` JSON-schema requests (`SCHEMA`, default whitespace) vs
as many unconstrained ones on the packaged model: same prompts, greedy, and each
unconstrained request runs exactly as many tokens as its JSON twin produced (EOS ignored),
so both arms do the same work; `--repeats` alternating runs per `--async_scheduling` arm:
tokens/s, the median ratio of adjacent (json, plain) pairs by wall time and by the
process's CPU time (steadier on a shared machine), the host time spent filling masks per
step and the device's idle time between steps (how much of the mask time the device step
hides).

  python scripts/bench_structured.py --masks --out=runs/structured_masks.json
  python scripts/bench_structured.py --throughput --num_requests=64
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import numpy as np
from absl import app, flags

_MASKS = flags.DEFINE_bool("masks", False, "time bitmask filling on the host")
_THROUGHPUT = flags.DEFINE_bool("throughput", False, "JSON-schema vs unconstrained requests")
_ROWS = flags.DEFINE_list("rows", ["1", "16", "64"], "--masks: constrained rows per step")
_VOCABS = flags.DEFINE_list("vocabs", ["4096", "150000"], "--masks: vocabulary sizes")
_MASK_STEPS = flags.DEFINE_integer("mask_steps", 60, "--masks: steps timed per point")
_THREADS = flags.DEFINE_integer("threads", None, "llguidance threads (None: its default)")
_N = flags.DEFINE_integer("num_requests", 64, "--throughput: requests per arm")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 320, "--throughput: output budget (the "
                                  "schema needs at most ~270 tokens of the packaged model)")
_PROMPT = flags.DEFINE_integer("prompt_len", 64, "--throughput: prompt tokens")
_REPEATS = flags.DEFINE_integer("repeats", 2, "--throughput: runs per arm (alternating)")
_BUDGET = flags.DEFINE_integer("max_num_batched_tokens", 512, "--throughput: token budget")
_ASYNC = flags.DEFINE_list("async_scheduling", ["true", "false"],
                           "--throughput: overlapped scheduling arms")
_OUT = flags.DEFINE_string("out", None, "write the results as JSON here")
_CC = flags.DEFINE_string("compilation_cache_dir", None, "JAX persistent compilation cache")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"enum": ["Paris", "Oslo", "Lima", "Kyoto"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "minItems": 2,
             "maxItems": 4},
    "note": {"type": "string", "minLength": 20, "maxLength": 80},
    "active": {"type": "boolean"}},
    "required": ["name", "age", "city", "tags", "note", "active"],
    "additionalProperties": False}


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskConfig:
    rows: tuple[int, ...]
    vocabs: tuple[int, ...]
    steps: int
    threads: int | None


def _base_tokens() -> tuple[list[bytes], int]:
    """The packaged model's tokens as bytes (byte-level BPE decoded), and its EOS id."""
    import tokenizers

    from arcjax.engine.build import default_model_path
    from arcjax.engine.tokenizer import Tokenizer

    path = default_model_path()
    tok = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = Tokenizer.from_dir(path).eos_token_ids[0]
    specials = set(tok.get_added_tokens_decoder())
    tokens = [b"" if i in specials else tok.decode([i]).encode("utf-8", "surrogatepass")
              for i in range(tok.get_vocab_size())]
    return tokens, eos


def synthetic_tokenizer(vocab: int):
    """An llguidance tokenizer of `vocab` tokens: 256 single bytes, the packaged model's
    tokens, then unique pairs and triples of them (seeded)."""
    import llguidance

    base, _ = _base_tokens()
    words = [t for t in base if t]
    tokens = [bytes([b]) for b in range(256)]
    seen = set(tokens)
    tokens += [t for t in words if not (t in seen or seen.add(t))]
    rng = np.random.default_rng(0)
    while len(tokens) < vocab - 1:
        k = 2 if rng.random() < 0.7 else 3
        t = b"".join(words[i] for i in rng.integers(0, len(words), k))
        if t not in seen and len(t) <= 24:
            seen.add(t)
            tokens.append(t)
    tokens = tokens[:vocab - 1] + [b"<|eos|>"]

    class Vocab:
        eos_token_id = vocab - 1
        bos_token_id = None
        special_token_ids = [vocab - 1]

        def __init__(self):
            self.tokens = tokens

        def __call__(self, s: bytes):
            return list(s)  # one token per byte: valid, if not the shortest

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Vocab()))


def _tokenizer_for(vocab: int):
    import llguidance

    if vocab == 4096:
        from arcjax.engine.build import default_model_path

        path = default_model_path()
        text = (path / "tokenizer.json").read_text()
        _, eos = _base_tokens()
        return llguidance.LLTokenizer(text, n_vocab=vocab, eos_token=[eos])
    return synthetic_tokenizer(vocab)


def time_masks(cfg: MaskConfig) -> list[dict]:
    """Median host time per step to fill, and to accept, `rows` constrained rows."""
    import llguidance

    from arcjax.sampling_params import StructuredOutputsParams
    from arcjax.structured.grammar import MaskFiller, RequestGrammar, grammar_text

    results = []
    grammar = grammar_text(StructuredOutputsParams(json=SCHEMA))
    for vocab in cfg.vocabs:
        t0 = time.perf_counter()
        tokenizer = _tokenizer_for(vocab)
        tokenizer_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        compile_s = time.perf_counter() - t0
        filler = MaskFiller(tokenizer.vocab_size, cfg.threads)
        eos = set(tokenizer.eos_tokens)
        for rows in cfg.rows:
            rng = np.random.default_rng(rows)
            grammars = [RequestGrammar(template.deep_copy(), "json") for _ in range(rows)]
            fill_s, accept_s, allowed = [], [], []
            for _ in range(cfg.steps):
                t0 = time.perf_counter()
                mask = filler.fill(list(enumerate(grammars)), rows)
                fill_s.append(time.perf_counter() - t0)
                bits = np.unpackbits(mask.view(np.uint8), axis=1,
                                     bitorder="little")[:, :tokenizer.vocab_size]
                picks = []
                for r, g in enumerate(grammars):
                    ids = np.nonzero(bits[r])[0]
                    allowed.append(len(ids))
                    t = int(rng.choice(ids))
                    if t in eos or g.is_stopped:  # done: start over
                        g.matcher.reset()
                        g.num_tokens = 0
                        t = None
                    picks.append(t)
                t0 = time.perf_counter()
                for g, t in zip(grammars, picks):
                    if t is not None and not g.accept(t):
                        raise RuntimeError(f"grammar rejected its own token: {g.error}")
                accept_s.append(time.perf_counter() - t0)
            results.append({
                "vocab": vocab, "rows": rows, "fill_ms_median": 1e3 * statistics.median(fill_s),
                "fill_ms_mean": 1e3 * statistics.fmean(fill_s),
                "fill_ms_p90": 1e3 * float(np.percentile(fill_s, 90)),
                "accept_ms_median": 1e3 * statistics.median(accept_s),
                "fill_us_per_row": 1e6 * statistics.median(fill_s) / rows,
                "allowed_tokens_median": float(np.median(allowed)),
                "tokenizer_build_s": tokenizer_s, "grammar_compile_ms": 1e3 * compile_s})
            print(json.dumps(results[-1]), flush=True)
    return results


def _arm(value: str) -> bool:
    v = value.strip().lower()
    if v not in ("true", "false"):
        raise app.UsageError(f"--async_scheduling: expected true or false, got {value!r}")
    return v == "true"


class _TimedFiller:
    """Wraps an engine's `MaskFiller`: host seconds spent filling masks, and calls."""

    def __init__(self, filler):
        self.filler, self.seconds, self.calls = filler, 0.0, 0

    def fill(self, rows, size):
        t0 = time.perf_counter()
        try:
            return self.filler.fill(rows, size)
        finally:
            self.seconds += time.perf_counter() - t0
            self.calls += 1


def _run(llm, prompts, params) -> dict:
    from arcjax.engine.trace import device_idle_gaps

    timed = llm.engine.structured.filler
    timed.seconds, timed.calls = 0.0, 0
    first = llm.engine.num_steps
    t0, c0 = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    steps = [r for r in llm.engine.trace if r.index >= first]
    gaps = device_idle_gaps(steps)
    tokens = sum(len(o.token_ids) for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "tok_per_cpu_s": tokens / cpu,
            "steps": len(steps), "idle_gap_mean_ms": 1e3 * sum(gaps) / max(1, len(gaps)),
            "mask_ms_per_step": 1e3 * timed.seconds / max(1, len(steps)),
            "mask_calls": timed.calls, "lengths": [len(o.token_ids) for o in outs],
            "texts": [o.text for o in outs]}


def run_throughput() -> dict:
    """JSON-schema vs unconstrained requests per overlapped-scheduling arm (module doc)."""
    import jsonschema

    import arcjax
    from arcjax.runtime.runner import enable_persistent_compilation_cache

    if _CC.value:
        enable_persistent_compilation_cache(_CC.value)
    rs = np.random.RandomState(0)
    vocab = 4096
    prompts = [rs.randint(3, vocab, _PROMPT.value).tolist() for _ in range(_N.value)]
    schema = arcjax.StructuredOutputsParams(json=SCHEMA)  # default (bounded) whitespace
    out = {"num_requests": _N.value, "max_tokens": _MAX_TOKENS.value,
           "prompt_len": _PROMPT.value, "arms": {}}
    for on in map(_arm, _ASYNC.value):
        llm = arcjax.LLM(None, max_model_len=_PROMPT.value + _MAX_TOKENS.value + 8,
                         max_num_seqs=_N.value, max_num_batched_tokens=_BUDGET.value,
                         async_scheduling=on)
        llm.engine.runner.watch_completion = True
        llm.engine.structured.filler = _TimedFiller(llm.engine.structured.filler)
        warm = llm.warmup()
        constrained = arcjax.SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0,
                                            structured_outputs=schema)
        # first use (split executables, grammar compile); greedy: every run has these lengths
        lengths = _run(llm, prompts, constrained)["lengths"]
        plain = [arcjax.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                 for n in lengths]  # the same work, unconstrained
        runs = {"json": [], "plain": []}
        for i in range(_REPEATS.value):  # each pair in both orders, alternately
            order = ("json", "plain") if i % 2 == 0 else ("plain", "json")
            for kind in order:
                runs[kind].append(_run(llm, prompts, constrained if kind == "json" else plain))
            if runs["json"][-1]["lengths"] != lengths:
                raise RuntimeError("greedy JSON outputs changed between runs")
        valid = 0
        for text in runs["json"][-1]["texts"]:
            try:
                jsonschema.validate(json.loads(text), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        med = {k: sorted(v, key=lambda r: r["tok_s"])[len(v) // 2] for k, v in runs.items()}
        pairs = list(zip(runs["json"], runs["plain"]))  # adjacent in time: drift cancels
        arm = {"warmup_s": warm, "valid_json": valid,
               "json_tok_s": [r["tok_s"] for r in runs["json"]],
               "plain_tok_s": [r["tok_s"] for r in runs["plain"]],
               "ratio_median": statistics.median(j["tok_s"] / p["tok_s"] for j, p in pairs),
               "cpu_ratio_median": statistics.median(j["tok_per_cpu_s"] / p["tok_per_cpu_s"]
                                                     for j, p in pairs)}
        for k in ("json", "plain"):
            arm[k] = {f: med[k][f] for f in ("steps", "idle_gap_mean_ms", "mask_ms_per_step",
                                             "output_tokens")}
        name = f"async_scheduling={str(on).lower()}"
        out["arms"][name] = arm
        print(f"{name}: json {statistics.median(arm['json_tok_s']):.0f} tok/s vs plain "
              f"{statistics.median(arm['plain_tok_s']):.0f} tok/s, median pair ratio "
              f"{arm['ratio_median']:.2f}x (per CPU-second {arm['cpu_ratio_median']:.2f}x); "
              f"masks {arm['json']['mask_ms_per_step']:.2f} ms/step"
              f", device idle {arm['json']['idle_gap_mean_ms']:.2f} vs "
              f"{arm['plain']['idle_gap_mean_ms']:.2f} ms/step; valid {valid}/{_N.value}",
              flush=True)
    return out


def main(argv):
    del argv
    if not (_MASKS.value or _THROUGHPUT.value):
        raise app.UsageError("give --masks and/or --throughput")
    out = {}
    if _MASKS.value:
        out["masks"] = time_masks(MaskConfig(rows=tuple(map(int, _ROWS.value)),
                                             vocabs=tuple(map(int, _VOCABS.value)),
                                             steps=_MASK_STEPS.value, threads=_THREADS.value))
    if _THROUGHPUT.value:
        out["throughput"] = run_throughput()
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main)
