"""Where one request's arithmetic first differs between two runs: record the steps that
computed its rows, replay each op by op, compare the taps.

1. `StepRecorder(runner, request_id)` wraps a runner's `prepare`, `launch` and
   `launch_forward` (the instance's attributes: nothing in the runner's code changes).
   Every step holding a row of the request is kept as a `RecordedStep`: the bucket, the
   batch as the executable received it (fed ids resolved), the KV cache before the step,
   and where the request's rows and sampled positions are.
2. `Replay().step_taps(runner, step)` traces the step's forward (`decoder.forward_with_stats`, with the
   statics its executable was compiled with: `ModelRunner.step_statics`) to a jaxpr and
   evaluates it one equation at a time, unrolling the scan over layers. Every floating
   value whose leading axis is the bucket's token rows (before and inside the layer scan)
   or its sampled rows (after it: the head) is cut to the request's rows, and each row is
   digested under its absolute position and a `TapKey` (layer, named scope, primitive,
   occurrence): the step's `Taps`.
3. `Replay.probe_taps(runner, steps)` merges the taps of every recorded step, a position's last
   computation winning (a rejected draft's position is computed again, and a preempted
   sequence's prompt too: the last write is what later tokens read), and
   `first_difference(a, b)` walks the positions in order and, at the first one with a
   differing tap, names the first differing key in program order.

NOTE: the replay runs each equation as its own XLA computation (a while loop, the
attention kernel's tile walk, as one), not fused as the compiled step runs it. It shows
where the arithmetic of two runs parts when the replay reproduces their difference; the
values themselves may differ from the compiled step's in the last bits. Nothing here is
imported by the engine: the recorder patches one runner instance, on request.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

from arcjax.model import decoder
from arcjax.runtime.buckets import Bucket


@dataclasses.dataclass(frozen=True)
class RecordedStep:
    """One step that computed rows of the recorded request.

    Attributes:
      bucket: the step's bucket.
      batch: the `decoder.StepBatch` the executable received (host arrays; fed ids resolved).
      cache: the KV cache before the step (device copies).
      token_rows: the request's token rows [n] int32 in the flat batch.
      sample_rows: the step's sampled rows [m] int32 holding the request's logits (each a
        distinct position).
    """

    bucket: Bucket
    batch: decoder.StepBatch
    cache: dict
    token_rows: np.ndarray
    sample_rows: np.ndarray


@dataclasses.dataclass(frozen=True, order=True)
class TapKey:
    """Names one value of the replay: layer (-1 before the layer scan, `HEAD` after it),
    the named scope ("qkv", "attention", "o_proj", "mlp", or ""), the primitive (a nested
    jit by its name), and how many such (scope, primitive) values the layer made before."""

    layer: int
    scope: str
    primitive: str
    occurrence: int

    def describe(self, num_layers: int) -> str:
        where = ("embedding" if self.layer < 0 else "head" if self.layer >= num_layers
                 else f"layer {self.layer}")
        scope = f" · {self.scope}" if self.scope else ""
        return f"{where}{scope} · {self.primitive}#{self.occurrence}"


HEAD = 1 << 30  # TapKey.layer of the values after the layer scan


class Taps:
    """Digests of one request's rows: position -> {TapKey: digest}, keys in program order."""

    def __init__(self):
        self.by_position: dict[int, dict[TapKey, bytes]] = {}

    def merge(self, other: "Taps") -> None:
        """`other`'s positions replace these: a later computation of a position wins (a
        sampled row is always a token row of its own step, so nothing of it is lost)."""
        self.by_position.update(other.by_position)


class StepRecorder:
    """Records every step that computes a row of `request_id` (see the module docstring).
    `close()` restores the runner's methods."""

    def __init__(self, runner, request_id: str):
        self.runner, self.request_id = runner, request_id
        self.steps: list[RecordedStep] = []
        self._pending: dict[int, tuple[int, int]] = {}  # id(PreparedStep) -> plan row, width
        self._saved = {name: getattr(runner, name)
                       for name in ("prepare", "launch", "launch_forward")}
        runner.prepare = self._prepare
        runner.launch = self._launcher(self._saved["launch"])
        runner.launch_forward = self._launcher(self._saved["launch_forward"])

    def close(self) -> None:
        for name in self._saved:
            delattr(self.runner, name)  # the class's methods show through again

    def _prepare(self, plan, *args, **kwargs):
        step = self._saved["prepare"](plan, *args, **kwargs)
        ids = list(plan.request_ids)
        if self.request_id in ids:
            self._pending[id(step)] = (ids.index(self.request_id), step.bucket.sample_width)
        return step

    def _launcher(self, launch):
        def wrapped(step, *, feed=None, **kwargs):
            found = self._pending.pop(id(step), None)
            if found is not None:
                self._record(step, feed, *found)
            return launch(step, feed=feed, **kwargs)
        return wrapped

    def _record(self, step, feed, row: int, width: int) -> None:
        batch = self.runner._device_batch(step, feed)[0]  # (batch, prompt, pooling)
        batch = jax.tree.map(np.asarray, batch)
        cache = jax.tree.map(jnp.copy, self.runner.cache)
        cu = batch.cu_seqlens_q
        token_rows = np.arange(cu[row], cu[row + 1], dtype=np.int32)
        self.steps.append(RecordedStep(step.bucket, batch, cache, token_rows,
                                       _sample_rows(batch, token_rows, row, width)))


