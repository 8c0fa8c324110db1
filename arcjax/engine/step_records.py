"""The records a step of the engine core hands between its stages (core.py): the step
planned and launched (`Launched`, with a `PendingSampling` when it was launched as a
forward only), its results on the host (`Collected`), and a failed stage (`StepFailed`).
"""

from __future__ import annotations

import dataclasses

import scheduler
from arcjax.engine.request_state import RequestState
from arcjax.runtime.batching import PreparedStep
from arcjax.runtime.buckets import Bucket
from arcjax.runtime.step_handle import StepHandle
from arcjax.runtime.step_output import StepOutput


class StepFailed(Exception):
    """A stage of a step failed. `everyone`: every request in the scheduler is affected
    (proposing or planning failed); `device`: the device's KV is unknown; `rollback`:
    (request, snapshot) pairs to restore."""

    def __init__(self, stage: str, cause: BaseException, *, everyone: bool = False,
                 device: bool = False, rollback: list | None = None):
        super().__init__(f"{stage} failed: {cause!r}")
        self.stage, self.cause, self.everyone, self.device = stage, cause, everyone, device
        self.rollback = rollback or []


@dataclasses.dataclass(frozen=True)
class PendingSampling:
    """The sampling half of a step launched as a forward only: its inputs, and its
    constrained rows ((first sampled position, grammar, drafts) each), whose masks wait
    for the tokens of the step before."""

    prepared: PreparedStep
    grammars: list[tuple]


@dataclasses.dataclass
class Launched:
    """A step planned (and, once `handle` is set, dispatched) and not committed yet."""

    plan: scheduler.StepPlan
    reqs: list[RequestState]
    start: float
    prompts: list | None = None  # per row, the prompt whose logprobs it wants (or None)
    bucket: Bucket | None = None  # once packed
    handle: StepHandle | None = None  # once dispatched
    compiled: bool = False  # its launch acquired an executable
    pending: PendingSampling | None = None  # launched as a forward only, not sampled yet

    @property
    def width(self) -> int:
        """Positions sampled per sequence (1 + k in a verification step)."""
        return self.bucket.sample_width


@dataclasses.dataclass(frozen=True)
class Collected:
    """A launched step's results on the host."""

    out: StepOutput  # tokens on the host; log-probabilities still on the device
    yielded: dict[int, list[int]]  # sampling plan row -> its tokens (1 + accepted drafts)
    logprobs: tuple | None  # the sampled tokens' logprobs (host arrays) when a row asked
    now: float  # when the tokens were on the host
