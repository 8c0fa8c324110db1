"""Multi-host serving: one process per host, process 0 admits, every process plans.

1. `initialize(coordinator_address, num_processes, process_id)` starts `jax.distributed`
   from its arguments or the usual environment variables (JAX_COORDINATOR_ADDRESS,
   JAX_NUM_PROCESSES, JAX_PROCESS_ID, or a cluster jax detects: SLURM, ...). On CPU it
   selects gloo collectives first (a process-wide setting: call it once, at start-up).
2. The scheduler is pure and deterministic, so every process keeps its own copy of the
   scheduler state. Each step, process 0 (the leader: it owns admission, `add_request` and
   `abort`) publishes its drained inbox, encoded, under key `arcjax/inbox/<step>` of the
   coordinator's key-value store; the followers wait on that key and apply exactly the
   same adds and aborts in the same order (`StepSync.exchange_inbox`).
3. After `schedule`, every process publishes a 16-byte digest of its plan (rows, chunk
   starts and lengths, block tables, token ids, sampling inputs) under
   `arcjax/plan/<step>/<process>` and reads everyone else's before the device call
   (`StepSync.check_plan`): a divergence raises `PlanDivergenceError` on every process
   instead of silently corrupting output; the collective device step never runs on
   different plans.
4. Followers run `follow(engine)` (steps until the leader calls `stop_followers(engine)`);
   the leader steps as a single-host engine does (LLM, AsyncLLM, the server), and only it
   may receive requests.

Failures reach every process (`StepSync.fail` / `check`): a process whose engine dies
publishes the reason under `arcjax/failed` (unless another did first: then it adopts that
one); every wait of every process (the next inbox,
the plan digests, the step's tokens: `wait_until`) looks at that key between short slices
and raises `EngineDeadError` with the same reason. A process that exits is noticed by its
heartbeat (`arcjax/alive/<process>`, bumped every `heartbeat_s` by a thread): one whose
heartbeat stood still for `liveness_timeout_s` (once it had started) is declared lost, and
that becomes the published reason. A lost coordinator (process 0's key-value service)
fails every call to it: also a lost process. Either way every process stops within about
`liveness_timeout_s`, not a timeout per step.

NOTE: when process 0 dies, its coordinator dies with it, and jax's distributed client
(jax 0.10) terminates every other process itself (SIGABRT, "JAX distributed service
detected fatal errors") as soon as its error poll fails, usually before a wait here can
raise `EngineDeadError`: the client's `missed_heartbeat_callback`, which would hand that
failure to arcjax, cannot be set from Python (its `absl::Status` argument has no Python
conversion: std::bad_cast). Such a process still stops at once; its supervisor sees the
exit instead of the error.

NOTE: the transport is the coordinator's key-value store (host-side, no device collective,
so an idle leader costs nothing and a follower waits in slices it can loop on); the
payload is a pickle of plain tuples and `SamplingParams` between processes of one
deployment (they trust each other). Keys are deleted two steps later. Of processes failing
at the same moment, the first to bump the `arcjax/failures` counter publishes its reason.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import time

import jax

from arcjax.errors import EngineDeadError


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

    def try_get(self, key: str) -> bytes | None:
        with self._cond:
            return self._data.get(key)

    def increment(self, key: str) -> int:
        with self._cond:
            value = int(self._data.get(key, b"0")) + 1
            self._data[key] = str(value).encode()
            return value

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
        self._client.key_value_set_bytes(key, value, allow_overwrite=True)  # (heartbeats)

    def get(self, key: str, timeout_s: float) -> bytes:
        try:
            return self._client.blocking_key_value_get_bytes(key, int(timeout_s * 1000))
        except Exception as e:  # the client raises a generic error on deadline
            if "DEADLINE" in str(e).upper() or "TIMEOUT" in str(e).upper():
                raise TimeoutError(key) from e
            raise

    def try_get(self, key: str) -> bytes | None:
        try:
            return self._client.key_value_try_get_bytes(key)
        except Exception as e:  # the client raises a generic error for a missing key
            if "NOT_FOUND" in str(e).upper() or "NOT FOUND" in str(e).upper():
                return None
            raise

    def increment(self, key: str) -> int:
        return self._client.key_value_increment(key, 1)

    def delete(self, key: str) -> None:
        self._client.key_value_delete(key)


class StepSync:
    """Per-step inbox broadcast from the leader, plan-digest check, and the failure
    protocol (see the module doc).

    Attributes:
      process_id, num_processes: this process and how many take part.
      timeout_s: how long a process waits for another's digest before failing.
      idle_poll_s: the slice a wait sleeps between looks at the failure key.
      heartbeat_s: how often this process bumps its heartbeat (once `start_heartbeat`).
      liveness_timeout_s: a process whose heartbeat stood still this long is lost (None:
        heartbeats are not watched).
    """

    def __init__(self, transport, process_id: int, num_processes: int, *,
                 timeout_s: float = 120.0, idle_poll_s: float = 0.05, heartbeat_s: float = 0.5,
                 liveness_timeout_s: float | None = None, prefix: str = "arcjax"):
        self.transport, self.process_id, self.num_processes = transport, process_id, num_processes
        self.timeout_s, self.idle_poll_s, self.prefix = timeout_s, idle_poll_s, prefix
        self.heartbeat_s, self.liveness_timeout_s = heartbeat_s, liveness_timeout_s
        self.step = 0  # steps exchanged so far
        self.stopped = False
        self.failure: str | None = None  # the published reason, once any process failed
        self._beats: dict[int, tuple[bytes | None, float]] = {}  # last value, when it changed
        self._next_look = 0.0
        self._beating = threading.Event()

    @classmethod
    def create(cls, liveness_timeout_s: float = 10.0, **kwargs) -> "StepSync":
        """Over the jax.distributed coordinator, for this process, heartbeat started."""
        sync = cls(CoordinatorTransport(), jax.process_index(), jax.process_count(),
                   liveness_timeout_s=liveness_timeout_s, **kwargs)
        sync.start_heartbeat()
        return sync

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    def _key(self, *parts) -> str:
        return "/".join([self.prefix, *map(str, parts)])

    # --- failures ----------------------------------------------------------------------
    def start_heartbeat(self) -> None:
        """Starts a daemon thread bumping this process's heartbeat every `heartbeat_s`
        (until the run stops or fails)."""
        def beat():
            n = 0
            while not self._beating.wait(self.heartbeat_s):
                n += 1
                try:
                    self.transport.set(self._key("alive", self.process_id), str(n).encode())
                except Exception:  # noqa: BLE001  the coordinator is gone: waits notice it
                    return

        self.transport.set(self._key("alive", self.process_id), b"0")
        threading.Thread(target=beat, name="arcjax-heartbeat", daemon=True).start()

    def fail(self, reason: str) -> str:
        """Publishes this process's failure, unless another process failed first, and
        returns the reason every process reports: the first failure's (an atomic counter
        decides which is first)."""
        if self.failure is None:
            try:
                if self.transport.increment(self._key("failures")) == 1:
                    self.transport.set(self._key("failed"), reason.encode())
                    self.failure = reason
                else:  # the first one publishes right after its increment
                    self.failure = self.transport.get(self._key("failed"), 5.0).decode()
            except Exception:  # noqa: BLE001  the coordinator is gone: nobody to tell
                self.failure = reason
        self._beating.set()
        return self.failure

    def check(self) -> None:
        """Raises EngineDeadError if any process failed (published, or lost: its heartbeat
        stood still for `liveness_timeout_s`, or the coordinator stopped answering)."""
        if self.failure is not None:
            raise EngineDeadError(self.failure)
        try:
            published = self.transport.try_get(self._key("failed"))
            lost = None if published is not None else self._lost_process()
        except Exception as e:  # noqa: BLE001
            published, lost = None, f"the coordinator (process 0) stopped answering ({e!r})"
        if published is not None:
            self.failure = published.decode()
            self._beating.set()
            raise EngineDeadError(self.failure)
        if lost is not None:
            raise EngineDeadError(self.fail(lost))

    def _lost_process(self) -> str | None:
        now = time.monotonic()
        if self.liveness_timeout_s is None or now < self._next_look:
            return None
        self._next_look = now + self.heartbeat_s
        for p in range(self.num_processes):
            if p == self.process_id:
                continue
            value = self.transport.try_get(self._key("alive", p))
            old, since = self._beats.get(p, (None, now))
            if value is None:  # not started yet (it may still be loading): no verdict
                continue
            if value != old:
                self._beats[p] = (value, now)
            elif now - since > self.liveness_timeout_s:
                return (f"process {p} stopped answering (no heartbeat for "
                        f"{self.liveness_timeout_s:g} s)")
        return None

    def wait_until(self, ready) -> None:
        """Waits until `ready()` is true (polled at least every millisecond), looking for
        failures every `idle_poll_s`."""
        delay, look = 0.0001, time.monotonic() + self.idle_poll_s
        while not ready():
            if time.monotonic() >= look:
                self.check()
                look = time.monotonic() + self.idle_poll_s
            time.sleep(delay)
            delay = min(2 * delay, 0.001)

    def _get(self, key: str, timeout_s: float | None = None) -> bytes:
        """Waits for `key` in slices, checking for failures; TimeoutError after timeout_s."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            self.check()
            left = self.idle_poll_s if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(key)
            try:
                return self.transport.get(key, min(left, self.idle_poll_s))
            except TimeoutError:
                continue
            except Exception as e:  # noqa: BLE001  the coordinator is gone
                raise EngineDeadError(self.fail(
                    f"the coordinator (process 0) stopped answering ({e!r})")) from e

    # --- the step ----------------------------------------------------------------------
    def exchange_inbox(self, items: list) -> list:
        """Leader: publishes `items` (wire tuples) and returns them. Follower: ignores its
        own (empty) `items` and returns the leader's for this step; raises FollowerStop
        when the leader has stopped the run."""
        key = self._key("inbox", self.step)
        if self.is_leader:
            self.check()
            self.transport.set(key, pickle.dumps(("step", items)))
            return items
        if items:
            raise RuntimeError("a follower process received requests; only process 0 admits")
        kind, payload = pickle.loads(self._get(key))
        if kind == "stop":
            self.stopped = True
            self._beating.set()
            raise FollowerStop()
        return payload

    def stop_followers(self) -> None:
        """Leader: tells every follower (waiting for the next inbox) to return."""
        self.transport.set(self._key("inbox", self.step), pickle.dumps(("stop", None)))
        self.stopped = True
        self._beating.set()

    def check_plan(self, digest: bytes) -> None:
        """Publishes this process's plan digest and compares everyone's (then the step's
        keys of two steps ago are dropped). Raises PlanDivergenceError on a mismatch or
        when a process does not answer within `timeout_s`, EngineDeadError when a process
        failed."""
        n = self.step
        self.transport.set(self._key("plan", n, self.process_id), digest)
        for p in range(self.num_processes):
            if p == self.process_id:
                continue
            try:
                theirs = self._get(self._key("plan", n, p), self.timeout_s)
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
            self.transport.delete(self._key("plan", n - 1, self.process_id))
            if self.is_leader:
                self.transport.delete(self._key("inbox", n - 1))
        self.step += 1


def plan_digest(plan, sampling_rows=()) -> bytes:
    """A 16-byte digest of everything a step computes from: rows, chunks, block tables,
    token ids, the blocks the host tier moves, and each row's sampling inputs."""
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((plan.request_ids, plan.starts, plan.lengths, plan.samples,
                   tuple(tuple(t) for t in plan.block_tables), plan.preempted,
                   plan.token_ids if plan.num_seqs else (), plan.kv_stores,
                   plan.kv_loads)).encode())
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


def stop_followers(engine) -> None:
    """Leader: ends every follower's `follow` (call between steps)."""
    engine.stop_followers()
