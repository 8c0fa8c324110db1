"""Phase 3 of a step: admissions (waiting -> running), with prefix-cache hits and host loads.

`Admissions` is the part of `StepBuilder` (scheduler/planner.py) that admits waiting sequences
in key order (FCFS within a priority), stopping at the first that cannot be admitted so nobody
overtakes it, except a LoRA sequence waiting for an adapter slot, which later ones may pass
(scheduler/lora_slots.py: a drain keeps it from starving). Admissions need blocks beyond the watermark, never preempt, and do not happen in
a step that preempted or held a partial back. With prefix caching a sequence first takes the
longest cached prefix every KV cache group can reuse (`kv_groups.find_hits`: whole blocks, at
most len(tokens) - 1 tokens, so its last token is computed and yields logits) and computes from
there: cached blocks cost no budget, and only those no one held leave the usable pool.

With a host tier, hit blocks only the host holds are loaded into fresh device blocks
(`kv_groups.load_hits`); such an admission (and any other sharing a block loaded by this plan)
runs no chunk in this step: it enters the partial prefills with its cursor after the hit and
its first chunk runs in the next step, once the loads landed (scheduler/host_tier.py).
"""

from __future__ import annotations

from scheduler.blocks import BlockTable
from scheduler.kv_groups import NO_HITS, Hits, find_hits, load_hits
from scheduler.lora_slots import SlotGate
from scheduler.request import Sequence
from scheduler.state import Partial


class Admissions:
    """Phase 3 of `StepBuilder`; uses its budget, pool and chunk sizing."""

    def admit(self, whole: bool) -> None:
        """Admits waiting sequences in key order until one cannot be admitted (no overtaking)."""
        waiting = self.state.waiting
        if not waiting or self.preempted or self.engaged.get("partials_held"):
            return
        config = self.config
        cap = config.prefill_max_seqs
        held = len(self.state.verifying)  # running, out of the table until their fill
        gate = None  # built when the first sequence of an adapter is considered
        i = 0
        while i < len(waiting):
            if (len(self.dec) + len(self.partial) + len(self.admitted) + held
                    >= config.max_num_seqs):
                self._note("seqs_full")
                break
            if cap and len(self.admitted) >= cap:
                self._note("cap_deferred", len(waiting) - i)
                break
            seq = waiting[i]
            if seq.request.adapter is not None or gate is not None:
                gate = gate or self._slot_gate()
                if not gate.admits(seq):  # waits for an adapter slot; others may pass it
                    self.passed.append(seq)
                    i += 1
                    continue
            hits = self._cache_hits(seq)
            waits = bool(hits.loads) or not self.loading_blocks.isdisjoint(hits.table)
            n = self._admission_chunk(seq, whole, hits, runs=not waits)
            if not n:
                break
            if waits and self.partials_after >= config.max_num_partial_prefills:
                self._note("partial_limit")  # it stays mid-prefill while its blocks load
                break
            if gate is not None:
                gate.admitted(seq)
            cached = hits.num_blocks * config.block_size
            if seq.cached_tokens is None and self.pool.cache is not None:  # first admission
                seq = Sequence(request=seq.request, key=seq.key, tokens=seq.tokens,
                               block_hashes=seq.block_hashes, cached_tokens=cached)
            self.pool = self.pool.acquire(hits.table)
            table = self._load(hits)
            if waits:  # its first chunk runs in the next step, once the loads landed
                self.admitted.append(Partial(seq=seq, computed=cached, table=table,
                                             num_cached=cached))
                self.loading.append(seq)
                self.partials_after += 1
                i += 1
                continue
            part = Partial(seq=seq, computed=cached, table=self._grow(table, cached + n))
            self.admitted.append(part)
            self._add_prefill_row(part, n, cached)
            if cached + n < len(seq.tokens):
                self.partials_after += 1
            i += 1
        self.waiting_from = i
        if gate is not None:
            self.lora_drain = gate.drain
            if gate.deferred:
                self._note("lora_deferred", gate.deferred)

    def _slot_gate(self) -> SlotGate:
        """The adapter-slot gate of this step's admissions (phases 1 and 2 are done)."""
        running = [*self.dec.seqs, *(p.seq for p in self.partial),
                   *(p.seq for p in self.admitted), *(row.seq for row in self.state.verifying)]
        return SlotGate(self.config.max_loras, running, self.state.waiting, self.lora_drain)

    def _load(self, hits: Hits) -> BlockTable:
        """`hits.table` with a fresh device block for each entry only the host holds: the
        block is cached under its key, held by the admission, and loaded by this plan."""
        if not hits.loads:
            return hits.table
        self.pool, table, loads = load_hits(self.pool, hits)
        self.loads += loads
        self.loading_blocks.update(block for _, block in loads)
        return table

    def _cache_hits(self, seq: Sequence) -> Hits:
        """The longest cached prefix of `seq.tokens` every KV cache group can reuse: whole
        blocks, at most len(tokens) - 1 tokens (the last token is always computed, for its
        logits); under a sliding window, only the blocks its window still reads
        (`kv_groups.find_hits`)."""
        if self.pool.cache is None or seq.request.pooling:  # a pooled position is computed
            return NO_HITS
        limit = (len(seq.tokens) - 1) // self.config.block_size
        return find_hits(self.pool, seq.block_hashes[:limit], self.config.group_windows,
                         self.config.block_size)

    def _admission_chunk(self, seq: Sequence, whole: bool, hits: Hits, runs: bool = True) -> int:
        """First computed chunk of a waiting sequence after its cached blocks `hits`, or 0 if it
        cannot be admitted this step. Hits that no one holds, and blocks to load from the host,
        leave the usable pool; shared ones cost nothing, and no hit counts against the token
        budget. `runs`: False for an admission that waits for its loads (the chunk it would
        run is only sized: the knobs that would shape it are not recorded, a refusal is)."""
        total = len(seq.tokens) - hits.num_blocks * self.config.block_size
        revived = sum(b is not None and self.pool.ref_count(b) == 0 for b in hits.table)
        usable = (self.pool.num_free - revived - len(hits.loads)
                  - self.config.watermark_blocks)
        by_blocks = max(0, self._tokens_by_blocks(0, 0, usable))
        if whole:
            if total > self.budget and self.num_rows:
                self._note("budget_full_at")
                return 0
            return self._whole(total, by_blocks)
        n, reasons = self._size(total, by_blocks)
        if n and n < total and self.partials_after >= self.config.max_num_partial_prefills:
            self._note("partial_limit")
            return 0
        if runs or not n:  # a refusal is recorded either way
            self._use(reasons)
        return n
