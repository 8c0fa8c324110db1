"""Speculative decoding in the planner: draft tokens on decode rows, variable acceptance at commit.

  1. `schedule(state, config, spec_token_ids={request id: drafts})`: after every other phase of
     the step, `allocate_drafts` extends decode rows by their drafts (key order) with what is
     left of the token budget and of the free blocks above the watermark: a row at cursor c
     feeding its newest token and d drafts runs positions c .. c + d and owns blocks for
     c + 1 + d positions. Drafts never shorten a prefill chunk, never block an admission and
     never preempt anyone; a row never drafts past max_tokens.
  2. The device verifies: row r samples at its 1 + d positions and accepts a prefix of its
     drafts (`StepPlan.sample_counts`).
  3. `commit` takes, for such a row, the 1 .. 1 + d tokens it produced (the accepted drafts,
     then the target's own token at the first rejected position, or the bonus token when all
     were accepted). `accept` moves the cursor by that count, hands back the blocks past the
     accepted length (the rejected positions' KV is simply overwritten later) and caches only
     blocks whose every position holds a verified token.

Overlapped scheduling: `advance` cannot know how many tokens a row with drafts accepts, so such
a row leaves the decode table for `Unfilled.verifying` (blocks held, planned by nobody) until the
fill of its step applies what it accepted (`fill_verifying`) and puts it back in key order. Rows
without drafts advance with a placeholder as before, and the next plan may give them drafts
proposed from the tokens known at planning time.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence as SequenceOf
from itertools import chain

from scheduler.blocks import BlockPool, BlockTable, blocks_for
from scheduler.kv_groups import filled_pairs
from scheduler.scheduler_config import SchedulerConfig
from scheduler.scheduler_errors import CommitError, InputError
from scheduler.prefix import block_hash, root_digest
from scheduler.request import FINISH_LENGTH, FINISH_STOP, Finished, RequestId
from scheduler.state import DecodeRow, DecodeTable, gen_chunk, last_tokens

Drafts = Mapping[RequestId, SequenceOf[int]]


def check_drafts(drafts: Drafts) -> None:
    """Raises InputError unless every draft is a sequence of int token ids >= 0."""
    for rid, tokens in drafts.items():
        if isinstance(tokens, (str, bytes)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in tokens):
            raise InputError("spec_token_ids",
                             f"drafts of {rid!r} must be int token ids >= 0, got {tokens!r}")


def allocate_drafts(dec: DecodeTable, num_rows: int, drafts: Drafts, pool: BlockPool,
                    budget: int, config: SchedulerConfig
                    ) -> tuple[DecodeTable, BlockPool, tuple[tuple[int, ...], ...], int, int]:
    """Draft tokens for the scheduled decode rows 0 .. num_rows - 1 (each already holds the
    block of its fed token), in key order, within `budget` tokens and the free blocks above
    the watermark.

    Returns:
      (table with grown block tables, pool, drafts per row, tokens used, rows trimmed by the
       budget or the blocks).
    """
    bs, G = config.block_size, config.num_kv_groups  # G blocks per block index
    spare = pool.num_free - config.watermark_blocks
    tables = None
    spec, used, trimmed = [], 0, 0
    for row in range(num_rows):
        proposed = drafts.get(dec.ids[row])
        if not proposed:
            spec.append(())
            continue
        c = dec.computed[row]
        table = dec.tables[row] if tables is None else tables[row]
        wanted = min(len(proposed), dec.limits[row] - c - 1)  # never past max_tokens
        n = min(wanted, budget - used, (len(table) // G + max(spare, 0) // G) * bs - c - 1)
        trimmed += n < wanted
        if n <= 0:
            spec.append(())
            continue
        need = (blocks_for(c + 1 + n, bs) - len(table) // G) * G
        if need > 0:
            blocks, pool = pool.take(need)
            spare -= need
            if tables is None:
                tables = list(dec.tables)
            tables[row] = table + blocks
        spec.append(tuple(proposed[:n]))
        used += n
    if tables is not None:
        dec = dec.with_progress(tables=tuple(tables))
    return dec, pool, tuple(spec) if used else (), used, trimmed


def entries(plan, sampled: SequenceOf) -> tuple[tuple[int, ...], ...]:
    """Each sampling row's tokens as a tuple (an int entry is one token), checked: a decode row
    with d drafts yields 1 .. 1 + d tokens, any other sampling row exactly one.

    Raises:
      CommitError: a wrong count.
    """
    out = []
    rows = (r for r, s in enumerate(plan.samples) if s)
    for r, entry in zip(rows, sampled):
        tokens = (entry,) if isinstance(entry, int) else tuple(entry)
        most = 1 + len(plan.row_spec_token_ids(r))
        if not 1 <= len(tokens) <= most:
            raise CommitError("sampled_token_ids", f"row {r} ({plan.request_ids[r]!r}) yields "
                              f"1 .. {most} tokens, got {len(tokens)}")
        out.append(tokens)
    return tuple(out)


def _appended(recent: tuple[int, ...], older: tuple[tuple[int, ...], ...], computed: int,
              tokens: SequenceOf[int], chunk: int):
    """`recent`/`older` after appending `tokens` to a row whose newest token (recent[-1]) sits
    at position `computed`: a chunk ends at every position that is a multiple of `chunk`
    (scheduler/state.py), exactly as one-token decodes would have split it."""
    recent, older = list(recent), list(older)
    for position, token in enumerate(tokens, computed):
        if not position % chunk:
            older.append(tuple(recent))
            recent = []
        recent.append(token)
    return tuple(recent), tuple(older)


def accept(row: DecodeRow, tokens: SequenceOf[int], block_size: int, caching: bool,
           groups: int = 1) -> tuple[DecodeRow, BlockTable, list[tuple[int, bytes]]]:
    """A decode row after its step yielded `tokens` (the accepted drafts, then one more).

    Returns:
      (the row: cursor + len(tokens), tokens appended, table cut to its computed positions;
       the blocks cut off; (block, key) of every block that is now full of verified tokens,
       in each of the `groups` KV cache groups).
    """
    c, new = row.computed, row.computed + len(tokens)
    recent, older = _appended(row.recent, row.older, c, tokens, gen_chunk(block_size))
    keep = blocks_for(new, block_size) * groups
    table, released = row.table[:keep], row.table[keep:]
    hashes, pairs = row.hashes, []
    first, last = c // block_size, new // block_size
    if caching and last > first:
        span = last_tokens(row.seq.tokens, older, recent, new + 1 - first * block_size)
        hashes = hashes[:first]
        parent = hashes[-1] if hashes else root_digest(row.seq.request.adapter)
        for b in range(first, last):
            parent = block_hash(parent, span[(b - first) * block_size:(b - first + 1) * block_size])
            hashes += (parent,)
        pairs = filled_pairs(table, hashes, first, last, groups)
    return DecodeRow(row.seq, new, recent, older, hashes, table), released, pairs


def finished_row(row: DecodeRow, reason: str, now: float) -> Finished:
    """The record of a decode row that leaves."""
    generated = tuple(chain.from_iterable(row.older)) + row.recent
    return Finished(request_id=row.seq.request_id,
                    output_token_ids=row.seq.kept_outputs() + generated, reason=reason,
                    finish_time=now, num_cached_tokens=row.seq.cached_tokens or 0)


def _settle(rows: list[DecodeRow], released: list[BlockTable], pairs: list, pool: BlockPool,
            stopped: frozenset, now: float
            ) -> tuple[list[DecodeRow], BlockPool, list[Finished]]:
    """Caches `pairs`, then frees the cut-off blocks and the tables of rows that finished
    (max_tokens reached, or stopped by the engine). Returns the rows still running."""
    pool = pool.register(pairs)  # before any release: a finishing row's blocks stay reusable
    for blocks in released:
        pool = pool.give(blocks)
    running, finished = [], []
    for row in rows:
        rid = row.seq.request_id
        if rid in stopped or row.computed >= row.seq.limit:
            finished.append(finished_row(row, FINISH_STOP if rid in stopped else FINISH_LENGTH,
                                         now))
            pool = pool.give(row.table)
        else:
            running.append(row)
    return running, pool, finished


def commit_decodes(dec: DecodeTable, plan, tokens: SequenceOf[tuple[int, ...]],
                   stopped: frozenset, now: float, pool: BlockPool, config: SchedulerConfig,
                   prefill_pairs: list, hold: bool
                   ) -> tuple[DecodeTable, BlockPool, list[Finished], tuple[DecodeRow, ...]]:
    """The decode rows of a plan with drafts (rows matched by id: aborted ones are skipped).

    Args:
      tokens: per decode row, what it yielded (`entries`).
      prefill_pairs: blocks the step's prefill chunks filled, cached with the decode rows'.
      hold: `advance`: rows with drafts leave the table unchanged, returned as held.

    Returns:
      (decode table, pool, finished records in row order, held rows).
    """
    position = {rid: i for i, rid in enumerate(dec.ids)}
    caching = pool.cache is not None
    updated, released, pairs, held, gone = [], [], list(prefill_pairs), [], set()
    for r in range(plan.num_decode_rows):
        i = position.get(plan.request_ids[r])
        if i is None:  # aborted after schedule
            continue
        gone.add(i)
        if hold and plan.spec_token_ids[r]:
            held.append(dec.row(i))
            continue
        row, cut, filled = accept(dec.row(i), tokens[r], config.block_size, caching,
                                  config.num_kv_groups)
        updated.append(row)
        released.append(cut)
        pairs += filled
    running, pool, finished = _settle(updated, released, pairs, pool, stopped, now)
    return dec.without(gone).inserted(running), pool, finished, tuple(held)


def fill_verifying(dec: DecodeTable, rows: tuple[DecodeRow, ...],
                   tokens_of: Mapping[RequestId, tuple[int, ...]], stopped: frozenset,
                   now: float, pool: BlockPool, config: SchedulerConfig
                   ) -> tuple[DecodeTable, BlockPool, list[Finished]]:
    """Rows held by `advance` take the tokens their step yielded and rejoin the decode table
    (in key order), or finish."""
    caching = pool.cache is not None
    updated, released, pairs = [], [], []
    for row in rows:
        row, cut, filled = accept(row, tokens_of[row.seq.request_id], config.block_size,
                                  caching, config.num_kv_groups)
        updated.append(row)
        released.append(cut)
        pairs += filled
    running, pool, finished = _settle(updated, released, pairs, pool, stopped, now)
    return dec.inserted(running), pool, finished
