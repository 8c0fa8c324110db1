"""Sampling distributions (top-k, top-p, min-p, with penalties) by chi-square on many draws of
one request in one batch (fixed seed), and batch independence with every feature on."""

import jax
import numpy as np
import pytest
from scipy import stats

from arcjax import SamplingParams
from arcjax.runtime.penalties import TokenTables, table_row
from arcjax.runtime.sampling import SamplingBatch, sample_step

V, N = 12, 4000
LOGITS = np.random.RandomState(4).randn(V).astype(np.float32) * 1.5
_step = jax.jit(sample_step)


def _expected(logits, p: SamplingParams):
    z = np.asarray(logits, np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.zeros(V, bool)
    mass = 0.0
    for rank, t in enumerate(order):
        ok = (p.top_k == 0 or rank < p.top_k) and mass < p.top_p
        ok &= probs[t] >= p.min_p * probs[order[0]]
        keep[t] = ok
        mass += probs[t]
    q = np.where(keep, probs, 0)
    return q / q.sum()


def _draws(p: SamplingParams, table_row_=None):
    rows = [(p, 123, c, 0 if table_row_ is not None else None) for c in range(N)]
    table = np.zeros((2, V), np.int32)
    if table_row_ is not None:
        table[0] = table_row_
    sp = SamplingBatch.build(rows, N, spare_slot=1)
    tokens, _, _ = _step(np.repeat(LOGITS[None], N, axis=0), sp, TokenTables.unbiased(table))
    return np.bincount(np.asarray(tokens), minlength=V)


@pytest.mark.parametrize("p", [
    SamplingParams(temperature=0.9, top_k=4),
    SamplingParams(temperature=1.2, top_p=0.7),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=0.7, top_k=6, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0),
], ids=["top_k", "top_p", "min_p", "combined", "plain"])
def test_distribution_chi_square(p):
    want = _expected(LOGITS, p)
    got = _draws(p)
    assert got[want == 0].sum() == 0  # filtered tokens are never drawn
    kept = want > 0
    chi2 = (((got - N * want) ** 2)[kept] / (N * want[kept])).sum()
    assert chi2 < stats.chi2.ppf(0.999, max(kept.sum() - 1, 1)), (got, N * want)


def test_penalized_distribution_chi_square():
    p = SamplingParams(temperature=1.0, presence_penalty=0.8, frequency_penalty=0.5,
                       repetition_penalty=1.5, top_k=8)
    prompt, output = [0, 3, 5], [5, 5, 7]
    counts = np.bincount(output, minlength=V)
    lg = LOGITS.astype(np.float64)
    seen = counts > 0
    seen[prompt] = True
    lg = np.where(seen, np.where(lg > 0, lg / 1.5, lg * 1.5), lg) - 0.5 * counts - 0.8 * (counts > 0)
    want = _expected(lg, p)
    got = _draws(p, table_row(V, prompt, output, ()))
    kept = want > 0
    assert got[~kept].sum() == 0
    chi2 = (((got - N * want) ** 2)[kept] / (N * want[kept])).sum()
    assert chi2 < stats.chi2.ppf(0.999, kept.sum() - 1)


def test_batch_independent_with_every_feature_on():
    rs = np.random.RandomState(1)
    logits = rs.randn(8, V).astype(np.float32) * 2
    full = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, min_p=0.05, seed=9,
                          presence_penalty=0.4, frequency_penalty=0.2, repetition_penalty=1.3,
                          min_tokens=3, stop_token_ids=[1], logprobs=3)
    row = table_row(V, [2, 4], [4], {1})
    others = [SamplingParams(temperature=t, top_p=0.5) for t in (0.0, 1.0, 2.0)]

    def run(batch_rows, tables, logit_rows, size):
        table = np.zeros((len(tables) + 1, V), np.int32)
        table[:len(tables)] = tables
        sp = SamplingBatch.build(batch_rows, size, spare_slot=len(tables))
        lg = np.zeros((size, V), np.float32)
        lg[:len(logit_rows)] = logit_rows
        tokens, lp, _ = jax.jit(sample_step)(lg, sp, TokenTables.unbiased(table))
        return np.asarray(tokens), np.asarray(lp.logprob)

    alone_t, alone_lp = run([(full, 9, 2, 0)], [row], logits[3:4], 8)
    rows = [(others[0], 1, 0, None), (others[1], 2, 5, None), (full, 9, 2, 1),
            (others[2], 3, 1, None)]
    mixed_t, mixed_lp = run(rows, [np.zeros(V, np.int32), row], logits[[0, 1, 3, 2]], 16)
    assert mixed_t[2] == alone_t[0] and mixed_t[2] != 1  # stop id 1 masked (2 < min_tokens)
    assert abs(mixed_lp[2] - alone_lp[0]) < 1e-6


@pytest.mark.parametrize("p", [SamplingParams(temperature=1.0, top_p=0.9),
                               SamplingParams(temperature=1.0, top_k=100, min_p=0.1),
                               SamplingParams(temperature=1.0, top_k=10, top_p=0.5)],
                         ids=["top_p_bisect", "top_k_bisect", "fast"])
def test_filter_mask_equals_the_sorted_definition(p):
    from arcjax.runtime.sampling import _filter_mask

    rs = np.random.RandomState(3)
    v = 300
    logits = (rs.randn(4, v) * 0.5).astype(np.float32)  # flat: top_p needs > 64 tokens
    sp = SamplingBatch.build([(p, 0, 0)] * 4, 4)
    got = np.asarray(jax.jit(_filter_mask)(logits, sp, np.ones(4, bool)))
    for r in range(4):
        z = logits[r].astype(np.float64)
        probs = np.exp(z - z.max())
        probs /= probs.sum()
        order = np.argsort(-probs, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        keep_sorted = ((p.top_k == 0) | (np.arange(v) < p.top_k)) & (mass_before < p.top_p)
        keep_sorted &= probs[order] >= p.min_p * probs.max()
        want = np.zeros(v, bool)
        want[order] = keep_sorted
        np.testing.assert_array_equal(got[r], want)


def test_unfiltered_rows_do_not_depend_on_filtered_neighbours():
    v = 300
    logits = (np.random.RandomState(8).randn(2, v) * 0.3).astype(np.float32)  # flat
    plain = SamplingParams(temperature=1.0, seed=5)
    rows = [(plain, 5, c) for c in range(N // 8)]
    lg = np.repeat(logits[:1], len(rows), axis=0)
    alone, _, _ = _step(lg, SamplingBatch.build(rows, len(rows)),
                        TokenTables.unbiased(np.zeros((2, v), np.int32)))
    mixed_rows = rows + [(SamplingParams(temperature=1.0, top_k=3), 1, 0)]
    lg2 = np.concatenate([lg, logits[1:]])
    mixed, _, _ = _step(lg2, SamplingBatch.build(mixed_rows, len(mixed_rows)),
                        TokenTables.unbiased(np.zeros((2, v), np.int32)))
    np.testing.assert_array_equal(np.asarray(mixed)[:len(rows)], np.asarray(alone))
    assert len(set(np.asarray(alone).tolist())) > 64  # not cut to the top 64 candidates
