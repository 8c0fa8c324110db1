"""`commit`: folds one step's results into the state.

  1. Check the plan is the one in flight and the sampled tokens match its sampling rows.
  2. Decode rows (a prefix of the decode table): cursor + 1, push the sampled token; rows that
     reached max_tokens ("length") or that the engine stopped ("stop") finish and free blocks.
  3. Prefill rows: cursor + chunk length; a final chunk pushes its sampled token and the sequence
     becomes decode-ready (or finishes at once, e.g. max_tokens == 1). A pooling sequence's
     final chunk samples nothing: the sequence finishes ("stop", no output) and frees its blocks.

A plan with draft tokens (speculative decoding) commits its decode rows through scheduler/spec.py:
each row moves by the 1 .. 1 + drafts tokens it yielded and hands back the blocks past them.

With prefix caching, every block that a decode or a prefill chunk filled in this step is hashed
(parent digest + its tokens) and cached before any block is released, so a finishing sequence
leaves its blocks reusable.

NOTE: sequences aborted between `schedule` and `commit` are skipped: their rows are matched by id
when the decode table is not the plan's own. Their sampled tokens are dropped.

Overlapped scheduling (the engine plans step N+1 while step N runs on the device):

  1. plan_n = schedule(state)                      step N launched
  2. ahead = advance(plan_n.state, plan_n)         as if every sampling row of N yielded one token,
                                                   a PLACEHOLDER whose value the host does not need
  3. plan_m = schedule(ahead)                      step N+1 launched; its decode rows that feed a
                                                   placeholder take step N's token on the device
  4. state, fin = commit(plan_m.state, plan_n, sampled_n, now, stopped_n)   fills the placeholders
  5. ahead = advance(state, plan_m) ... and so on: at most one advanced, unfilled step at a time.

`advance` is `commit` with placeholder tokens and no stops: cursors move, blocks filled by N are
cached (their tokens were all fed by N, hence known), and rows reaching max_tokens finish and free
their blocks (the device runs N before N+1, so a block reused by N+1 is written after N read it).
Their records wait in `state.unfilled` until step 4 fills their last token. Step 4 also finishes
what the engine stopped at step N (EOS, stop strings): those requests leave like an abort, so a
step-N+1 row of theirs is skipped by its commit (token dropped, blocks already freed, output
unaffected). Outputs are therefore the serial ones; only the wasted N+1 rows of stopped requests
differ (tests/test_scheduler_overlap.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence as SequenceOf
from itertools import compress, repeat
from operator import add, le

from scheduler import spec
from scheduler.blocks import BlockPool
from scheduler.kv_groups import filled_pairs
from scheduler.scheduler_errors import CommitError, StepOrderError
from scheduler.step_plan import StepPlan
from scheduler.prefix import block_hash, chain_hashes, root_digest
from scheduler.request import FINISH_LENGTH, FINISH_STOP, Finished, RequestId, Sequence
from scheduler.state import PLACEHOLDER, DecodeRow, DecodeTable, Partial, SchedulerState
from scheduler.state import Unfilled, abort, gen_chunk


def _check(state: SchedulerState, plan: StepPlan, sampled: tuple[int, ...],
           stopped: frozenset) -> None:
    if not state.in_flight or state.step != plan.state.step:
        raise StepOrderError(
            f"plan of step {plan.state.step} does not belong to this state (step {state.step}, "
            f"in flight: {state.in_flight})")
    if len(sampled) != plan.num_sampled:
        raise CommitError("sampled_token_ids",
                          f"expected {plan.num_sampled} tokens (one per sampling row), "
                          f"got {len(sampled)}")
    if stopped:
        sampling = {rid for rid, s in zip(plan.request_ids, plan.samples) if s}
        strangers = stopped - sampling
        if strangers:
            raise CommitError("finished_ids",
                              f"{sorted(map(str, strangers))} sampled nothing this step")


def _advance_decodes(dec: DecodeTable, plan: StepPlan, sampled: tuple[int, ...],
                     chunk: int) -> tuple[DecodeTable, SequenceOf[int], list[int]]:
    """Cursor + 1 and the sampled token for each decode row. A row whose fed token ends a
    chunk (position % chunk == 0) moves its `recent` tokens to `older` and starts a new one.

    Returns the table, the rows that decoded, and those of them that reached max_tokens.
    """
    k = plan.num_decode_rows
    older = dec.older
    if dec.ids is plan.state.decoding.ids:  # fast path: rows 0..k-1 are the plan's decode
        # rows (same rows in the same order; an overlapped fill only replaced `recent`)
        advanced = tuple(map(add, dec.computed[:k], repeat(1, k)))
        at_limit = list(compress(range(k), map(le, dec.limits, advanced)))
        computed = advanced + dec.computed[k:]
        appended = list(map(add, dec.recent[:k], zip(sampled[:k])))  # zip: 1-tuples
        if plan._decode_flush:
            older = list(older)
            for i in plan._decode_flush:
                older[i] += (dec.recent[i],)
                appended[i] = (sampled[i],)
            older = tuple(older)
        return (dec.with_progress(computed=computed, recent=tuple(appended) + dec.recent[k:],
                                  older=older), range(k), at_limit)
    position = {rid: i for i, rid in enumerate(dec.ids)}
    computed_list, recent, rows = list(dec.computed), list(dec.recent), []
    older_list = list(older)
    for rid, token in zip(plan.request_ids[:k], sampled[:k]):
        i = position.get(rid)
        if i is not None:
            if computed_list[i] % chunk:
                recent[i] += (token,)
            else:
                older_list[i] += (recent[i],)
                recent[i] = (token,)
            computed_list[i] += 1
            rows.append(i)
    at_limit = [i for i in rows if computed_list[i] >= dec.limits[i]]
    return (dec.with_progress(computed=tuple(computed_list), recent=tuple(recent),
                              older=tuple(older_list)), rows, at_limit)


def _decoded_blocks(dec: DecodeTable, rows: SequenceOf[int], block_size: int,
                    groups: int) -> tuple[DecodeTable, list[tuple[int, bytes]]]:
    """Hashes the blocks that the decode rows `rows` just filled: the table with their digests
    appended to the rows' chains, and the (block, key) pairs to cache (one per KV cache
    group)."""
    computed = dec.computed
    full = [i for i in rows if not computed[i] % block_size]
    if not full:
        return dec, []
    hashes, pairs = list(dec.hashes), []
    for i in full:
        b = computed[i] // block_size - 1  # the block holding positions computed - bs .. - 1
        chain = hashes[i] if len(hashes[i]) == b else hashes[i][:b]
        digest = block_hash(chain[-1] if chain else root_digest(dec.seqs[i].request.adapter),
                            dec.last_tokens(i, block_size + 1)[:-1])
        hashes[i] = chain + (digest,)
        pairs += filled_pairs(dec.tables[i], hashes[i], b, b + 1, groups)
    return dec.with_progress(hashes=tuple(hashes)), pairs


def _prefilled_blocks(state: SchedulerState, plan: StepPlan) -> list[tuple[int, bytes]]:
    """(block, key) of every block a prefill chunk filled (digests precomputed per sequence),
    in every KV cache group."""
    if plan.num_decode_rows == len(plan.request_ids):
        return []
    bs, groups = state.config.block_size, state.config.num_kv_groups
    partial = {p.seq.request_id: p for p in state.partial}
    pairs = []
    for r in range(plan.num_decode_rows, len(plan.request_ids)):
        part = partial.get(plan.request_ids[r])
        if part is not None and not part.seq.request.pooling:  # None: aborted after schedule
            pairs += filled_pairs(part.table, part.seq.block_hashes, part.computed // bs,
                                  (part.computed + plan.lengths[r]) // bs, groups)
    return pairs


def commit(state: SchedulerState, plan: StepPlan, sampled_token_ids: SequenceOf, now: float,
           finished_ids: Iterable[RequestId] = ()) -> tuple[SchedulerState, tuple[Finished, ...]]:
    """Applies a step's results. Pure: returns a new state.

    Args:
      state: `plan.state`, possibly after `add_request` / `abort` calls.
      plan: the plan the engine ran.
      sampled_token_ids: one entry per sampling row, in row order: the token it sampled. A
        decode row that verified d draft tokens (`plan.spec_token_ids`) yields 1 .. 1 + d
        tokens: its entry is their sequence (the accepted drafts, then the token sampled at
        the first rejected position or after the last draft); an int entry is one token.
      now: the caller's clock at the end of the step (recorded as finish_time).
      finished_ids: sequences the engine stopped this step (EOS or a stop condition); each must
        have sampled this step. Their last sampled token is kept in the output (the engine
        cuts a row's entry at the token that stopped it).

    Returns:
      (new state, finished records: decode rows first, then prefill rows, each in row order).

    Raises:
      StepOrderError: the plan is not the one in flight for this state.
      CommitError: wrong number of entries or of a row's tokens, or finished_ids naming a
        non-sampling row.
    """
    sampled = tuple(sampled_token_ids)
    stopped = frozenset(finished_ids)
    if state.unfilled is not None:
        if state.unfilled.step != plan.state.step:
            raise StepOrderError(f"commit the advanced plan of step {state.unfilled.step} "
                                 f"before the plan of step {plan.state.step}")
        return _fill(state, plan, sampled, now, stopped)
    if plan.is_empty and state.step == plan.state.step and not sampled and not stopped:
        return state, ()  # nothing ran; an empty plan leaves nothing in flight
    _check(state, plan, sampled, stopped)
    state, finished, _ = _commit(state, plan, sampled, now, stopped, hold=False)
    return state, finished


def _commit(state: SchedulerState, plan: StepPlan, sampled: tuple, now: float,
            stopped: frozenset, hold: bool):
    """`commit` once checked; `hold` (advance): decode rows with drafts are returned apart.
    Returns (state, finished records, held rows)."""
    pool = state.pool
    finished: list[Finished] = []
    held = ()
    k = plan.num_decode_rows
    bs = state.config.block_size

    # 2. decode rows
    if plan.spec_token_ids:
        tokens = spec.entries(plan, sampled)
        prefill_pairs = _prefilled_blocks(state, plan) if pool.cache is not None else []
        dec, pool, finished, held = spec.commit_decodes(
            state.decoding, plan, tokens[:k], stopped, now, pool, state.config, prefill_pairs,
            hold)
        sampled = tuple(t[0] for t in tokens)  # prefill rows: one token each
    else:
        dec, rows, done = _advance_decodes(state.decoding, plan, sampled, gen_chunk(bs))
        if pool.cache is not None:  # cache every block this step filled, before any release
            dec, pairs = _decoded_blocks(dec, rows, bs, state.config.num_kv_groups)
            pool = pool.register(pairs + _prefilled_blocks(state, plan))
        if stopped:
            done = sorted(set(done).union(i for i in rows if dec.ids[i] in stopped))
        for i in done:
            reason = FINISH_STOP if dec.ids[i] in stopped else FINISH_LENGTH
            finished.append(Finished(request_id=dec.ids[i], output_token_ids=dec.outputs(i),
                                     reason=reason, finish_time=now,
                                     num_cached_tokens=dec.seqs[i].cached_tokens or 0))
            pool = pool.give(dec.tables[i])
        dec = dec.without(set(done))

    if k == len(plan.request_ids):  # no prefill rows: partials unchanged
        return _replaced(state, dec, pool, state.partial, finished), tuple(finished), held

    # 3. prefill rows
    partial = {p.seq.request_id: p for p in state.partial}
    ready = []  # rows of sequences whose prefill completed
    s = k
    for r in range(k, len(plan.request_ids)):
        token = None
        if plan.samples[r]:
            token, s = sampled[s], s + 1
        part = partial.get(plan.request_ids[r])
        if part is None:  # aborted after schedule
            continue
        seq, computed = part.seq, part.computed + plan.lengths[r]
        if token is None and seq.request.pooling and computed == len(seq.tokens):
            del partial[seq.request_id]  # prefill only: done, and keeps no KV
            finished.append(Finished(request_id=seq.request_id, output_token_ids=(),
                                     reason=FINISH_STOP, finish_time=now))
            pool = pool.give(part.table)
            continue
        if token is None:
            partial[seq.request_id] = Partial(seq=seq, computed=computed, table=part.table)
            continue
        del partial[seq.request_id]
        if computed >= seq.limit or seq.request_id in stopped:
            reason = FINISH_STOP if seq.request_id in stopped else FINISH_LENGTH
            finished.append(Finished(request_id=seq.request_id,
                                     output_token_ids=seq.kept_outputs() + (token,),
                                     reason=reason, finish_time=now,
                                     num_cached_tokens=seq.cached_tokens or 0))
            pool = pool.give(part.table)
        else:
            ready.append(DecodeRow(seq, computed, (token,), (), seq.block_hashes, part.table))
    dec = dec.inserted(ready)

    return (_replaced(state, dec, pool, tuple(partial.values()), finished), tuple(finished),
            held)


def advance(state: SchedulerState, plan: StepPlan) -> SchedulerState:
    """Folds in the plan in flight as if each of its sampling rows yielded one PLACEHOLDER token,
    so that the next step can be planned before this one's tokens are known. Pure.

    Args:
      state: `plan.state`, possibly after `add_request` / `abort` calls.
      plan: the plan in flight.

    Decode rows that verify draft tokens in the plan are not advanced (how many they accept is
    unknown): they wait in `unfilled.verifying`, planned by nobody, until the fill.

    Returns:
      A state with nothing in flight and `unfilled` set: `schedule` may plan from it, and
      `commit(later_state, plan, sampled, now, finished_ids)` fills in the real tokens.

    Raises:
      StepOrderError: the plan is not the one in flight, or an earlier advanced step is still
        unfilled (commit it first: at most one step runs ahead).
    """
    if state.unfilled is not None:
        raise StepOrderError(f"step {state.unfilled.step} was advanced and not committed yet")
    if plan.is_empty and state.step == plan.state.step:
        return state  # nothing in flight
    sampled = (PLACEHOLDER,) * plan.num_sampled
    _check(state, plan, sampled, frozenset())
    ahead, finished, held = _commit(state, plan, sampled, 0.0, frozenset(), hold=True)
    return _replaced(state, ahead.decoding, ahead.pool, ahead.partial, (),  # still held
                     unfilled=Unfilled(step=plan.state.step, finished=finished,
                                       verifying=held))


def abandon(state: SchedulerState, plans: SequenceOf[StepPlan]) -> SchedulerState:
    """Drops plans that will never be committed (their step failed). Pure.

    Every request with a row in `plans`, or with a placeholder token, is aborted (its blocks
    freed); the state keeps everything else and has nothing in flight or unfilled. A state
    holding no request at all is cleared whatever `plans` is.

    Raises:
      StepOrderError: `plans` lacks the plan in flight or the advanced, unfilled one.
    """
    if not state.held:  # nothing left to protect: no row can hold a placeholder or a block
        return _replaced(state, state.decoding, state.pool, state.partial, ())
    steps = {plan.state.step for plan in plans}
    if state.in_flight and state.step not in steps:
        raise StepOrderError(f"the plan of step {state.step} is in flight and not abandoned")
    unfilled = state.unfilled
    if unfilled is not None and unfilled.step not in steps:
        raise StepOrderError(f"the advanced plan of step {unfilled.step} is not abandoned")
    doomed = {rid for plan in plans for rid in plan.request_ids}
    if unfilled is not None:
        doomed.update(f.request_id for f in unfilled.finished)
        doomed.update(unfilled.preempted)
    for rid in sorted(doomed & state.held, key=str):
        state = abort(state, rid)
    return _replaced(state, state.decoding, state.pool, state.partial, ())


def forget_prefix_cache(state: SchedulerState) -> SchedulerState:
    """The state with an empty prefix cache: every block free, no digest remembered, the host
    tier emptied too (after the engine lost or reset the KV cache those digests would point
    at; the host copies came from it). Pure.

    Raises:
      StepOrderError: some sequence still holds blocks, or a plan is in flight.
    """
    if state.pool.num_in_use or state.in_flight or state.unfilled is not None:
        raise StepOrderError("the prefix cache can be forgotten only when no sequence holds "
                             "blocks and nothing is in flight")
    return dataclasses.replace(state, pool=BlockPool.full(
        state.config.num_blocks, prefix_caching=state.config.enable_prefix_caching,
        host_blocks=state.config.num_host_blocks))


def _filled(seq: Sequence, token: int, block_size: int) -> Sequence:
    """A waiting sequence (preempted while its newest token was a placeholder), filled."""
    tokens = seq.tokens[:-1] + (token,)
    hashes = seq.block_hashes
    if hashes and len(tokens) % block_size == 0 and len(hashes) == len(tokens) // block_size:
        # the last block held it
        parent = hashes[-2] if len(hashes) > 1 else root_digest(seq.request.adapter)
        hashes = hashes[:-1] + chain_hashes(tokens, block_size, parent, len(hashes) - 1)
    return Sequence(request=seq.request, key=seq.key, tokens=tokens, block_hashes=hashes,
                    cached_tokens=seq.cached_tokens)


def _fill(state: SchedulerState, plan: StepPlan, sampled: tuple[int, ...], now: float,
          stopped: frozenset) -> tuple[SchedulerState, tuple[Finished, ...]]:
    """`commit` of an advanced plan: real tokens replace its placeholders; stopped requests leave
    (see the module docstring)."""
    if len(sampled) != plan.num_sampled:
        raise CommitError("sampled_token_ids",
                          f"expected {plan.num_sampled} tokens (one per sampling row), "
                          f"got {len(sampled)}")
    yielded = None  # per sampling request, its tokens (plans with drafts)
    if plan.spec_token_ids:
        yielded = dict(zip(compress(plan.request_ids, plan.samples), spec.entries(plan, sampled)))
        sampled = tuple(tokens[0] for tokens in yielded.values())  # rows without drafts: one
    token_of = dict(zip(compress(plan.request_ids, plan.samples), sampled))
    strangers = stopped - token_of.keys()
    if strangers:
        raise CommitError("finished_ids",
                          f"{sorted(map(str, strangers))} sampled nothing this step")
    unfilled, pool, bs = state.unfilled, state.pool, state.config.block_size
    row_of = {rid: i for i, rid in enumerate(plan.request_ids)}
    finished = []
    for f in unfilled.finished:
        reason = FINISH_STOP if f.request_id in stopped else f.reason
        token = token_of.get(f.request_id)  # None: a pooling request (it sampled nothing)
        outputs = f.output_token_ids if token is None else f.output_token_ids[:-1] + (token,)
        finished.append(Finished(
            request_id=f.request_id, output_token_ids=outputs, reason=reason, finish_time=now,
            num_cached_tokens=f.num_cached_tokens))
    # decode rows: the newest token of each row that sampled in the plan
    dec = state.decoding
    recent = list(dec.recent)
    ended = set()
    for i, rid in enumerate(dec.ids):
        token = token_of.get(rid)
        if token is not None and recent[i][-1] == PLACEHOLDER:
            recent[i] = recent[i][:-1] + (token,)
            if rid in stopped:
                ended.add(i)
    dec = dec.with_progress(recent=tuple(recent))
    for i in ended:
        finished.append(Finished(request_id=dec.ids[i], output_token_ids=dec.outputs(i),
                                 reason=FINISH_STOP, finish_time=now,
                                 num_cached_tokens=dec.seqs[i].cached_tokens or 0))
        pool = pool.give(dec.tables[i])
    dec = dec.without(ended)
    if unfilled.verifying:  # rows that verified drafts: what they accepted
        dec, pool, done = spec.fill_verifying(dec, unfilled.verifying, yielded, stopped, now,
                                              pool, state.config)
        finished += done
    # sequences a later plan preempted before the fill (no blocks held)
    waiting = state.waiting
    if unfilled.preempted:
        unknown = set(unfilled.preempted)
        kept = []
        for seq in waiting:
            rid = seq.request_id
            if rid in unknown and seq.tokens[-1] == PLACEHOLDER and rid in token_of:
                seq = _filled(seq, token_of[rid], bs)
                if rid in stopped:
                    finished.append(Finished(
                        request_id=rid, output_token_ids=seq.kept_outputs(), reason=FINISH_STOP,
                        finish_time=now, num_cached_tokens=seq.cached_tokens or 0))
                    continue
            kept.append(seq)
        waiting = tuple(kept)
    finished.sort(key=lambda f: row_of[f.request_id])
    held = state.held.difference([f.request_id for f in finished]) if finished else state.held
    return SchedulerState(
        config=state.config, waiting=waiting, partial=state.partial, decoding=dec, pool=pool,
        step=state.step, decode_steps_since_prefill=state.decode_steps_since_prefill,
        next_ticket=state.next_ticket, in_flight=state.in_flight, unfilled=None,
        held=held, lora_drain=state.lora_drain), tuple(finished)


def _replaced(state: SchedulerState, dec: DecodeTable, pool: BlockPool,
              partial: tuple[Partial, ...], finished, unfilled: Unfilled | None = None
              ) -> SchedulerState:
    """`state` after a commit: new running sequences and pool, `finished` gone, nothing in
    flight."""
    held = state.held.difference([f.request_id for f in finished]) if finished else state.held
    return SchedulerState(
        config=state.config, waiting=state.waiting, partial=partial, decoding=dec, pool=pool,
        step=state.step, decode_steps_since_prefill=state.decode_steps_since_prefill,
        next_ticket=state.next_ticket, in_flight=False, unfilled=unfilled, held=held,
        lora_drain=state.lora_drain)