def _sample_rows(batch, token_rows: np.ndarray, row: int, width: int) -> np.ndarray:
    """The sampled rows r of plan row `row` (r = row * width + j) whose logits row is one of
    its token rows, one per position (a padding position repeats row 0: the first wins)."""
    seen, out = set(), []
    for r in range(row * width, row * width + width):
        t = int(batch.logits_rows[r])
        if t in token_rows and t not in seen:
            seen.add(t)
            out.append(r)
    return np.asarray(out, np.int32)


def _digest(row: np.ndarray) -> bytes:
    return hashlib.blake2b(np.ascontiguousarray(row).tobytes(), digest_size=12).digest()


class _Replayer:
    """Evaluates a step's jaxpr equation by equation, tapping the request's rows."""

    def __init__(self, step: RecordedStep, num_layers: int):
        self.step, self.num_layers = step, num_layers
        self.taps = Taps()
        self.counts: dict[tuple[int, str, str], int] = {}
        positions = step.batch.positions
        self.token_pos = [int(positions[t]) for t in step.token_rows]
        self.sample_pos = [int(positions[step.batch.logits_rows[r]]) for r in step.sample_rows]

    def tap(self, layer: int, scope: str, primitive: str, value) -> None:
        shape, dtype = getattr(value, "shape", ()), getattr(value, "dtype", None)
        if not shape or dtype is None or not jnp.issubdtype(dtype, jnp.floating):
            return
        head = layer >= self.num_layers
        rows = self.step.sample_rows if head else self.step.token_rows
        lead = (len(self.step.batch.logits_rows) if head else self.step.bucket.tokens)
        if shape[0] != lead or not len(rows):
            return
        n = self.counts.get((layer, scope, primitive), 0)
        self.counts[(layer, scope, primitive)] = n + 1
        key = TapKey(layer, scope, primitive, n)
        host = np.asarray(value)[rows]
        for pos, row in zip(self.sample_pos if head else self.token_pos, host):
            self.taps.by_position.setdefault(pos, {})[key] = _digest(row)

    def eval(self, jaxpr, consts, args, layer: int):
        env = {}

        def read(v):
            return v.val if isinstance(v, jex.core.Literal) else env[v]

        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            name = eqn.primitive.name
            if name == "scan" and eqn.params["length"] == self.num_layers and layer < 0:
                outs = self._layers(eqn, invals)
                layer = HEAD
            else:
                outs = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(eqn.params))
                if not eqn.primitive.multiple_results:
                    outs = [outs]
                label = eqn.params.get("name", name) if name in ("pjit", "jit") else name
                scope = str(eqn.source_info.name_stack)
                for out in outs:
                    self.tap(layer, scope, label, out)
            for v, x in zip(eqn.outvars, outs):
                env[v] = x
        return [read(v) for v in jaxpr.outvars]

    def _layers(self, eqn, invals):
        """The layer scan, one layer at a time (forward order)."""
        p = eqn.params
        body, n_consts, n_carry = p["jaxpr"], p["num_consts"], p["num_carry"]
        consts, carry = invals[:n_consts], invals[n_consts:n_consts + n_carry]
        xs = invals[n_consts + n_carry:]
        ys = []
        for i in range(p["length"]):
            outs = self.eval(body.jaxpr, body.consts, consts + carry + [x[i] for x in xs], i)
            carry, y = outs[:n_carry], outs[n_carry:]
            ys.append(y)
        stacked = [jnp.stack([y[j] for y in ys]) for j in range(len(ys[0]))] if ys else []
        return list(carry) + stacked


class Replay:
    """Replays recorded steps (see the module docstring). One traced forward per (statics,
    input shapes), reused: an eagerly bound loop or nested jit is compiled once per jaxpr
    object, so a step of a bucket seen before compiles nothing."""

    def __init__(self):
        self._traced: dict[tuple, object] = {}

    def step_taps(self, runner, step: RecordedStep) -> Taps:
        """The taps of one recorded step."""
        statics = runner.step_statics(step.bucket)
        batch = jax.tree.map(jnp.asarray, step.batch)
        args = (runner.params, step.cache, batch)
        avals = tuple((x.shape, str(x.dtype)) for x in jax.tree.leaves(args))
        key = (tuple(sorted(statics.items())),
               jax.tree.structure(args), avals)
        closed = self._traced.get(key)
        if closed is None:
            def forward(params, cache, batch):
                return decoder.forward_with_stats(params, cache, batch, **statics)[0]

            closed = self._traced[key] = jax.make_jaxpr(forward)(*args)
        replayer = _Replayer(step, runner.cfg.num_layers)
        replayer.eval(closed.jaxpr, closed.consts, jax.tree.leaves(args), -1)
        return replayer.taps

    def probe_taps(self, runner, steps: Sequence[RecordedStep]) -> Taps:
        """The merged taps of a request's recorded steps, in the order they ran."""
        taps = Taps()
        for step in steps:
            taps.merge(self.step_taps(runner, step))
        return taps


@dataclasses.dataclass(frozen=True)
class Difference:
    """The first place two runs' taps differ: the position and the first key there."""

    position: int
    key: TapKey


def first_difference(base: Taps, other: Taps) -> Difference | None:
    """The first (position, key) whose digest differs between the two runs, positions in
    increasing order and keys in `other`'s program order; keys one run lacks are skipped.
    None when every common key agrees."""
    for pos in sorted(set(base.by_position) & set(other.by_position)):
        a, b = base.by_position[pos], other.by_position[pos]
        for key in b:  # insertion order: program order of the replay
            if key in a and a[key] != b[key]:
                return Difference(pos, key)
    return None
