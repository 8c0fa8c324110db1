"""Multi-host serving: one process per host, process 0 admits, every process plans.

1. `initialize(coordinator_address, num_processes, process_id)` starts `jax.distributed`
   from its arguments or the usual environment variables (JAX_COORDINATOR_ADDRESS,
   JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster jax detects: SLURM, ...). On CPU it
   selects gloo collectives first (a process-wide setting: call it once, at start-up).
2. The scheduler is pure and deterministic, so every process keeps its own copy of the
   scheduler state. Each step, process 0 (the leader: it owns admission, `add_request` and
   `abort`) publishes its drained inbox, encoded, under key `arcjax/inbox/<step>` of the
   coordinator's key-value store; the followers block on that key and apply exactly the
   same adds and aborts in the same order (`StepSync.exchange_inbox`).
3. After `schedule`, every process publishes a 16-byte digest of its plan (rows, chunk
   starts and lengths, block tables, token ids, sampling inputs) under
   `arcjax/plan/<step>/<process>` and reads everyone else's before the device call
   (`StepSync.check_plan`): a divergence raises `PlanDivergenceError` on every process
   instead of silently corrupting output; the collective device step never runs on
   different plans.
4. Followers run `follow(engine)` or `run_follower(model, **options)` (steps until the
   leader calls `stop_followers(engine)`); the leader steps as a single-host engine does
   (LLM, AsyncLLM, the server), and only it may receive requests.

NOTE: the transport is the coordinator's key-value store (host-side, no device collective,
so an idle leader costs nothing and a follower waits with a timeout it can loop on); the
payload is a pickle of plain tuples and `SamplingParams` between processes of one
deployment (they trust each other). Keys are deleted two steps later.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time

import jax


class PlanDivergenceError(RuntimeError):
    """Processes planned different steps (or one stopped answering)."""


class FollowerStop(Exception):
    """The leader ended the run (raised inside a follower's step, caught by `follow`)."""


def initialize(coordinator_address: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, **kwargs) -> None:
    """Joins this process to a multi-process JAX run (no-op if already joined).

    Arguments left None come from JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
    JAX_PROCESS_ID or from a cluster environment jax detects. On the CPU backend, gloo
    collectives are selected (cross-process collectives need them).
    """
    from jax._src import distributed

    if distributed.global_state.client is not None:
        return
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    if "cpu" in env.get("JAX_PLATFORMS", "cpu").split(","):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id, **kwargs)


class LocalTransport:
    """An in-memory key-value store shared by threads (tests: several engines, one process)."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._cond = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._cond:
            self._data[key] = value
            self._cond.notify_all()

    def get(self, key: str, timeout_s: float) -> bytes:
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._data, timeout_s):
                raise TimeoutError(key)
            return self._data[key]

    def delete(self, key: str) -> None:
        with self._cond:
            self._data.pop(key, None)

    def __len__(self) -> int:
        return len(self._data)


class CoordinatorTransport:
    """The `jax.distributed` coordinator's key-value store."""

    def __init__(self, client=None):
        if client is None:
            from jax._src import distributed

            client = distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized (arcjax.parallel.initialize)")
        self._client = client

    def set(self, key: str, value: bytes) -> None:
        self._client.key_value_set_bytes(key, value)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        except Exception as e:  # the client raises a generic error on deadline
            if "DEADLINE" in str(e).upper() or "TIMEOUT" in str(e).upper():
                raise TimeoutError(key) from e
            raise

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)


