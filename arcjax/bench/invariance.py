"""Does one request's arithmetic depend on what else the server did? A probe request is run
alone (the baseline) and under variations (inside batches of random other requests, its
prompt chunked, after a prefix-cache hit, with speculation, overlapped), and its per-token
log-probabilities are compared bitwise.

1. `run_probe(model, dtype, variation)` builds an engine (the variation's options over
   `BASE_OPTIONS`), warms the prefix cache when the variation asks for a hit, submits the
   probe and the variation's other requests (each at its arrival step), steps until all
   finish, and returns the probe's tokens and logprobs and every step that computed a
   probe row (`ProbeRun`, steps kept by `step_replay.StepRecorder`).
2. `compare(base, run)` says whether the tokens are equal and how many logprobs differ in
   their bits (`Comparison`).
3. `step_replay.first_difference` on the two runs' replayed taps names the first layer and
   operation whose output differs (the script's `--locate`).

NOTE: every engine of one (model, dtype) shares the cache geometry of `BASE_OPTIONS`, so
engines of the variations share their compiled steps (`runner.SHARED_EXECUTABLES`); the
variations change only scheduling, caching, overlap and speculation.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from arcjax.entrypoints.llm import LLM
from arcjax.sampling_params import SamplingParams
from arcjax.bench.step_replay import StepRecorder

PROBE = "probe"
# The cache geometry and schedule of every engine; a variation overrides some of them.
# One chunk holds the whole probe prompt in the baseline (max_num_batched_tokens >= its
# length); chunk_tile 16 keeps the smallest chunk the report asks for (16) a tile.
BASE_OPTIONS = dict(block_size=8, num_kv_blocks=640, max_model_len=512, max_num_seqs=8,
                    attention_impl="auto", policy="token_budget", chunk_tile=16,
                    max_num_batched_tokens=512, enable_prefix_caching=False,
                    async_scheduling=False)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """The probe and the random requests around it.

    Attributes:
      prompt_len: the probe's prompt length (its tokens: a repeated random pattern, so the
        n-gram proposer finds drafts in it).
      pattern: the repeated pattern's length.
      new_tokens: tokens the probe generates (greedy).
      seed: seeds the probe's prompt.
    """

    prompt_len: int = 300
    pattern: int = 23
    new_tokens: int = 12
    seed: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variation:
    """One way the server's work around the probe differs from the baseline.

    Attributes:
      name: the report's label.
      options: engine options over BASE_OPTIONS, as (name, value) pairs.
      others: random other requests (prompt 1..200 tokens, 1..16 new tokens, arriving at
        a random step 0..5 of the run).
      others_seed: seeds them.
      prefix_hit: tokens of the probe's prompt an earlier request leaves in the prefix
        cache (0 = none; prefix caching is turned on when > 0).
    """

    name: str
    options: tuple[tuple[str, object], ...] = ()
    others: int = 0
    others_seed: int = 0
    prefix_hit: int = 0


def variations(spec_tokens: int = 3) -> tuple[Variation, ...]:
    """The report's variations: batches, chunking, prefix hits, speculation, overlap."""
    spec = ("speculative_config", {"method": "ngram", "num_speculative_tokens": spec_tokens})
    return (
        Variation(name="batch of 4 (seed 1)", others=3, others_seed=1),
        Variation(name="batch of 8 (seed 2)", others=7, others_seed=2),
        Variation(name="batch of 8 (seed 3)", others=7, others_seed=3),
        Variation(name="chunk 16", options=(("long_prefill_token_threshold", 16),)),
        Variation(name="chunk 64", options=(("long_prefill_token_threshold", 64),)),
        Variation(name="chunk 256", options=(("long_prefill_token_threshold", 256),)),
        Variation(name="prefix hit 16", prefix_hit=16),
        Variation(name="prefix hit 64", prefix_hit=64),
        Variation(name="prefix hit 256", prefix_hit=256),
        Variation(name="speculation (ngram k=3)", options=(spec,)),
        Variation(name="overlapped", options=(("async_scheduling", True),)),
        Variation(name="overlapped, batch of 8, chunk 64", others=7, others_seed=2,
                  options=(("async_scheduling", True), ("long_prefill_token_threshold", 64))),
    )


BASELINE = Variation(name="alone (baseline)")


