"""Jitted model steps, one compiled executable per bucket (the traced programs are
`step_program.py`).

1. `prepare(plan, sampling_rows)` packs the plan into a `PreparedStep` (`batching.py`): its
   bucket (`buckets.py`), the host arrays of the ragged batch, the per-row sampling inputs
   (and, when asked, the prompt-logprobs targets and the drafts to verify).
2. `run(step)` calls the bucket's executable: forward over the ragged batch, KV written
   through `slot_mapping` into the donated cache, logits only at each sequence's last
   row, sampling on device (penalties from the device-resident count table,
   `penalties.py`). Returns a `StepOutput`: token ids [S] and raw log-probabilities
   (plus, for steps with prompt_logprobs rows, at every row), and for a mixture of
   experts the tokens each expert received per layer.
   A step with draft tokens samples W positions per sequence and verifies the drafts
   (`runtime/verification.py`): token ids [S * W] and how many each sequence yields [S].
   `run` is `collect(launch(step))`. Overlapped scheduling calls them apart: `launch`
   dispatches the step and returns a `StepHandle` (`step_handle.py`) at once (JAX dispatch
   is asynchronous) and starts the tokens' copy to the host; the next step's
   `launch(step, feed=TokenFeed(handle, ...))` takes the tokens this one samples straight
   from the device into its input ids (`step_program.feed`: no host round trip on the
   critical path);
   `collect(handle)` waits for the tokens on the host. A step whose bitmask is not known
   at launch runs in two parts: `launch_forward(step)` (the handle holds a
   `ForwardResult`), then `launch_sampling(handle, step, bitmask)`.
3. Executables are compiled ahead of time (`jit(...).lower(...).compile()`), so the
   runner knows exactly when a step needs one (`num_executables`, the trace's
   `compiled` flag) and `warmup()` prepares every bucket.

NOTE: executables live in an `ExecutableCache` (`executable_cache.py`) keyed by
everything that changes the compiled program. A runner's `num_executables` counts the
buckets it acquired, compiled or found, so it depends on that runner's own history only.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.lora.slot_table import SlotTable, token_slots
from arcjax.model import decoder
from arcjax.model.kv_layout import KVLayout, kv_layout
from arcjax.model.layer_arrays import bucket_layer_loop, unrolled_max_tokens
from arcjax.model.model_config import ModelConfig
from arcjax.model.specs import make_cache
from arcjax.runtime.batching import PreparedStep, prepare_step, warmup_step
from arcjax.runtime.buckets import Bucket, BucketSet
from arcjax.runtime.executable_cache import ExecutableCache, input_signature
from arcjax.runtime.kv_tiers import HostKVPool
from arcjax.runtime.penalties import TokenCounts
from arcjax.runtime.sampling import bitmask_words
from arcjax.runtime.step_handle import CompletionWatcher, ForwardResult, StepHandle, TokenFeed
from arcjax.runtime import step_program
from arcjax.runtime.step_output import StepOutput

log = logging.getLogger(__name__)

class ModelRunner:
    """Owns params and the paged KV cache; runs one bucket-shaped step at a time."""

    def __init__(self, cfg: ModelConfig, params, *, num_blocks: int, block_size: int,
                 max_blocks_per_seq: int, buckets: BucketSet, dtype, attn_impl: str,
                 executables: ExecutableCache | None = None, parallel=None,
                 kv_cache_dtype=None, kv_scales=None, kv: KVLayout | None = None,
                 host_slots: int = 0, pooling: bool = False, lora: SlotTable | None = None,
                 lora_impl: str = "masked", matmul_impl: str = "xla",
                 batch_invariant: bool = False, layer_loop: str = "auto"):
        # parallel: an arcjax.parallel.TensorParallel (params already in its shardings,
        # cfg its sharded_config); the cache is created in its shards, inputs replicated.
        # kv_cache_dtype: the pages' dtype (None: dtype); float8_e4m3fn pages carry a K and
        # a V scale per layer: kv_scales [2, L] (from the checkpoint), else 1.0.
        # kv: the layers' KV cache groups and slots (None: one table for every layer);
        # host_slots: blocks of the host tier (0: none; kv_tiers.py).
        # pooling: steps may carry pooling rows (runner="pooling"): `warmup` prepares each
        # bucket's pooling executable too.
        # lora: the LoRA adapters' device slots (every step then takes `LoRAWeights`; the
        # engine fills the slots, `prepare` packs each row's slot), lora_impl their delta's
        # implementation (`arcjax.model.lora_delta.IMPLS`, resolved); None: no adapters.
        # matmul_impl: how packed weights multiply (`arcjax.model.packed_matmul.IMPLS`,
        # resolved: the W4A16 kernel in decode-sized matmuls, or XLA).
        # batch_invariant: each row computed alike whatever else its step holds (fixed row
        # tiles, the xla attention's fixed blocks; the engine checks what it excludes).
        # layer_loop: "scan" over the stacked layer weights, or "unrolled": the layers one
        # after the other over weights held per layer (arcjax/model/layer_arrays.py);
        # "auto": unrolled in the CPU's small buckets (`unrolled_max_tokens`).
        self.cfg, self.params, self.parallel = cfg, params, parallel
        self.batch_invariant = batch_invariant
        self.kv = kv if kv is not None else kv_layout(cfg, hybrid=False)
        self.lora, self.lora_impl, self.matmul_impl = lora, lora_impl, matmul_impl
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_blocks = max_blocks_per_seq
        self.buckets, self.dtype, self.attn_impl = buckets, jnp.dtype(dtype), attn_impl
        self.kv_cache_dtype = jnp.dtype(kv_cache_dtype or dtype)
        self.kv_scales = kv_scales
        self.pooling = pooling
        self.cache = self._new_cache()
        self.platform = next(iter(self.cache["k"].devices())).platform  # "cpu", "gpu", ...
        self.layer_loop = layer_loop
        # buckets of at most this many rows run the layers unrolled (0: none)
        self.unrolled_max_tokens = unrolled_max_tokens(
            layer_loop, platform=self.platform, meshed=parallel is not None,
            experts=cfg.is_moe)
        if self.unrolled_max_tokens:  # held one array per layer (every bucket reads them)
            from arcjax.model.binding import split_layer_params  # flax: where a model is built

            self.params = split_layer_params(cfg, params)
        k = self.cache["k"]
        self.host_pool = HostKVPool(
            host_slots, num_slots=self.kv.num_slots, num_blocks=num_blocks,
            page_shape=k.shape[1:], v_page_shape=self.cache["v"].shape[1:], dtype=k.dtype,
            cache_sharding=k.sharding,
        ) if host_slots else None
        self.executables = executables if executables is not None else ExecutableCache()
        # (bucket, variant, (prompt logprobs?, pooling?)) -> executable
        self._compiled: dict[tuple[Bucket, str, tuple[bool, bool]], object] = {}
        # (T, S, max_q_len) of each bucket acquired -> the attention implementation its
        # steps run, what they were compiled with ("auto" resolved; see `_attention_impl`
        # and `arcjax.engine.trace.attention_report`)
        self.attention_impls: dict[tuple[int, int, int], str] = {}
        # (T, S, max_q_len) of each bucket acquired -> its layer loop, "scan" or "unrolled"
        self.layer_loops: dict[tuple[int, int, int], str] = {}
        # ... and whether a recorded GPU pass vouches for it (None: nothing to verify)
        self.attention_verified: dict[tuple[int, int, int], bool | None] = {}
        self._noted: set[tuple[str, str | None]] = set()  # unverified (impl, class) logged
        self._all_allowed: dict[int, jax.Array] = {}  # rows -> all-ones bitmask (device)
        # penalties / min_tokens state: one slot per sequence a step can hold (penalties.py)
        self.counts = TokenCounts(buckets.seq_rungs[-1], cfg.vocab_size)
        self._watcher: CompletionWatcher | None = None

    @property
    def watch_completion(self) -> bool:
        """Whether each step's device completion time is recorded (`StepHandle.ready`)."""
        return self._watcher is not None

    @watch_completion.setter
    def watch_completion(self, on: bool) -> None:
        if on and self._watcher is None:
            self._watcher = CompletionWatcher()
        elif not on and self._watcher is not None:
            self._watcher.stop()
            self._watcher = None

    @property
    def num_executables(self) -> int:
        """Buckets this runner has acquired an executable for (compiled or found)."""
        return len({key[0] for key in self._compiled})

    def prepare(self, plan, sampling_rows: Sequence[tuple], prompt_rows=None,
                pooling_rows=None, row_slots: Sequence[int] | None = None) -> PreparedStep:
        """Packs one step plan into its bucket's host arrays (`batching.prepare_step`).

        Args:
          plan: a `scheduler.StepPlan` (its columns are read, never its chunk records).
          sampling_rows: (params, seed, tokens generated so far[, count-table slot]) per row.
          prompt_rows: None, or per row the prompt whose log-probabilities it wants (None
            for rows that do not): the step then computes logits at every token row and
            carries the `PromptTargets`.
          pooling_rows: None, or per row its `PoolingRow` (None for rows that do not pool):
            the step then computes hidden states at every token row and returns their
            pooled sums (`pooling_inputs.py`).

        A plan whose decode rows carry draft tokens runs in a bucket of sample width
        1 + num_speculative_tokens: its sampling inputs are per position and it carries
        the `verification.SpecInputs`. `row_slots`: with LoRA, each row's adapter slot
        (0: the base model), repeated over the row's tokens (`PreparedStep.lora_slots`).
        """
        step = prepare_step(plan, sampling_rows, prompt_rows, pooling_rows,
                            buckets=self.buckets,
                            max_blocks=self.max_blocks, block_size=self.block_size,
                            num_blocks=self.num_blocks, spare_slot=self.counts.spare,
                            num_groups=self.kv.num_groups)
        if row_slots is None:
            return step
        return dataclasses.replace(step, lora_slots=token_slots(row_slots, plan.lengths,
                                                                step.bucket.tokens))

    def store_blocks(self, plan) -> None:
        """The host tier's stores of `plan` (`StepPlan.kv_stores`): copied out of the cache
        before the step that may overwrite them is launched."""
        if plan.kv_stores:
            self.host_pool.store(self.cache, plan.kv_stores)

    def load_blocks(self, plan) -> None:
        """The host tier's loads of `plan` (`StepPlan.kv_loads`), dispatched after the step's
        launch: the device writes them after that step and before the next one."""
        if plan.kv_loads:
            self.cache = self.host_pool.load(self.cache, plan.kv_loads)

    def _executable(self, bucket: Bucket, variant: str, args: tuple, *,
                    every_row: tuple[bool, bool] = (False, False)):
        """The compiled `variant` ("step", "forward" or "sample") of `bucket` for `args`
        (its positional inputs; `every_row`: a step with prompt_logprobs rows, with
        pooling rows)."""
        fn = {"step": step_program.step, "forward": step_program.forward,
              "sample": step_program.sample}[variant]
        exe = self._compiled.get((bucket, variant, every_row))
        if exe is None:
            width = {} if variant == "forward" else {"sample_width": bucket.sample_width}
            if variant == "sample":  # depends on the position count and vocabulary only
                key = ("sample", bucket.sample_width, self.parallel, self.batch_invariant,
                       input_signature(args))
                lower = functools.partial(fn.lower, *args, **width,
                                          batch_invariant=self.batch_invariant)
            else:  # compiled with the implementation "auto" resolves to for this bucket
                statics = self.step_statics(bucket)
                key = (variant, *(statics[name] for name in step_program.STATIC_ARGS),
                       bucket.sample_width, input_signature(args))
                lower = functools.partial(fn.lower, *args, **statics, **width)
            exe = self.executables.get_or_compile(key, lambda: lower().compile())
            self._compiled[(bucket, variant, every_row)] = exe
        return exe

    def step_statics(self, bucket: Bucket) -> dict:
        """The static arguments `bucket`'s forward is compiled with
        (`step_program.STATIC_ARGS`): the model, the attention implementation ("auto"
        resolved), the dtype, the chunk bound, the mesh, the KV layout, the LoRA delta's and
        the packed matmuls' implementations, batch invariance, the layer loop
        (`layer_arrays.bucket_layer_loop`). A tool that traces a bucket's
        forward again (arcjax/bench/step_replay.py) reads them here."""
        loop = bucket_layer_loop(self.unrolled_max_tokens, bucket.tokens)
        self.layer_loops[(bucket.tokens, bucket.seqs, bucket.max_q_len)] = loop
        return dict(cfg=self.cfg, attn_impl=self._attention_impl(bucket), dtype=self.dtype,
                    max_q_len=bucket.max_q_len, parallel=self.parallel, kv=self.kv,
                    lora_impl=self.lora_impl, matmul_impl=self.matmul_impl,
                    batch_invariant=self.batch_invariant, layer_loop=loop)

    def _attention_impl(self, bucket: Bucket) -> str:
        """The attention implementation of `bucket`'s steps: `attn_impl`, "auto" resolved
        (once per bucket) for this bucket's shapes, cache and platform. A GPU kernel that
        no recorded GPU pass vouches for is logged (once per implementation and class)."""
        key = (bucket.tokens, bucket.seqs, bucket.max_q_len)
        impl = self.attention_impls.get(key)
        if impl is None:
            choice = decoder.attention_choice(
                self.cache, cfg=self.cfg, attn_impl=self.attn_impl, tokens=bucket.tokens,
                max_q_len=bucket.max_q_len, dtype=self.dtype, parallel=self.parallel,
                platform=self.platform, batch_invariant=self.batch_invariant)
            impl = choice.impl
            if choice.note is not None and (impl, choice.shape_class) not in self._noted:
                self._noted.add((impl, choice.shape_class))
                log.warning("%s", choice.note)
            self.attention_impls[key] = impl
            self.attention_verified[key] = choice.verified
        return impl

    def all_allowed(self, rows: int):
        """The bitmask of `rows` unconstrained positions, [rows, ceil(V / 32)] int32 all
        ones, kept on the device (a step without structured outputs transfers no mask)."""
        mask = self._all_allowed.get(rows)
        if mask is None:
            host = np.full((rows, bitmask_words(self.cfg.vocab_size)), -1, np.int32)
            mask = (self.parallel.put_replicated(host) if self.parallel is not None
                    else jax.device_put(host))
            self._all_allowed[rows] = mask
        return mask

    def _replicated(self, tree):
        """Host inputs as the executable takes them. One device: as they are (its C++ call
        path transfers them, ~10x cheaper than a device_put per array); a mesh: replicated
        (each process places its own copies)."""
        return tree if self.parallel is None else self.parallel.put_replicated(tree)

    def _device_bitmask(self, bucket: Bucket, bitmask: np.ndarray | None):
        """The bitmask input: all ones (kept on the device) when no position is constrained."""
        if bitmask is None:
            return self.all_allowed(bucket.num_samples)
        return self._replicated(bitmask)

    def _device_batch(self, step: PreparedStep, feed: TokenFeed | None):
        """The step's batch, prompt targets and pooling inputs on the device, placeholder
        ids fed from the step in flight."""
        batch, prompt, pooling = self._replicated((step.batch, step.prompt, step.pooling))
        if feed is not None:
            rows, positions = self._replicated((feed.rows, feed.positions))
            batch = dataclasses.replace(batch, token_ids=step_program.feed(
                batch.token_ids, feed.source.out.tokens, rows, positions))
        return batch, prompt, pooling

    def _lora(self, step: PreparedStep):
        """The step's `LoRAWeights` (None without adapters); a step packed without row
        slots (warm-up) runs every token on the base model (slot 0)."""
        if self.lora is None:
            return None
        slots = step.lora_slots
        return self.lora.step_weights(slots if slots is not None
                                      else np.zeros(step.bucket.tokens, np.int32))

    def run(self, step: PreparedStep, *, bitmask: np.ndarray | None = None) -> StepOutput:
        """Runs the step; returns its `StepOutput`: `tokens` [R] (and `num_yielded` [S] in a
        verification step) on the host (after the device is done), log-probabilities
        still on the device (read them only if asked)."""
        return self.collect(self.launch(step, bitmask=bitmask))

    def launch(self, step: PreparedStep, *, feed: TokenFeed | None = None,
               bitmask: np.ndarray | None = None) -> StepHandle:
        """Dispatches the step and returns without waiting for the device.

        Args:
          step: what `prepare` packed (a verification step carries the drafts to verify).
          feed: None, or the input ids this step takes from the previous step's sampled
            tokens on the device (the host's batch holds a placeholder there).
          bitmask: None (no position constrained), or [bucket.num_samples, ceil(V / 32)]
            int32: the tokens each sampled position may take (all ones for unconstrained
            rows).
        """
        batch, prompt, pooling = self._device_batch(step, feed)
        sampling, spec = self._replicated((step.sampling, step.spec))
        args = (self.params, self.cache, batch, sampling, self.counts.table,
                self._device_bitmask(step.bucket, bitmask), prompt, spec, pooling,
                self._lora(step))
        exe = self._executable(step.bucket, "step", args, every_row=step.every_row)
        dispatched = time.perf_counter()
        out, self.cache, self.counts.table = exe(*args)
        return self._launched(StepHandle(out, dispatched))

    def launch_forward(self, step: PreparedStep, *,
                       feed: TokenFeed | None = None) -> StepHandle:
        """Dispatches the step's forward only (its bitmask is not known yet: overlapped
        scheduling with structured outputs); `launch_sampling` completes it. Arguments as
        `launch`'s."""
        batch, prompt, pooling = self._device_batch(step, feed)
        args = (self.params, self.cache, batch, prompt, pooling, self._lora(step))
        exe = self._executable(step.bucket, "forward", args, every_row=step.every_row)
        dispatched = time.perf_counter()
        logits, prompt_lp, pooled, self.cache, experts = exe(*args)
        return StepHandle(None, dispatched, forward=ForwardResult(logits, prompt_lp, experts,
                                                                  pooled))

    def launch_sampling(self, handle: StepHandle, step: PreparedStep,
                        bitmask: np.ndarray | None = None) -> StepHandle:
        """Dispatches the sampling (and the verification of `step.spec`'s drafts) of `step`,
        launched by `launch_forward` as `handle`; `handle` is then like one `launch`
        returned."""
        forward = handle.forward
        sampling, spec = self._replicated((step.sampling, step.spec))
        args = (forward.logits, sampling, self.counts.table,
                self._device_bitmask(step.bucket, bitmask), spec)
        if self.batch_invariant:  # the live positions' tiles: the real sequences' count
            args += (self._replicated(step.batch.num_seqs),)
        exe = self._executable(step.bucket, "sample", args)
        tokens, yielded, logprobs, self.counts.table = exe(*args)
        handle.out = StepOutput(tokens, logprobs, forward.prompt_logprobs, num_yielded=yielded,
                                expert_counts=forward.expert_counts, pooled=forward.pooled)
        handle.forward = None
        return self._launched(handle)

    def _launched(self, handle: StepHandle) -> StepHandle:
        out = handle.out
        if self.parallel is None:
            out.tokens.copy_to_host_async()
            if out.num_yielded is not None:
                out.num_yielded.copy_to_host_async()
        if self._watcher is not None:
            self._watcher.add(handle)
        return handle

    def collect(self, handle: StepHandle) -> StepOutput:
        """The launched step's `StepOutput` with `tokens` (and pooled sums) on the host
        (waits for the device); log-probabilities stay on the device (read them only if
        asked)."""
        out = handle.out
        if self.host_pool is not None:
            self.host_pool.poll()
        host = {"tokens": out.tokens, "num_yielded": out.num_yielded,
                "expert_counts": out.expert_counts, "pooled": out.pooled}
        for name, value in host.items():
            if value is not None:  # replicated on a mesh: any local copy is the value
                host[name] = np.asarray(value if self.parallel is None
                                        else value.addressable_data(0))
        return dataclasses.replace(out, **host)

    def cache_lost(self) -> bool:
        """Whether the KV cache buffer was consumed by a call that then failed."""
        return any(x.is_deleted() for x in jax.tree.leaves((self.cache, self.counts.table)))

    def reset_cache(self) -> None:
        """A fresh zeroed KV cache (every sequence's KV is gone)."""
        self.cache = self._new_cache()
        self.counts.reset()
        if self.lora is not None:  # the slots are written again as steps need them
            self.lora.reset()
        if self.host_pool is not None:  # the scheduler forgets the tier with the cache
            self.host_pool.reset()

    def _new_cache(self):
        if self.parallel is not None:
            return self.parallel.make_cache(self.cfg, self.num_blocks, self.block_size,
                                            self.kv_cache_dtype, self.kv_scales,
                                            self.kv.num_slots)
        return make_cache(self.cfg, self.num_blocks, self.block_size, self.kv_cache_dtype,
                          self.kv_scales, self.kv.num_slots)

    def warm(self, buckets, pooling: bool = False) -> float:
        """Acquires (compiles, or finds) the executables of `buckets` (their pooling ones
        with `pooling`) and runs each once on an all-padding step (which writes nothing).
        Returns seconds."""
        t0 = time.perf_counter()
        for bucket in sorted(buckets):
            self.run(warmup_step(bucket, max_blocks=self.max_blocks, block_size=self.block_size,
                                 num_blocks=self.num_blocks, spare_slot=self.counts.spare,
                                 num_groups=self.kv.num_groups, pooling=pooling))
        return time.perf_counter() - t0

    def warmup(self) -> float:
        """Prepares every bucket not prepared yet (and, when steps may pool, its pooling
        executable; a second call runs nothing). Returns the seconds it took."""
        seconds = 0.0
        for every_row in [(False, False)] + ([(False, True)] if self.pooling else []):
            warm = {key[0] for key in self._compiled if key[1] == "step" and key[2] == every_row}
            seconds += self.warm((b for b in self.buckets.all() if b not in warm),
                                 pooling=every_row[1])
        return seconds


def enable_persistent_compilation_cache(path) -> None:
    """Turns on JAX's persistent compilation cache in directory `path`, so a later process
    warms up in a fraction of the time.

    NOTE: this is a process-wide JAX setting; scripts call it once at start-up (their
    --compilation_cache_dir flag). No engine constructor flips it.
    """
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