class StepSync:
    """Per-step inbox broadcast from the leader and plan-digest check (see module doc).

    Attributes:
      process_id, num_processes: this process and how many take part.
      timeout_s: how long a process waits for another's digest before failing.
      idle_poll_s: how long a follower waits for the next inbox before polling again.
    """

    def __init__(self, transport, process_id: int, num_processes: int, *,
                 timeout_s: float = 120.0, idle_poll_s: float = 1.0, prefix: str = "arcjax"):
        self.transport, self.process_id, self.num_processes = transport, process_id, num_processes
        self.timeout_s, self.idle_poll_s, self.prefix = timeout_s, idle_poll_s, prefix
        self.step = 0  # steps exchanged so far
        self.stopped = False

    @classmethod
    def create(cls, **kwargs) -> "StepSync":
        """Over the jax.distributed coordinator, for this process."""
        return cls(CoordinatorTransport(), jax.process_index(), jax.process_count(), **kwargs)

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def _inbox_key(self, n: int) -> str:
        return f"{self.prefix}/inbox/{n}"

    def _plan_key(self, n: int, p: int) -> str:
        return f"{self.prefix}/plan/{n}/{p}"

    def exchange_inbox(self, items: list) -> list:
        """Leader: publishes `items` (wire tuples) and returns them. Follower: ignores its
        own (empty) `items` and returns the leader's for this step; raises FollowerStop
        when the leader has stopped the run."""
        key = self._inbox_key(self.step)
        if self.is_leader:
            self.transport.set(key, pickle.dumps(("step", items)))
            return items
        if items:
            raise RuntimeError("a follower process received requests; only process 0 admits")
        while True:
            try:
                kind, payload = pickle.loads(self.transport.get(key, self.idle_poll_s))
                break
            except TimeoutError:
                continue
        if kind == "stop":
            self.stopped = True
            raise FollowerStop()
        return payload

    def stop_followers(self) -> None:
        """Leader: tells every follower (waiting for the next inbox) to return."""
        self.transport.set(self._inbox_key(self.step), pickle.dumps(("stop", None)))
        self.stopped = True

    def check_plan(self, digest: bytes) -> None:
        """Publishes this process's plan digest and compares everyone's (then the step's
        keys of two steps ago are dropped). Raises PlanDivergenceError on a mismatch or
        when a process does not answer within `timeout_s`."""
        n = self.step
        self.transport.set(self._plan_key(n, self.process_id), digest)
        for p in range(self.num_processes):
            if p == self.process_id:
                continue
            try:
                theirs = self.transport.get(self._plan_key(n, p), self.timeout_s)
            except TimeoutError:
                raise PlanDivergenceError(f"step {n}: process {p} sent no plan digest within "
                                          f"{self.timeout_s:.0f} s") from None
            if theirs != digest:
                raise PlanDivergenceError(
                    f"step {n}: process {self.process_id} planned {digest.hex()}, process {p} "
                    f"planned {theirs.hex()}; processes diverged (different requests, "
                    "configs or scheduler versions)")
        # Everyone has read step n's inbox and step n-1's digests: drop what is ours.
        if n >= 1:
            self.transport.delete(self._plan_key(n - 1, self.process_id))
            if self.is_leader:
                self.transport.delete(self._inbox_key(n - 1))
        self.step += 1


def plan_digest(plan, sampling_rows=()) -> bytes:
    """A 16-byte digest of everything a step computes from: rows, chunks, block tables,
    token ids and each row's sampling inputs."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((plan.request_ids, plan.starts, plan.lengths, plan.samples,
                   tuple(tuple(t) for t in plan.block_tables), plan.preempted,
                   plan.token_ids if plan.num_seqs else ())).encode())
    h.update(repr(tuple(sampling_rows)).encode())
    return h.digest()


def follow(engine, *, poll: float = 0.0) -> int:
    """A follower's loop: steps in lockstep with the leader until it stops the run.
    Outputs are dropped (the leader serves them). Returns the steps taken."""
    steps = 0
    while True:
        try:
            engine.step()
        except FollowerStop:
            return steps
        steps += 1
        if poll:
            time.sleep(poll)


def run_follower(model=None, **options) -> int:
    """A follower process's whole run: the engine the leader builds (same model, same
    options), stepped in lockstep until the leader stops it. Returns the steps taken."""
    from arcjax.engine.build import build_engine
    from arcjax.engine.config import EngineConfig

    return follow(build_engine(EngineConfig.from_options(model, **options)))


def stop_followers(engine) -> None:
    """Leader: ends every follower's `follow` (call between steps)."""
    with engine._step_lock:
        engine.sync.stop_followers()
