"""n > 1: one user request, n completions ("children") that share the prompt.

NOTE: how the prompt is computed once. Child 0 enters the scheduler at once; children
1..n-1 wait here until child 0's prompt has been computed (its first token is sampled,
or it finished), then enter the scheduler together: with prefix caching on, every full
block of the prompt is a cache hit for them (only the tail block, at least one token,
is recomputed). A true fork of the block table (sharing the partial tail too) would need
a scheduler operation; see the report in WORKSPACE.md. With prefix caching off the
children enter at once and each computes the prompt.

Child i samples with seed `seed + i` (mod 2**32) when the request has a seed, else with
the engine's per-request derivation of its own id, so every child has its own stream
and a seeded request is reproducible.
"""

from __future__ import annotations

import dataclasses

from arcjax.engine.request_state import RequestState

CHILD_SEP = "\x1fn"  # child ids: f"{parent}{CHILD_SEP}{index}" (no user id contains \x1f)


def child_id(parent: str, index: int) -> str:
    return f"{parent}{CHILD_SEP}{index}"


def child_seed(seed: int, index: int) -> int:
    return (seed + index) % 2**32


@dataclasses.dataclass
class RequestGroup:
    """The children of one n > 1 request (owned by the stepping thread once drained)."""

    request_id: str
    children: list[RequestState]
    waiting: list[tuple[RequestState, object]]  # (state, scheduler.Request) not yet added
    sink: object = None

    @property
    def finished(self) -> bool:
        return not self.waiting and all(c.finished for c in self.children)

    def ready(self) -> bool:
        """Whether the waiting children may enter (child 0's prompt is computed)."""
        first = self.children[0]
        return bool(self.waiting) and (bool(first.token_ids) or first.finished)
