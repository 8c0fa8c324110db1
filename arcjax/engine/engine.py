"""The engine: requests in from any thread, one step at a time, outputs out.

  1. `add_request` (any thread): `InputProcessor` (input_processor.py) validates and
     tokenizes in the caller's thread (a refusal raises there, typed) and the request
     enters the inbox.
  2. `run_step` (one thread at a time): the inbox is drained into the core (adds, aborts;
     multi-host: the leader's inbox is broadcast first), the core runs one step (core.py:
     schedule, launch, collect, append, commit, trace, finish; every failure ends its
     requests there), and, in a `finally`, the core's `OutputProcessor`
     (output_processor.py) builds the outputs of every request the step changed and hands
     each to its sink, or keeps it for the next `step()` return.
  3. A failure the core cannot recover from kills the engine (`EngineDeadError`): every
     later call raises it at once, `has_unfinished()` is false, nothing is delivered any
     more, and, multi-host, every other process is told (they stop with the same error).

NOTE: threading and lifetimes (WORKSPACE.md, "Threading and lifetimes"). Only the stepping
thread touches the core (scheduler state, request states); `add_request`, `abort` and
`stats` may run in any thread, guarded by `_lock`. An abort made while nobody steps is
applied at once. Finished requests are released once their final output is built; the
trace is a ring; `has_unfinished()` is O(1).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence

import scheduler
from arcjax.engine.core import EngineCore
from arcjax.engine.group import CHILD_SEP
from arcjax.engine.input_processor import Abort, InputProcessor, NewGroup, NewRequest
from arcjax.outputs import RequestOutput
from arcjax.engine.request_state import FINISH_ERROR
from arcjax.engine.tokenizer import Tokenizer
from arcjax.errors import (DuplicateRequestError, EngineConfigError, EngineDeadError,
                           RequestError, UnknownRequestError)
from arcjax.lora.adapter_cache import AdapterCache
from arcjax.lora.lora_request import LoRARequest
from arcjax.model.formats.pooler_config import PoolerConfig
from arcjax.parallel.multihost import FollowerStop
from arcjax.pooling_params import PoolingParams
from arcjax.runtime.runner import ModelRunner
from arcjax.sampling_params import SamplingParams
from arcjax.structured import StructuredOutputManager

Sink = Callable[[RequestOutput], None]


class Engine:
    """Online engine: `add_request`, `step`, `abort`, `has_unfinished` (see module NOTE).

    Args:
      runner, tokenizer, sched_config, max_model_len: the model as `build_engine` made it.
      seed: seeds requests whose SamplingParams have no seed.
      clock: the engine's clock (arrival times, token times, the trace).
      trace_capacity: steps the trace ring keeps.
      async_scheduling: the overlapped step (plan step N+1 while step N runs) or the serial
        one; chosen here, once.
      speculator: speculative decoding (`arcjax.spec_decode.speculator.Speculator`), or None.
      reasoning: splits outputs into reasoning and content and starts grammars after the
        reasoning (`arcjax.reasoning.model_reasoning.ModelReasoning`), or None.
      pooler: how the model pools its hidden states (runner="pooling": embedding requests,
        `PoolingParams`, are served beside generation); None = embeddings are refused.
    """

    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer | None,
                 sched_config: scheduler.SchedulerConfig, *, max_model_len: int,
                 seed: int = 0, clock=time.perf_counter, model_dir=None,
                 trace_capacity: int = 10_000, async_scheduling: bool = False,
                 speculator=None, reasoning=None, pooler: PoolerConfig | None = None,
                 adapters: AdapterCache | None = None):
        self.runner, self.tokenizer, self.model_dir = runner, tokenizer, model_dir
        self.sched_config, self.max_model_len, self.clock = sched_config, max_model_len, clock
        eos = tokenizer.eos_token_ids if tokenizer else runner.cfg.eos_token_ids
        self.eos_token_ids = frozenset(eos)
        # structured outputs: grammars compiled on first use, masks filled per step
        self.structured = StructuredOutputManager(
            tokenizer.to_json if tokenizer is not None else None, runner.cfg.vocab_size,
            sorted(self.eos_token_ids))
        self.pooler = pooler
        self.adapters = adapters  # LoRA: the loaded adapters (None: LoRA is off)
        self.inputs = InputProcessor(tokenizer, runner.cfg.vocab_size, max_model_len,
                                     sched_config, seed, self.structured, reasoning,
                                     pooler, runner.cfg.hidden_size, adapters=adapters)
        self.core = EngineCore(runner, tokenizer, sched_config, clock=clock,
                               trace_capacity=trace_capacity,
                               async_scheduling=async_scheduling,
                               eos_token_ids=self.eos_token_ids, speculator=speculator,
                               structured=self.structured, adapters=adapters)
        self.dead: EngineDeadError | None = None
        self._lock = threading.Lock()  # guards the inbox, the id set and the pending list
        self._step_lock = threading.Lock()  # one step (or inbox drain) at a time
        self._inbox: list = []  # NewRequest | NewGroup | Abort
        self._unfinished: set[str] = set()  # ids submitted and not yet finished
        self._pending: list[RequestOutput] = []  # outputs of requests without a sink
        self._auto_ids = itertools.count()

    # --- the core's state, read-only views ---------------------------------------------
    @property
    def async_scheduling(self) -> bool:
        return self.core.async_scheduling

    @property
    def state(self) -> scheduler.SchedulerState:
        return self.core.state

    @property
    def requests(self):
        return self.core.requests

    @property
    def trace(self):
        """The last `trace_capacity` steps' `StepRecord`s (a ring)."""
        return self.core.trace.records

    @property
    def num_steps(self) -> int:
        return self.core.trace.num_steps

    @property
    def trace_sink(self):
        """Called with every step's `StepRecord` (stepping thread); a sink that raises
        fails that step and is detached (`trace_sink_error` says why)."""
        return self.core.trace.sink

    @trace_sink.setter
    def trace_sink(self, sink) -> None:
        self.core.trace.sink = sink

    @property
    def trace_sink_error(self) -> str | None:
        return self.core.trace.sink_error

    @property
    def sync(self):
        """Multi-host: the `arcjax.parallel.StepSync` of this process (None: one process)."""
        return self.core.sync

    @sync.setter
    def sync(self, sync) -> None:
        if sync is not None and self.async_scheduling:
            raise EngineConfigError("async_scheduling", "multi-host runs the serial step: "
                                    "build the engine with async_scheduling=False")
        self.core.sync = sync

    # --- submission (any thread) --------------------------------------------------------
    def add_request(self, prompt: str | Sequence[int],
                    params: SamplingParams | PoolingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    sink: Sink | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> str:
        """Validates and queues one request. Returns its id.

        Args:
          prompt: text, or token ids (ints, or a 1-D numpy integer array).
          params: sampling params; None = SamplingParams(). `PoolingParams`: an embedding
            request (its one output is a `PoolingRequestOutput`; runner="pooling" only).
          request_id: unique among unfinished requests; None = a fresh id.
          arrival_time: on the engine's clock; None = now.
          sink: receives every output of this request (from the stepping thread); without
            one, outputs are returned by `step()`. A sink that raises ends its request.
          priority: smaller is served first (the scheduler's order); equal: FCFS.
          lora_request: the LoRA adapter to run with (`arcjax.lora.lora_request.LoRARequest`;
            loaded here on first use), or None for the base model.

        Raises:
          RequestError (a ValueError naming `.field`): the request is refused; nothing is queued.
          EngineDeadError: the engine is dead.
        """
        self._check_alive()
        params = SamplingParams() if params is None else params
        text, ids = self.inputs.check(prompt, params)
        self.inputs.check_adapter(lora_request)
        arrival = self.clock() if arrival_time is None else arrival_time
        self.inputs.check_options(request_id, arrival, priority)
        if self.sync is not None and isinstance(params, PoolingParams):
            raise RequestError("params", "embeddings are not supported across several hosts "
                               "yet")
        if self.sync is not None and params.n > 1:
            raise RequestError("n", "n > 1 is not supported across several hosts yet", limit=1)
        with self._lock:
            self._check_alive()
            if request_id is None:
                request_id = next(i for i in map(str, self._auto_ids) if i not in self._unfinished)
            request_id = str(request_id)
            if CHILD_SEP[0] in request_id:
                raise RequestError("request_id", "must not contain the control character "
                                   f"{CHILD_SEP[0]!r} (it names n > 1 samples)")
            if request_id in self._unfinished:
                raise DuplicateRequestError("request_id", f"{request_id!r} is already in use")
            item = self.inputs.build(request_id, text, ids, params, arrival, priority, sink,
                                     lora_request)
            self._unfinished.add(request_id)
            self._inbox.append(item)
        return request_id

    def check(self, prompt, params: SamplingParams | PoolingParams,
              lora_request: LoRARequest | None = None) -> tuple[str | None, tuple[int, ...]]:
        """Validates a request (and loads its adapter) without queueing it. Returns
        (prompt text, token ids)."""
        self._check_alive()
        out = self.inputs.check(prompt, params)
        self.inputs.check_adapter(lora_request)
        return out

    def abort(self, request_id: str) -> None:
        """Aborts an unfinished request (any thread). Its blocks are freed at once when no
        step is running, else at the start of the next step; its final output has reason
        "abort".

        Raises:
          UnknownRequestError: the id is not an unfinished request.
          EngineDeadError: the engine is dead.
        """
        rid = str(request_id)
        with self._lock:
            self._check_alive()
            if rid not in self._unfinished:
                raise UnknownRequestError(rid, f"{rid!r} is not an unfinished request")
            self._inbox.append(Abort(rid))
        if self.sync is None and self._step_lock.acquire(blocking=False):  # apply it now
            try:
                if self.dead is None:
                    self._guarded(self._drain)
            finally:
                self._step_lock.release()

    def has_unfinished(self) -> bool:
        """Whether any submitted request has not finished (O(1); False once dead)."""
        return bool(self._unfinished)

    @property
    def num_unfinished(self) -> int:
        return len(self._unfinished)

    def unfinished_ids(self) -> list[str]:
        """Ids of every unfinished request (a snapshot)."""
        with self._lock:
            return list(self._unfinished)

    def fail_all(self, message: str) -> None:
        """Finishes every unfinished request with reason "error" and frees its blocks; the
        engine goes on serving new requests."""
        def work(changed: dict) -> None:
            if self.sync is None:  # multi-host: the inbox is drained in a step only
                self._drain(changed)
            self.core.fail_everything(message, changed)

        with self._step_lock:
            self._check_alive()
            self._guarded(work)

    # --- the step (one thread at a time) ---------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one engine iteration; returns the outputs of requests without a sink
        (those of this step and any not yet returned).

        Raises:
          EngineDeadError: the engine is dead (now or before).
        """
        self.run_step()
        with self._lock:
            out, self._pending = self._pending, []
        return out

    def run_step(self) -> None:
        """Runs one engine iteration; outputs go to sinks or to the pending list."""
        with self._step_lock:
            self._check_alive()
            self._guarded(self._one_step)

    def _one_step(self, changed: dict) -> None:
        self._drain(changed)
        self.core.step(changed)

    def _guarded(self, work: Callable[[dict], object]) -> None:
        """Runs `work(changed)` and delivers what it changed, in a `finally`. An exception
        escaping either kills the engine; a dead engine delivers nothing (its waiters get
        `EngineDeadError` instead)."""
        changed: dict = {}
        try:
            work(changed)
        except FollowerStop:  # a follower's run ends (multi-host): no failure
            raise
        except Exception as e:  # noqa: BLE001  the core could not recover
            raise self._die(e) from e
        finally:
            if self.dead is None:
                try:
                    self._deliver(changed)
                except Exception as e:  # noqa: BLE001
                    raise self._die(e) from e

    def _drain(self, changed: dict) -> None:
        """Applies queued adds and aborts (stepping thread)."""
        with self._lock:
            items, self._inbox = self._inbox, []
        if self.sync is not None:  # the leader's items, in order, on every process
            received = self.sync.exchange_inbox(self.inputs.to_wire(items))
            if not self.sync.is_leader:
                items = self.inputs.from_wire(received)
                with self._lock:
                    self._unfinished.update(i.state.request_id for i in items
                                            if isinstance(i, NewRequest))
        now = self.clock()
        for item in items:
            self.core.apply(item, now, changed)

    def _deliver(self, changed: dict) -> None:
        """Hands out the outputs of `changed`. A request whose sink failed (or whose output
        could not be built) ends with "error", and its final output goes out at once."""
        for last in (False, True):
            if not changed:
                return
            delivery = self.core.outputs.deliver(changed)
            with self._lock:
                self._pending.extend(delivery.pending)
                self._unfinished.difference_update(delivery.done)
            changed = {}
            if not last:
                now = self.clock()
                for rid, message in delivery.broken.items():
                    self.core.end(rid, FINISH_ERROR, message, now, changed)

    def stop_followers(self) -> None:
        """Multi-host leader: ends every follower's run (between steps)."""
        with self._step_lock:
            self.sync.stop_followers()

    # --- death ------------------------------------------------------------------------
    def kill(self, reason: str) -> EngineDeadError:
        """Marks the engine dead (for its owner when its own loop broke). Returns the error."""
        with self._step_lock:
            return self._die(EngineDeadError(reason))

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise self.dead

    def _die(self, cause: BaseException) -> EngineDeadError:
        """Marks the engine dead (once) and drops every request; multi-host, tells the
        other processes. Returns the error every waiter and later call gets."""
        if self.dead is None:
            reason = (cause.reason if isinstance(cause, EngineDeadError)
                      else f"{type(cause).__name__}: {cause}")
            if self.sync is not None:  # the reason every process reports
                reason = self.sync.fail(reason)
            with self._lock:
                self.dead = EngineDeadError(reason)
                self._inbox.clear()
                self._pending.clear()
                self._unfinished.clear()
            self.core.drop_all()
        return self.dead

    # --- monitoring and checks ---------------------------------------------------------
    def stats(self) -> dict[str, int | float]:
        """A consistent snapshot for monitoring (any thread): requests waiting (queued in the
        inbox or the scheduler), running, unfinished; KV blocks in use and in all; steps;
        with a host tier (`kv_offloading_size`) its blocks, hits, bytes moved each way and
        summed load latency (`EngineCore.stats`)."""
        stats = self.core.stats()
        with self._lock:
            queued = sum(1 for item in self._inbox if isinstance(item, (NewRequest, NewGroup)))
            unfinished = len(self._unfinished)
        return {**stats, "waiting": stats["waiting"] + queued, "unfinished": unfinished}

    def check_trace(self) -> int:
        """Self-check: every request released so far had exactly as many tokens as the
        trace sampled for it, and every held request agrees so far. Returns the number of
        requests held. Raises AssertionError listing disagreements."""
        return self.core.check_trace()

    def blocks_in_use(self) -> int:
        """KV blocks held by running sequences."""
        return self.core.blocks_in_use()
