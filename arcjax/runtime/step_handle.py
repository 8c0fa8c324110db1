"""A launched step: its handle (`StepHandle`), the forward half of a step launched in two
parts (`ForwardResult`), the input ids a step takes from the one before it on the device
(`TokenFeed`), and the thread that stamps when the device finished each step
(`CompletionWatcher`).
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Mapping

import jax
import numpy as np

from arcjax.runtime.sampling import TokenLogprobs
from arcjax.runtime.step_output import StepOutput


@dataclasses.dataclass(frozen=True)
class ForwardResult:
    """The forward of a step launched in two parts (`ModelRunner.launch_forward`), on the
    device until `ModelRunner.launch_sampling` samples it."""

    logits: jax.Array  # [R, V] at the sampled positions
    prompt_logprobs: TokenLogprobs | None  # [T], a step with prompt_logprobs rows; else None
    expert_counts: jax.Array | None  # [L, E] tokens per expert (mixtures of experts) or None
    pooled: jax.Array | None = None  # [S, H] pooled sums, a step with pooling rows; else None


@dataclasses.dataclass
class StepHandle:
    """A launched step: its outputs (on the device until `collect`), and times.

    Attributes:
      out: the `StepOutput`, device arrays (None between `launch_forward` and
        `launch_sampling`).
      dispatched: clock time just before the step was dispatched.
      ready: clock time the device finished it, when the runner watches completions
        (`ModelRunner.watch_completion`), else None.
      forward: a step launched by `launch_forward` and not sampled yet: its forward's
        outputs; else None.
    """

    out: StepOutput | None
    dispatched: float
    ready: float | None = None
    forward: ForwardResult | None = None
    _done: threading.Event | None = None

    def wait_ready(self) -> float | None:
        """`ready`, once the watcher has seen the step finish (None when not watched)."""
        if self._done is not None:
            self._done.wait()
        return self.ready


@dataclasses.dataclass(frozen=True)
class TokenFeed:
    """Input ids a step takes from the step before it, on the device (overlapped scheduling:
    the host's batch holds a placeholder where the token is still being sampled)."""

    source: StepHandle  # the step that samples them
    rows: np.ndarray  # [T] bool: input rows fed from `source`
    positions: np.ndarray  # [T] int32: a fed row's sampled position in `source` (else 0)

    @classmethod
    def build(cls, source: StepHandle, num_tokens: int,
              fed: Mapping[int, int]) -> "TokenFeed":
        """`fed`: input row -> the sampled position of `source` whose token it takes."""
        rows = np.zeros(num_tokens, bool)
        positions = np.zeros(num_tokens, np.int32)
        for row, position in fed.items():
            rows[row], positions[row] = True, position
        return cls(source, rows, positions)


class CompletionWatcher:
    """A daemon thread that blocks on each launched step's tokens and stamps when the device
    finished it (for measuring the device's idle time between steps; off by default)."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="arcjax-step-watcher", daemon=True).start()

    def add(self, handle: StepHandle) -> None:
        handle._done = threading.Event()
        self._queue.put(handle)

    def stop(self) -> None:
        """Ends the thread once the steps queued so far are stamped."""
        self._queue.put(None)

    def _loop(self) -> None:
        while True:
            handle = self._queue.get()
            if handle is None:
                return
            try:
                handle.out.tokens.block_until_ready()
            except Exception:  # noqa: BLE001  the step failed: `collect` reports it
                pass
            handle.ready = time.perf_counter()
            handle._done.set()
