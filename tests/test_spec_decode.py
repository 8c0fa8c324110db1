"""Draft verification in the jitted step (`arcjax.runtime.verification`) and the n-gram proposer.

Verification is checked against plain sampling position by position (greedy and seeded, with
penalties, min_tokens and filters), and its rejection sampler against the target distribution
with a chi-square test whose power is stated and computed in the test.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.runtime import verification
from arcjax.runtime.penalties import COUNT_SHIFT, TokenTables, apply_penalties, table_row
from arcjax.runtime.sampling import SamplingBatch, sample
from arcjax.sampling_params import SamplingParams

VOCAB = 24
WIDTH = 4  # 3 drafts per row


@functools.partial(jax.jit, static_argnames=("width",))
def _verify(logits, sp, spec, counts, width):
    return verification.verify(logits, sp, spec, TokenTables.unbiased(counts), width)


def _pack(drafts, rows, num_seqs):
    counts = [1 + len(d) for d in drafts]
    cu = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(counts, out=cu[1:len(counts) + 1])
    cu[len(counts) + 1:] = cu[len(counts)]
    return verification.pack(cu, counts, drafts, rows, num_seqs=num_seqs, width=WIDTH,
                            spare_slot=num_seqs)


@jax.jit
def _plain_sample(logits, table, sp):
    return sample(apply_penalties(logits, table, sp), sp)


def _plain_tokens(logits, rows, drafts, counts):
    """What plain decoding samples at each position of each row, given its drafts as the
    tokens before it (penalties count them, counters advance): one row per position, each
    with its own count-table row."""
    table = np.zeros((len(rows) * WIDTH + 1, VOCAB), np.int32)
    positions = []
    for s, (row, d) in enumerate(zip(rows, drafts)):
        p, seed, made, slot = row
        base = counts[slot] if slot is not None else np.zeros(VOCAB, np.int32)
        for j in range(WIDTH):
            r = s * WIDTH + j
            table[r] = base
            np.add.at(table[r], np.asarray(d[:j], np.int64), 1 << COUNT_SHIFT)
            positions.append((p, seed, made + j, r))
    sp = SamplingBatch.build(positions, len(positions), len(positions))
    tokens = np.asarray(_plain_sample(logits, jnp.asarray(table), sp))
    return tokens.reshape(len(rows), WIDTH).tolist()


@pytest.mark.parametrize("greedy", [True, False])
def test_each_position_samples_what_plain_decoding_would(greedy):
    rs = np.random.RandomState(0)
    logits = jnp.asarray(rs.randn(4 * WIDTH, VOCAB).astype(np.float32) * 2)
    temp = 0.0 if greedy else 0.9
    params = [SamplingParams(temperature=temp, seed=3),
              SamplingParams(temperature=temp, top_k=5, repetition_penalty=1.3,
                             frequency_penalty=0.5, min_tokens=2, stop_token_ids=(4,)),
              SamplingParams(temperature=temp, top_p=0.8, presence_penalty=0.7),
              SamplingParams(temperature=temp, min_p=0.1)]
    counts = np.zeros((5, VOCAB), np.int32)
    counts[1] = table_row(VOCAB, prompt=(4, 5, 6), outputs=(5,), stop_ids=(4,))
    counts[2] = table_row(VOCAB, prompt=(1,), outputs=(7, 7), stop_ids=())
    rows = [(params[0], 11, 0, None), (params[1], 12, 1, 1), (params[2], 13, 5, 2),
            (params[3], 14, 2, None)]
    plain = _plain_tokens(logits, rows, [(9, 9, 9)] * 4, counts)
    # drafts: all right, right then wrong, wrong at once, none
    drafts = [tuple(plain[0][:3]), (plain[1][0], (plain[1][1] + 1) % VOCAB, 3),
              ((plain[2][0] + 1) % VOCAB, 1, 2), ()]
    plain = _plain_tokens(logits, rows, drafts, counts)
    logits_rows, sp, spec = _pack(drafts, rows, 4)
    tokens, yielded, _, table = _verify(logits, sp, spec, jnp.asarray(counts), WIDTH)
    tokens, yielded = np.asarray(tokens).reshape(4, WIDTH), np.asarray(yielded)
    assert yielded.tolist() == [4, 2, 1, 1]
    for s in range(4):
        assert tokens[s, :yielded[s]].tolist() == plain[s][:yielded[s]]
    # the count table gained exactly the yielded tokens of the penalized rows
    grew = (np.asarray(table.counts) - counts) >> COUNT_SHIFT
    assert grew[1].sum() == 2 and grew[2].sum() == 1 and grew[[0, 3, 4]].sum() == 0
    assert grew[1, tokens[1, 0]] >= 1 and grew[2, tokens[2, 0]] == 1


def test_pack_lays_positions_out_per_sequence():
    p = SamplingParams(temperature=0)
    rows = [(p, 1, 3, None), (p, 2, 0, None)]
    logits_rows, sp, spec = _pack([(7, 8), ()], rows, 2)
    assert logits_rows.tolist() == [0, 1, 2, 0, 3, 0, 0, 0]
    assert spec.next_draft.tolist() == [7, 8, 0, 0, 0, 0, 0, 0]
    assert spec.has_draft.tolist() == [True, True] + [False] * 6
    assert sp.counter.tolist() == [3, 4, 5, 6, 0, 1, 2, 3]


def test_rejection_sampler_keeps_the_target_distribution():
    """One row, target p over 6 tokens, a draft on p's mode. The first yielded token must be
    distributed as p; acceptance as p(draft). Chi-square goodness of fit over N = 1000 seeds
    at alpha = 0.001 (5 degrees of freedom). Its power against the classic bug (resampling
    from p instead of the residual on rejection, which inflates the draft's share to
    p(d) + (1 - p(d)) p(d)) is computed below and asserted >= 0.99."""
    from scipy import stats

    n, alpha = 1000, 1e-3
    logit = np.log(np.array([0.4, 0.2, 0.15, 0.1, 0.1, 0.05], np.float32))
    p = np.exp(logit) / np.exp(logit).sum()
    vocab = len(p)
    draft = 0
    params = SamplingParams(temperature=1.0)
    rows = [(params, seed, 0, None) for seed in range(n)]
    counts = [1 + 1] * n
    cu = np.concatenate([[0], np.cumsum(counts)])
    logits_rows, sp, spec = verification.pack(cu, counts, [(draft,)] * n, rows, num_seqs=n,
                                             width=2, spare_slot=0)
    logits = jnp.asarray(np.tile(logit, (2 * n, 1)))
    tokens, yielded, _, _ = jax.jit(verification.verify, static_argnames=("width",))(
        logits, sp, spec, TokenTables.unbiased(jnp.zeros((1, vocab), jnp.int32)), width=2)
    first = np.asarray(tokens).reshape(n, 2)[:, 0]
    observed = np.bincount(first, minlength=vocab)
    critical = stats.chi2.ppf(1 - alpha, vocab - 1)
    statistic = ((observed - n * p) ** 2 / (n * p)).sum()
    assert statistic < critical, (observed, n * p)
    accepted = (np.asarray(yielded) == 2).mean()
    assert abs(accepted - p[draft]) < 4 * np.sqrt(p[draft] * (1 - p[draft]) / n)
    buggy = p * (1 - p[draft])
    buggy[draft] = p[draft] + (1 - p[draft]) * p[draft]
    power = stats.ncx2.sf(critical, vocab - 1, n * ((buggy - p) ** 2 / p).sum())
    assert power >= 0.99


# ---- the n-gram proposer ------------------------------------------------------------------------

def test_ngram_lookup_takes_the_longest_suffix_match():
    from arcjax.spec_decode.ngram_proposer import lookup

    t = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8, 2, 3, 4])
    # suffix (2, 3, 4) occurs at 1 and 6: the latest with 3 tokens after it wins
    assert lookup(t, 2, 3, 3).tolist() == [7, 8, 2]
    assert lookup(t, 2, 3, 6).tolist() == [5, 9, 2, 3, 4, 7]  # only the first has 6 after it
    assert lookup(t, 4, 5, 3).tolist() == []  # (9, 2, 3, 4) != (8, 2, 3, 4): no 4-gram match
    assert lookup(np.array([5]), 1, 3, 2).tolist() == []
    assert lookup(np.array([6, 6, 6]), 1, 2, 4).tolist() == [6]


def test_ngram_proposer_guesses_pending_tokens_first():
    from arcjax.spec_decode.ngram_proposer import NgramProposer
    from arcjax.spec_decode.speculative_config import ProposalRow

    prop = NgramProposer(1, 3)
    text = [10, 11, 12, 13, 14, 15, 10, 11]
    known, pending, none = prop.propose([ProposalRow("a", text, 0), ProposalRow("b", text, 1),
                                         ProposalRow("c", [1, 2], 0)], 3)
    assert known == (12, 13, 14) and pending == (13, 14, 15) and none == ()
