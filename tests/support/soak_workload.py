"""The soak tests' workload (tests/test_engine_soak.py, tests/test_engine_fault_soak.py): a
cache geometry small enough to force preemption, forty short prompts, and transformers'
greedy reference (computed once per process, shared by both modules)."""

from __future__ import annotations

import functools
import random

import pytest

from support.hf_models import hf_greedy, tiny_model_dir

ARCH = "LlamaForCausalLM"
# 12 blocks of 8 tokens for up to 16 running sequences of up to 24 tokens: preemption.
GEOMETRY = dict(block_size=8, num_kv_blocks=12, max_model_len=64, max_num_seqs=16,
                attention_impl="auto", chunk_tile=16, max_num_batched_tokens=128,
                trace_capacity=64)
NUM_PROMPTS, MAX_NEW = 40, 5


def soak_prompts() -> list[list[int]]:
    """NUM_PROMPTS prompts of 2 to 16 tokens (a fixed seed)."""
    rs = random.Random(0)
    return [[rs.randrange(3, 384) for _ in range(rs.randrange(2, 17))] for _ in range(NUM_PROMPTS)]


@functools.lru_cache(maxsize=None)
def soak_reference() -> tuple[tuple[int, ...], ...]:
    """transformers' greedy continuation of every prompt, MAX_NEW tokens, one prompt at a
    time (an engine of its own would compile a second set of steps for its cache)."""
    return tuple(tuple(hf_greedy(tiny_model_dir(ARCH), p, MAX_NEW)) for p in soak_prompts())


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """`soak_reference()` as lists (a fixture: import it into the test module)."""
    return [list(r) for r in soak_reference()]
