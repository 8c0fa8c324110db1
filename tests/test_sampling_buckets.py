"""On-device sampling and the bucket ladders."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arcjax.runtime.buckets import BucketSet, pad_to_bucket, seq_ladder, token_ladder
from arcjax.runtime.sampling import SamplingBatch, sample
from arcjax.sampling_params import SamplingParams
from arcjax.errors import SamplingParamsError


def _logits(rows=6, vocab=50, seed=0):
    return jnp.asarray(np.random.RandomState(seed).randn(rows, vocab).astype(np.float32) * 3)


_jit_sample = jax.jit(sample)


def _sample(logits, params, seeds, counters):
    rows = [(p, s, c) for p, s, c in zip(params, seeds, counters)]
    return np.asarray(_jit_sample(logits, SamplingBatch.build(rows, logits.shape[0])))


def _draws(logits_row, params, n):
    """n draws of one request (counters 0..n-1), as one batch of n identical rows."""
    lg = jnp.repeat(logits_row[None], n, axis=0)
    return set(_sample(lg, [params] * n, [0] * n, range(n)).tolist())


def test_greedy_and_top_k_1_equal_argmax():
    lg = _logits()
    want = np.argmax(np.asarray(lg), -1)
    greedy = [SamplingParams(temperature=0)] * 6
    top1 = [SamplingParams(temperature=1.3, top_k=1)] * 6
    assert (_sample(lg, greedy, range(6), [0] * 6) == want).all()
    assert (_sample(lg, top1, range(6), [0] * 6) == want).all()
    tiny_p = [SamplingParams(temperature=0.8, top_p=1e-6)] * 6
    assert (_sample(lg, tiny_p, range(6), [0] * 6) == want).all()


def test_seeded_rows_do_not_depend_on_batch_composition():
    lg = _logits(rows=8, vocab=200)
    p = SamplingParams(temperature=1.0, seed=7)
    alone = _sample(lg[3:4], [p], [7], [5])[0]
    others = [SamplingParams(temperature=t) for t in (0.0, 0.5, 2.0, 1.0, 0.7, 0.0, 1.5)]
    mixed = _sample(lg, others[:3] + [p] + others[3:],
                    [1, 2, 3, 7, 4, 5, 6, 8], [0, 1, 2, 5, 3, 4, 9, 9])
    assert mixed[3] == alone
    # A different counter (a later token of the same request) draws a fresh key.
    assert len(_draws(lg[3], p, 40)) > 1


def test_top_k_and_min_p_restrict_support():
    lg = _logits(rows=1, vocab=100, seed=3)
    order = np.argsort(-np.asarray(lg[0]))
    top3 = set(order[:3].tolist())
    got = _draws(lg[0], SamplingParams(temperature=5.0, top_k=3), 200)
    assert got <= top3 and len(got) > 1
    probs = np.exp(np.asarray(lg[0]) - np.asarray(lg[0]).max())
    allowed = set(np.nonzero(probs >= 0.5 * probs.max())[0].tolist())
    got = _draws(lg[0], SamplingParams(temperature=1.0, min_p=0.5), 200)
    assert got <= allowed
    # top_p: the smallest set of best tokens whose mass reaches p.
    p = np.sort(probs / probs.sum())[::-1]
    nucleus = set(order[:int(np.searchsorted(np.cumsum(p), 0.6)) + 1].tolist())
    got = _draws(lg[0], SamplingParams(temperature=1.0, top_p=0.6), 300)
    assert got <= nucleus and len(got) > 1


@pytest.mark.parametrize("kwargs,field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"), (dict(stop=("",)), "stop"), (dict(seed=-3), "seed"),
])
def test_sampling_params_errors_name_the_field(kwargs, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**kwargs)


def test_ladders():
    assert token_ladder(128, 2048) == (128, 256, 512, 1024, 1536, 2048)
    assert token_ladder(16, 100) == (16, 32, 64, 112)
    assert seq_ladder(8) == (8,) and seq_ladder(100) == (8, 16, 32, 64, 128)
    assert pad_to_bucket(129, (128, 256)) == 256
    with pytest.raises(ValueError):
        pad_to_bucket(300, (128, 256))


def test_every_selectable_bucket_is_enumerated():
    bs = BucketSet.create(tile=16, max_tokens=200, max_seqs=40)
    every = set(bs.all())
    assert len(every) < 40
    assert [bs.select(n, n, decode_only=True).seqs for n in (1, 2, 3, 5, 9)] == [1, 2, 4, 8, 16]
    assert bs.select(3, 1, decode_only=False).seqs == 8  # small rungs are decode-only
    for n_seqs in range(1, 41):
        assert bs.select(n_seqs, n_seqs, decode_only=True) in every
        for n_tokens in range(n_seqs, 201, 7):
            assert bs.select(n_tokens, n_seqs, decode_only=False) in every
