"""The LoRA slot constraint: at most `max_loras` adapters run at once, and nobody starves.

A running sequence's adapter (`Request.adapter`) sits in one of the device's `max_loras`
adapter slots (the engine's slot table fills them); every row of a step belongs to a running
sequence, so a step uses at most `max_loras` adapters. Admission (planner phase 3) asks a
`SlotGate` before it admits a waiting sequence:

  1. A sequence of the base model (adapter None), or of an adapter some running sequence
     already uses, is admitted as before, unless its adapter is being drained (3).
  2. A sequence of another adapter takes a free slot if one is left. Otherwise it is
     slot-blocked: it stays waiting, and later sequences may be admitted past it (a sequence
     waiting for KV blocks or budget still holds everyone behind it), so the adapters that
     hold slots keep serving.
  3. No starvation: when a sequence is slot-blocked and no adapter is draining, one running
     adapter is chosen to drain (`SchedulerState.lora_drain`: the one with the fewest running
     sequences, then the smallest key). None of its waiting sequences is admitted while it
     drains; its running sequences finish (running sequences always progress), its slot
     frees, and the first slot-blocked sequence in key order takes it. A drain ends when its
     adapter has no running sequence left, or when no waiting sequence is slot-blocked.

`engaged.lora_deferred` counts the waiting sequences passed over in a step (slot-blocked or
draining). Pure: a gate is scratch space of one `schedule` call, built from the state.
"""

from __future__ import annotations

from collections.abc import Iterable

from scheduler.request import Sequence


def adapter_counts(sequences: Iterable[Sequence]) -> dict[int, int]:
    """Sequences per adapter among `sequences` (base-model sequences are not counted)."""
    counts: dict[int, int] = {}
    for seq in sequences:
        adapter = seq.request.adapter
        if adapter is not None:
            counts[adapter] = counts.get(adapter, 0) + 1
    return counts


class SlotGate:
    """Which waiting sequences may be admitted now (see the module docstring).

    Args:
      max_loras: the adapter slots.
      running: the running sequences (decoding, mid-prefill, verifying).
      waiting: the waiting sequences, in key order.
      drain: the adapter draining before this step (`SchedulerState.lora_drain`), or None.
    """

    def __init__(self, max_loras: int, running: Iterable[Sequence],
                 waiting: tuple[Sequence, ...], drain: int | None):
        self.max_loras = max_loras
        self.counts = adapter_counts(running)  # adapter -> running sequences (admitted too)
        self.deferred = 0  # waiting sequences passed over this step
        if drain is not None and (drain not in self.counts or not any(
                self._blocked(seq.request.adapter) for seq in waiting)):
            drain = None  # its slot is free, or nobody waits for one
        self.drain = drain

    def _blocked(self, adapter: int | None) -> bool:
        return (adapter is not None and adapter not in self.counts
                and len(self.counts) >= self.max_loras)

    def admits(self, seq: Sequence) -> bool:
        """Whether `seq` may be admitted now. A refusal counts it as deferred and, when it is
        slot-blocked and no adapter drains, starts a drain."""
        adapter = seq.request.adapter
        if adapter is None or (adapter in self.counts and adapter != self.drain):
            return True
        if adapter not in self.counts and len(self.counts) < self.max_loras:
            return True
        self.deferred += 1
        if self.drain is None and adapter not in self.counts:
            self.drain = min(self.counts, key=lambda a: (self.counts[a], a))
        return False

    def admitted(self, seq: Sequence) -> None:
        """Records the admission of `seq` (its adapter now holds a slot)."""
        adapter = seq.request.adapter
        if adapter is not None:
            self.counts[adapter] = self.counts.get(adapter, 0) + 1
