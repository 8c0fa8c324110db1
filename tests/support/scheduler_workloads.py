"""Random scheduler workloads and the fake model the scheduler property tests drive them
with (tests/test_scheduler_properties.py, test_scheduler_overlap.py, test_scheduler_spec.py):
requests with arrival times, stops and aborts under a random `SchedulerConfig`; a token
function of (request, position); draft proposers and what verification keeps of them."""

from __future__ import annotations

import dataclasses
import random

from hypothesis import HealthCheck
from hypothesis import strategies as st

from scheduler import POLICIES, Request, SchedulerConfig, SchedulerState
from scheduler import blocks_for

HYPOTHESIS_SETTINGS = dict(suppress_health_check=[HealthCheck.too_slow,
                                                 HealthCheck.data_too_large])
# The overlap drivers' interleavings: `overlap[i % len]` picks the mode of iteration i.
OVERLAP_MODES = st.lists(st.booleans(), min_size=1, max_size=6)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    """Requests arrive at step `arrival_time`; `stop_after[i]` outputs make the engine stop
    request i; `aborts` are (step, request index, in_flight) events."""

    config: SchedulerConfig
    requests: tuple[Request, ...]
    stop_after: tuple[int | None, ...]
    aborts: tuple[tuple[int, int, bool], ...] = ()

    @property
    def last_arrival(self) -> int:
        return max(int(r.arrival_time) for r in self.requests)

    @property
    def total_work(self) -> int:
        return sum(len(r.prompt_token_ids) + r.max_tokens - 1 for r in self.requests)

    @property
    def longest(self) -> int:
        return max(len(r.prompt_token_ids) + r.max_tokens - 1 for r in self.requests)


@st.composite
def workloads(draw, *, policy=None, pressure=True, aborts=False, stops=True, priorities=True,
              max_requests=10, shared=None, windows=False, adapters=False, **fixed):
    """Random workloads. With `shared` (drawn when None) prompts start with one of a few common
    prefixes of random lengths (block-aligned or not; a prompt may be all prefix, so a later
    identical prompt is entirely cached). With `windows`, a sliding window of 1 to 20 keys.
    With `adapters`, 1 to 3 LoRA slots and each request on the base model or one of up to 5
    adapters (prompts sharing a prefix across adapters)."""
    tile = draw(st.sampled_from([1, 2, 4, 8, 16]))
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    watermark = draw(st.integers(0, 2))
    n = draw(st.integers(1, max_requests))
    use_priority = priorities and draw(st.booleans())
    if shared is None:
        shared = draw(st.booleans())
    prefixes = [()]
    if shared:
        for p in range(draw(st.integers(1, 3))):
            length = draw(st.sampled_from([block_size, 2 * block_size, 3 * block_size + 1])
                          | st.integers(1, 40))
            prefixes.append(tuple(7000 + 50 * p + j for j in range(length)))
    lora = {}
    if adapters:
        lora["max_loras"] = draw(st.integers(1, 3))
        choices = [None] + list(range(draw(st.integers(1, 5))))
    requests = []
    for i in range(n):
        prefix = draw(st.sampled_from(prefixes))
        suffix_len = draw(st.integers(0 if prefix else 1, 48 - min(len(prefix), 47)))
        requests.append(Request(
            request_id=i,
            prompt_token_ids=prefix + tuple((i * 97 + j) % 5000 for j in range(suffix_len)),
            max_tokens=draw(st.integers(1, 12)),
            arrival_time=float(draw(st.integers(0, 8))),
            priority=draw(st.integers(0, 2)) if use_priority else 0,
            adapter=draw(st.sampled_from(choices)) if adapters else None))
    requests.sort(key=lambda r: r.arrival_time)  # added in arrival order
    needs = [blocks_for(len(r.prompt_token_ids) + r.max_tokens - 1, block_size) for r in requests]
    if pressure:
        num_blocks = max(needs) + watermark + draw(st.integers(0, 6))
    else:
        num_blocks = sum(needs) + watermark + 1
    values = dict(
        policy=policy or draw(st.sampled_from(POLICIES)),
        chunk_tile=tile,
        max_num_batched_tokens=tile * draw(st.integers(1, 6)) + draw(st.integers(0, tile - 1)),
        max_num_seqs=draw(st.integers(1, 6)),
        prefill_max_seqs=draw(st.sampled_from([0, 0, 1, 2, 3])),
        prefill_floor_steps=draw(st.sampled_from([0, 0, 1, 2, 3])),
        long_prefill_token_threshold=draw(st.sampled_from([0, 0, tile, 2 * tile + 1])),
        max_num_partial_prefills=draw(st.integers(1, 3)),
        block_size=block_size, num_blocks=num_blocks, watermark_blocks=watermark,
        enable_prefix_caching=draw(st.booleans()), **lora)
    if windows:
        values["sliding_window"] = draw(st.sampled_from([1, 2, 3, 5, 8, 13, 20]))
    values.update(fixed)
    stop_after = tuple(draw(st.sampled_from([None, None, 1, 2, 5])) if stops else None
                       for _ in requests)
    events = ()
    if aborts:
        events = tuple(draw(st.lists(
            st.tuples(st.integers(0, 30), st.integers(0, n - 1), st.booleans()), max_size=3)))
    return Workload(config=SchedulerConfig(**values), requests=tuple(requests),
                    stop_after=stop_after, aborts=events)


def fake_token(rid, position):
    """A fake model: the token at `position` depends only on the request and the position."""
    return (rid * 7919 + position * 104729) % 1000


def verified(sampler, rid, start: int, drafts: tuple[int, ...]) -> tuple[int, ...]:
    """What a decode row at cursor `start` verifying `drafts` yields when `sampler` is the
    model: the drafts it agrees with, then its own token at the first disagreement (or after
    the last draft)."""
    out = []
    for j in range(len(drafts) + 1):
        out.append(sampler(rid, start + 1 + j))
        if j == len(drafts) or drafts[j] != out[-1]:
            return tuple(out)


def drafter(seed: int, sampler, max_k: int = 5):
    """A proposer for `drive`: per decode-ready row, 0 .. max_k drafts, each the model's true
    token with a per-row probability (0, 0.5, 0.9 or 1), else garbage: random acceptance."""
    rng = random.Random(seed)

    def propose(state: SchedulerState) -> dict:
        drafts = {}
        for rid, c in zip(state.decoding.ids, state.decoding.computed):
            if rng.random() < 0.2:
                continue
            p = rng.choice([0.0, 0.5, 0.9, 1.0])
            drafts[rid] = tuple(sampler(rid, c + 1 + j) if rng.random() < p else 99_000 + j
                                for j in range(rng.randint(1, max_k)))
        return drafts

    return propose
