"""Presence / frequency / repetition penalties and min_tokens against a numpy reference of
vLLM's documented semantics: on the device function directly, and end to end (greedy, so
every token is the reference's argmax) in a chunked and a preempted schedule."""

import jax
import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from arcjax.runtime.penalties import TokenCounts, TokenTables, apply_penalties, table_row
from arcjax.runtime.sampling import SamplingBatch, sample_step
from support.hf_models import hf_logits, tiny_model_dir

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto")
EOS = 2


def reference_logits(logits, prompt, output, p: SamplingParams, stop_ids=()):
    """vLLM: repetition over prompt + output tokens (positive logits divided, others
    multiplied), then frequency * count and presence * (count > 0) over output tokens;
    stop ids masked while fewer than min_tokens were generated."""
    lg = np.array(logits, np.float64)
    counts = np.bincount(np.asarray(output, int), minlength=len(lg))
    seen = counts > 0
    seen[list(prompt)] = True
    rep = np.where(lg > 0, lg / p.repetition_penalty, lg * p.repetition_penalty)
    lg = np.where(seen, rep, lg)
    lg -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    if len(output) < p.min_tokens:
        lg[list(stop_ids)] = -np.inf
    return lg


def test_device_penalties_equal_the_reference():
    rs = np.random.RandomState(0)
    V, S = 50, 6
    logits = rs.randn(S, V).astype(np.float32) * 3
    params = [SamplingParams(temperature=0, presence_penalty=0.7, frequency_penalty=0.3),
              SamplingParams(temperature=0, repetition_penalty=1.8),
              SamplingParams(temperature=0, repetition_penalty=0.6, frequency_penalty=-0.5),
              SamplingParams(temperature=0, min_tokens=5, stop_token_ids=[7, 9]),
              SamplingParams(temperature=0, presence_penalty=-1.0, min_tokens=1,
                             stop_token_ids=[3]),
              SamplingParams(temperature=0)]
    table = np.zeros((S + 1, V), np.int32)
    rows, hist = [], []
    for i, p in enumerate(params):
        prompt, out = rs.randint(0, V, 6).tolist(), rs.randint(0, V, 4 if i != 4 else 0).tolist()
        stop = set(p.stop_token_ids) | ({EOS} if p.min_tokens else set())
        table[i] = table_row(V, prompt, out, stop)
        rows.append((p, 0, len(out), i if p.uses_penalty_state else None))
        hist.append((prompt, out, stop))
    sp = SamplingBatch.build(rows, S, spare_slot=S)
    got = np.asarray(jax.jit(apply_penalties)(logits, table, sp))
    for i, (p, (prompt, out, stop)) in enumerate(zip(params, hist)):
        np.testing.assert_allclose(got[i], reference_logits(logits[i], prompt, out, p, stop),
                                   rtol=1e-6, atol=1e-6)
    tokens, _, new = jax.jit(sample_step)(logits, sp, TokenTables.unbiased(table))
    tokens, new = np.asarray(tokens), np.asarray(new.counts)
    for i, (p, (prompt, out, stop)) in enumerate(zip(params, hist)):
        assert tokens[i] == np.argmax(reference_logits(logits[i], prompt, out, p, stop))
        if p.uses_penalty_state:  # the sampled token was counted into the row's slot
            want = table_row(V, prompt, out + [int(tokens[i])], stop)
            np.testing.assert_array_equal(new[i], want)
    np.testing.assert_array_equal(new[S], table[S])  # the spare row is never written


def test_slots_are_reused_and_rebuilt_after_eviction():
    counts = TokenCounts(2, 10)
    a = counts.slot("a", {"a"}, [1, 2], [3], ())
    b = counts.slot("b", {"b"}, [4], [], ())
    assert {a, b} == {0, 1} and counts.slot("a", set(), [], [], ()) == a
    c = counts.slot("c", {"c", "b"}, [5], [5], ())  # takes a's slot (a is not running)
    assert c == a and counts.writes == 3
    assert counts.slot("a", {"a", "c"}, [1, 2], [3], ()) == b  # a rebuilt in b's slot
    np.testing.assert_array_equal(np.asarray(counts.table.counts)[b], table_row(10, [1, 2], [3], ()))
    counts.release("c")
    assert counts.slot("d", {"d"}, [], [], ()) == c


