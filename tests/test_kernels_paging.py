"""paged_layout: the vectorized index math against a plain per-sequence loop."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import KernelArgumentError
from pallas_kernels.paging import paged_layout

BLOCK_SIZE, NUM_BLOCKS, MAX_BLOCKS = 4, 64, 8


def _loop_layout(starts, lengths, tables, *, token_bucket, seq_bucket):
    """The same arrays, one token at a time."""
    positions = np.zeros(token_bucket, np.int32)
    slots = np.full(token_bucket, NUM_BLOCKS * BLOCK_SIZE, np.int32)
    cu = np.zeros(seq_bucket + 1, np.int32)
    kv_lens = np.zeros(seq_bucket, np.int32)
    block_tables = np.zeros((seq_bucket, MAX_BLOCKS), np.int32)
    last_rows = np.zeros(seq_bucket, np.int32)
    row = 0
    for s, (start, length, table) in enumerate(zip(starts, lengths, tables)):
        block_tables[s, :len(table)] = table
        for i in range(length):
            pos = start + i
            positions[row] = pos
            slots[row] = table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
            row += 1
        cu[s + 1] = row
        kv_lens[s] = start + length
        last_rows[s] = max(row - 1, 0)
    cu[len(starts) + 1:] = row
    return dict(positions=positions, slot_mapping=slots, cu_seqlens_q=cu, kv_lens=kv_lens,
                block_tables=block_tables, last_rows=last_rows)


@st.composite
def chunks(draw):
    n = draw(st.integers(0, 6))
    starts, lengths, tables = [], [], []
    for _ in range(n):
        start = draw(st.integers(0, 20))
        length = draw(st.integers(0, MAX_BLOCKS * BLOCK_SIZE - start))
        needed = -(-(start + length) // BLOCK_SIZE)
        width = draw(st.integers(needed, MAX_BLOCKS))  # tables may hold spare blocks
        tables.append(draw(st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=width,
                                    max_size=width)))
        starts.append(start)
        lengths.append(length)
    return starts, lengths, tables


@settings(max_examples=80)
@given(case=chunks(), spare_tokens=st.integers(0, 5), spare_seqs=st.integers(0, 3))
def test_matches_per_sequence_loop(case, spare_tokens, spare_seqs):
    starts, lengths, tables = case
    t, s = sum(lengths) + spare_tokens, len(starts) + spare_seqs
    got = paged_layout(starts, lengths, tables, token_bucket=t, seq_bucket=s,
                       max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    want = _loop_layout(starts, lengths, tables, token_bucket=t, seq_bucket=s)
    for name, expected in want.items():
        actual = getattr(got, name)
        assert actual.dtype == np.int32, name
        np.testing.assert_array_equal(actual, expected, err_msg=name)
    assert got.num_seqs == len(starts) and got.num_tokens == sum(lengths)


def _layout(starts=(0, 3), lengths=(2, 1), tables=((5,), (7,)), **overrides):
    kwargs = dict(token_bucket=8, seq_bucket=4, max_blocks=MAX_BLOCKS, block_size=BLOCK_SIZE,
                  num_blocks=NUM_BLOCKS) | overrides
    return paged_layout(list(starts), list(lengths), [list(t) for t in tables], **kwargs)


def test_valid_call_for_the_error_cases():
    layout = _layout()
    np.testing.assert_array_equal(layout.slot_mapping[:3], [20, 21, 31])


@pytest.mark.parametrize("kwargs, argument, message", [
    (dict(tables=((5,),)), "block_tables", "one each per sequence"),
    (dict(starts=(0,)), "block_tables", "one each per sequence"),
    (dict(seq_bucket=1), "seq_bucket", "2 sequences exceed the bucket 1"),
    (dict(token_bucket=2), "token_bucket", "3 tokens exceed the bucket 2"),
    (dict(starts=(0, 4)), "block_tables", "sequence 1: table has 1 blocks, needs 2"),
    (dict(tables=((5,), tuple(range(MAX_BLOCKS + 1)))), "block_tables", "at most 8"),
])
def test_errors_name_the_argument(kwargs, argument, message):
    with pytest.raises(KernelArgumentError, match=message) as info:
        _layout(**kwargs)
    assert info.value.argument == argument
