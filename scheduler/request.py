"""Records the planner moves around: the user's `Request`, the internal `Sequence`, `Finished`."""

from __future__ import annotations

import dataclasses
from typing import TypeAlias

RequestId: TypeAlias = int | str

# Sort key of a sequence: (priority, arrival_time, ticket). Smaller is served first; the ticket is
# the order of `add_request` calls and breaks ties between equal arrival times.
SeqKey: TypeAlias = tuple[int, float, int]

FINISH_LENGTH = "length"
FINISH_STOP = "stop"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """A generation request as the engine submits it (validated by `add_request`).

    Attributes:
      request_id: unique among waiting and running requests.
      prompt_token_ids: the prompt (stored as a tuple).
      max_tokens: tokens to generate at most.
      arrival_time: when it arrived (seconds on the caller's clock); orders FCFS.
      priority: smaller is served first (vLLM convention); equal priorities are FCFS.
      adapter: None (the base model), or the key of the LoRA adapter the request runs with
        (an int >= 0 the engine gives each adapter it loads). Requests of one adapter share
        a device slot and prefix-cache blocks; two adapters never share a block (their block
        digests chain from different roots), and at most `max_loras` adapters run at once
        (scheduler/lora_slots.py).
      pooling: a prefill-only request (an embedding): its chunks run like any prompt's, its
        final chunk samples nothing, and it finishes ("stop", no output token) in the commit
        of that chunk, its blocks freed; it never reads or fills the prefix cache (a pooled
        position must be computed). Its max_tokens is 0.
    """

    request_id: RequestId
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival_time: float = 0.0
    priority: int = 0
    adapter: int | None = None
    pooling: bool = False

    def __post_init__(self):
        if not isinstance(self.prompt_token_ids, tuple):
            object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Sequence:
    """A request inside the scheduler, waiting or running.

    Attributes:
      request: the submitted request.
      key: (priority, arrival_time, ticket): the waiting order, and the rank while running (the
        largest key is preempted first).
      tokens: what a (re)admission computes: the prompt, then any outputs kept across preemptions.
      block_hashes: prefix-cache digests of the full blocks of `tokens` (() with caching off).
      cached_tokens: prompt tokens served from the prefix cache at its FIRST admission (None
        until admitted, and always with caching off: read it as 0). A readmission after
        preemption may hit more (its own released blocks) but keeps reporting this: it is what
        the user's first token waited for.
    """

    request: Request
    key: SeqKey
    tokens: tuple[int, ...]
    block_hashes: tuple[bytes, ...] = ()
    cached_tokens: int | None = None

    @property
    def request_id(self) -> RequestId:
        return self.request.request_id

    @property
    def limit(self) -> int:
        """num_computed_tokens at which max_tokens outputs exist (the last one is never fed back)."""
        return len(self.request.prompt_token_ids) + self.request.max_tokens - 1

    def kept_outputs(self) -> tuple[int, ...]:
        """Outputs generated before the last preemption."""
        return self.tokens[len(self.request.prompt_token_ids):]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Finished:
    """A request that left the scheduler through `commit`.

    Attributes:
      request_id: the request.
      output_token_ids: every generated token, in order (() for a pooling request).
      reason: "length" (max_tokens reached) or "stop" (the engine saw EOS or a stop condition;
        a pooling request whose prompt is computed).
      finish_time: the `now` passed to the commit that finished it.
      num_cached_tokens: prompt tokens served from the prefix cache at its first admission.
    """

    request_id: RequestId
    output_token_ids: tuple[int, ...]
    reason: str
    finish_time: float
    num_cached_tokens: int = 0