def _reference_generate(path, prompt, p: SamplingParams):
    out = []
    stop = set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS})
    for _ in range(p.max_tokens):
        lg = reference_logits(hf_logits(path, prompt + out)[-1], prompt, out, p, stop)
        out.append(int(np.argmax(lg)))
        if len(out) > p.min_tokens and out[-1] in stop:
            break
    return out


@pytest.mark.parametrize("schedule", [
    dict(chunk_tile=16, max_num_batched_tokens=32, policy="token_budget"),
    dict(num_kv_blocks=12, chunk_tile=16, max_num_batched_tokens=128),
])
def test_engine_penalties_and_min_tokens_equal_the_reference(schedule):
    path = tiny_model_dir(ARCH)
    rs = np.random.RandomState(9)
    prompts = [rs.randint(3, 384, n).tolist() for n in (12, 40, 5, 33)]
    plain = LLM(path, **GEOMETRY).generate(prompts, SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    params = [
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=1.5,
                       frequency_penalty=0.8),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, repetition_penalty=2.0),
        # the tokens greedy would emit first are stop ids: min_tokens holds them back
        SamplingParams(max_tokens=10, temperature=0, min_tokens=4,
                       stop_token_ids=list(plain[2].token_ids[:3])),
        SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, presence_penalty=-0.5,
                       repetition_penalty=1.2, frequency_penalty=0.4),
    ]
    llm = LLM(path, **{**GEOMETRY, **schedule})
    outs = llm.generate(prompts, params, use_tqdm=False)
    if "num_kv_blocks" in schedule:
        assert sum(len(r.engaged["preempted"]) for r in llm.engine.trace) > 0
    for prompt, p, out in zip(prompts, params, outs):
        assert list(out.token_ids) == _reference_generate(path, prompt, p)
    stop2 = set(params[2].stop_token_ids) | {EOS}
    assert len(outs[2].token_ids) > 4 and not stop2 & set(outs[2].token_ids[:4])
    assert list(outs[0].token_ids) != list(plain[0].token_ids)
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.runner.counts._slot_of


def test_device_biases_equal_the_reference():
    """logit_bias, allowed_token_ids and banned ids (the bias table) on the device: added to
    the logits before the penalties, greedy rows included; raw logprobs come before it."""
    from arcjax.errors import SamplingParamsError
    from arcjax.runtime.penalties import bias_row

    rs = np.random.RandomState(1)
    V, S = 40, 4
    logits = rs.randn(S, V).astype(np.float32) * 3
    params = [SamplingParams(temperature=0, logit_bias={int(np.argmax(logits[0])): -100}),
              SamplingParams(temperature=0, logit_bias={7: 100}, repetition_penalty=1.5),
              SamplingParams(temperature=0, allowed_token_ids=[3, 5, 9], logprobs=0),
              SamplingParams(temperature=0)]
    counts = np.zeros((S + 1, V), np.int32)
    bias = np.zeros((S + 1, V), np.float32)
    rows = []
    for i, p in enumerate(params):
        counts[i] = table_row(V, [7], [], ())
        bias[i] = bias_row(V, p.logit_bias, p.allowed_token_ids, [11] if i == 2 else ())
        rows.append((p, 0, 0, i if (p.uses_token_bias or p.uses_penalty_state) else None))
    sp = SamplingBatch.build(rows, S, spare_slot=S)
    tokens, lp, _ = jax.jit(sample_step)(logits, sp, TokenTables(counts, bias))
    tokens = np.asarray(tokens)
    assert tokens[0] != np.argmax(logits[0])  # -100 bans the greedy token
    assert tokens[1] == 7  # +100 wins even after the repetition penalty on 7 (a prompt id)
    assert tokens[2] in (3, 5, 9)
    assert tokens[3] == np.argmax(logits[3])  # an unbiased row is untouched
    raw = logits[2] - np.log(np.exp(logits[2]).sum())
    np.testing.assert_allclose(float(lp.logprob[2]), raw[tokens[2]], rtol=1e-5)
    for bad, field in ((dict(logit_bias={1: 101}), "logit_bias"),
                       (dict(logit_bias={-1: 1}), "logit_bias"),
                       (dict(allowed_token_ids=[]), "allowed_token_ids"),
                       (dict(bad_words=[""]), "bad_words"),
                       (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens")):
        with pytest.raises(SamplingParamsError) as e:
            SamplingParams(**bad)
        assert e.value.field == field