@dataclasses.dataclass(frozen=True)
class ProbeRun:
    """The probe's greedy tokens and each one's logprob (float32 bits as the engine
    returned them), the steps that computed its rows and the runner they ran on."""

    token_ids: tuple[int, ...]
    logprobs: np.ndarray  # [N] float32
    steps: tuple
    runner: object
    verify_steps: int  # steps of the probe in a verification bucket (sample_width > 1)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """How a run's probe differs from the baseline's."""

    tokens_equal: bool
    differing: int  # logprobs whose bits differ (of the common prefix of tokens)
    first: int | None  # index of the first differing logprob; None = none differ
    max_abs: float  # the largest |difference| among them

    @property
    def bitwise(self) -> bool:
        return self.tokens_equal and self.differing == 0


def probe_prompt(workload: Workload, vocab: int) -> list[int]:
    rs = np.random.RandomState(workload.seed)
    pattern = rs.randint(3, vocab, workload.pattern).tolist()
    return (pattern * (-(-workload.prompt_len // workload.pattern)))[:workload.prompt_len]


def _others(variation: Variation, vocab: int) -> list[tuple[int, list[int], int]]:
    """(arrival step, prompt, new tokens) of each other request."""
    rs = np.random.RandomState(1000 + variation.others_seed)
    return [(int(rs.randint(0, 6)), rs.randint(3, vocab, int(rs.randint(1, 201))).tolist(),
             int(rs.randint(1, 17))) for _ in range(variation.others)]


def build(model: str | None, dtype: str, variation: Variation,
          mode: tuple[tuple[str, object], ...] = ()) -> LLM:
    """The variation's engine (over BASE_OPTIONS), with the `mode` options every engine of
    the run shares (batch_invariant, kv_cache_dtype)."""
    options = {**BASE_OPTIONS, "dtype": dtype, **dict(mode), **dict(variation.options)}
    if variation.prefix_hit:
        options["enable_prefix_caching"] = True
    return LLM(model, **options)


def run_probe(model: str | None, dtype: str, variation: Variation,
              workload: Workload, mode: tuple[tuple[str, object], ...] = ()) -> ProbeRun:
    """Runs the probe under `variation` on a fresh engine (see the module docstring), with
    the `mode` options (the baseline's engine too)."""
    llm = build(model, dtype, variation, mode)
    vocab = min(llm.config.vocab_size, 4096)
    prompt = probe_prompt(workload, vocab)
    if variation.prefix_hit:  # leaves the first prefix_hit tokens' blocks in the cache
        tail = np.random.RandomState(7).randint(3, vocab, 5).tolist()
        warm = prompt[:variation.prefix_hit] + tail
        llm.generate([warm], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    recorder = StepRecorder(llm.engine.runner, PROBE)
    params = SamplingParams(max_tokens=workload.new_tokens, temperature=0, ignore_eos=True,
                            logprobs=0)
    pending = sorted(_others(variation, vocab), key=lambda o: o[0])
    llm.add_request(prompt, params, request_id=PROBE)
    final, step = None, 0
    try:
        while llm.has_unfinished() or pending:
            while pending and pending[0][0] <= step:
                _, p, n = pending.pop(0)
                llm.add_request(p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                                request_id=f"other-{len(pending)}")
            for out in llm.step():
                if out.request_id == PROBE and out.finished:
                    final = out
            step += 1
    finally:
        recorder.close()
    if final is None:
        raise RuntimeError(f"the probe did not finish under {variation.name!r}")
    done = final.outputs[0]
    if done.finish_reason != "length" or len(done.token_ids) != workload.new_tokens:
        raise RuntimeError(f"the probe ended with {done.finish_reason!r} after "
                           f"{len(done.token_ids)} tokens under {variation.name!r}")
    logprobs = np.asarray([entry[t].logprob for entry, t in zip(done.logprobs, done.token_ids)],
                          np.float32)
    steps = tuple(recorder.steps)
    verify = sum(1 for s in steps if s.bucket.max_q_len == s.bucket.sample_width > 1)
    return ProbeRun(tuple(done.token_ids), logprobs, steps, llm.engine.runner, verify)


def compare(base: ProbeRun, run: ProbeRun) -> Comparison:
    """Bitwise comparison of the probe's logprobs (over the tokens both runs agree on up
    to the first differing token, that token included)."""
    n = min(len(base.token_ids), len(run.token_ids))
    tokens_equal = base.token_ids == run.token_ids
    a, b = base.logprobs[:n], run.logprobs[:n]
    diff = a.view(np.int32) != b.view(np.int32)
    idx = np.flatnonzero(diff)
    return Comparison(tokens_equal, int(diff.sum()), int(idx[0]) if len(idx) else None,
                      float(np.abs(a - b).max()) if len(idx) else 0.0)
