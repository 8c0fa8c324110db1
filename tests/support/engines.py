"""The engine tests' shared cases: one cache geometry (so engines built with it share their
compiled steps through `runner.SHARED_EXECUTABLES`), seven prompts of varied lengths and
transformers' greedy continuation of each, the schedules every exactness test runs under,
and a loop that steps an engine until nothing is left."""

from __future__ import annotations

import functools

import numpy as np

from arcjax import LLM, SamplingParams
from support.hf_models import hf_greedy, tiny_model_dir

ARCH = "LlamaForCausalLM"
PROMPT_LENS = (3, 17, 40, 9, 66, 1, 25)
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# One cache geometry for every engine here, so compiled steps are shared between them.
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto")
# Engine options of four schedules (with GEOMETRY): each policy, and one that preempts.
SCHEDULES = [
    dict(policy="token_budget", chunk_tile=16, max_num_batched_tokens=64),
    dict(policy="prefill_first", chunk_tile=16, max_num_batched_tokens=128, prefill_max_seqs=2),
    dict(policy="alternate", chunk_tile=32, max_num_batched_tokens=128,
         max_num_partial_prefills=2),
    # 12 blocks of 8: sequences are preempted (rows whose newest token is still on the device)
    dict(policy="token_budget", chunk_tile=16, max_num_batched_tokens=128, num_kv_blocks=12),
]


def engine_prompts() -> list[list[int]]:
    """Seven prompts of PROMPT_LENS tokens (a fixed seed)."""
    rs = np.random.RandomState(11)
    return [rs.randint(3, 384, n).tolist() for n in PROMPT_LENS]


@functools.lru_cache(maxsize=None)
def expected_greedy(arch: str = ARCH) -> list[list[int]]:
    """transformers' greedy continuation (MAX_TOKENS tokens) of each of `engine_prompts()`."""
    return [hf_greedy(tiny_model_dir(arch), p, MAX_TOKENS) for p in engine_prompts()]


def tiny_llm(arch: str = ARCH, **options) -> LLM:
    """A fresh `LLM` of the tiny `arch` model with GEOMETRY (overridden by `options`)."""
    return LLM(tiny_model_dir(arch), **{**GEOMETRY, **options})


def run_to_end(llm: LLM) -> dict[str, list]:
    """Steps `llm` until nothing is unfinished; every output by request id, in order
    (including outputs of steps another thread ran)."""
    outs: dict[str, list] = {}
    while llm.has_unfinished():
        for o in llm.step():
            outs.setdefault(o.request_id, []).append(o)
    for o in llm.step():  # outputs produced by steps others ran
        outs.setdefault(o.request_id, []).append(o)
    return outs
