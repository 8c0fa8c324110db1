"""`EngineConfig`: every engine option, frozen and validated before anything is loaded.

Built from keyword arguments (`EngineConfig.from_options(model, **options)`, what `LLM`,
`AsyncLLM` and the server pass through). The scheduling knobs are declared once, in
`scheduler.SchedulerConfig`: the engine holds one (`EngineConfig.scheduler`), built by
`SchedulerConfig.from_env` from the options of the same names, so `ARC_PREFILL_MAX_SEQS`
and `ARC_PREFILL_FLOOR_STEPS` fill their knobs there, explicit options winning. Its cache
geometry (`num_blocks`, `sliding_window`, `kv_cache_groups`, `num_host_blocks`) is filled in
by `build_engine` from the model and the memory (`EngineConfig.scheduler_config`). Every bad
option raises `EngineConfigError` (a `ConfigError`) whose `.field` names it.
`arcjax.engine.build.build_engine` turns a config into an engine.
"""

from __future__ import annotations

import dataclasses
import math
import os

from collections.abc import Mapping

import scheduler
from arcjax.errors import ConfigError, EngineConfigError
from arcjax.lora.lora_config import LoRAConfig
from arcjax.model.layer_arrays import LAYER_LOOPS
from arcjax.model.packed_matmul import IMPLS as PACKED_MATMUL_IMPLS
from arcjax.reasoning import NO_PARSER
from arcjax.reasoning import PARSERS as REASONING_PARSERS
from arcjax.spec_decode.speculative_config import SpeculativeConfig

DTYPES = ("float32", "bfloat16", "float16")
# "auto" resolves per bucket (`pallas_kernels.choose_inputs`); "cpu": the compiled CPU
# kernel (pallas_kernels/cpu_attention.py); the GPU kernels: Pallas-Triton and the Triton
# kernel through jax-triton. Not engine-wide: "mosaic_gpu" (decode-only batches: "auto"
# runs it in decode buckets once verified) and "reference" (host numpy).
ATTENTION_IMPLS = ("auto", "xla", "cpu", "pallas_gpu", "triton")
# What `quantization` may ask at load: a float checkpoint quantized to FP8 / INT8, or every
# weight of a quantized checkpoint or GGUF file dequantized to the compute dtype.
QUANTIZATIONS = ("fp8", "int8", "dequantize")
KV_CACHE_DTYPES = ("auto", "fp8")  # "auto": the compute dtype; "fp8": float8_e4m3fn pages
# "generate": generation only; "pooling": embeddings too (vLLM's name), prefill-only rows
# beside generation in the same steps (a decoder LM can embed)
RUNNERS = ("generate", "pooling")

# The SchedulerConfig fields a caller sets as engine options; the rest (the cache's size,
# the model's window and KV cache groups, the host tier's size) `build_engine` derives.
DERIVED_SCHEDULER_FIELDS = ("num_blocks", "sliding_window", "kv_cache_groups",
                            "num_host_blocks")
SCHEDULER_OPTIONS = tuple(f.name for f in dataclasses.fields(scheduler.SchedulerConfig)
                          if f.name not in DERIVED_SCHEDULER_FIELDS)
# The engine's one default that differs from the scheduler's (256, vLLM's): the step's
# sequence buckets and the device-resident penalty table are sized by max_num_seqs, so 64
# keeps warmup and memory small; a caller asks for more with max_num_seqs=.
ENGINE_MAX_NUM_SEQS = 64
_CHECK_NUM_BLOCKS = 1 << 30  # stands in for the cache size until it is known


def default_scheduler() -> scheduler.SchedulerConfig:
    """The scheduler knobs of an engine built without scheduling options."""
    return scheduler.SchedulerConfig(max_num_seqs=ENGINE_MAX_NUM_SEQS,
                                     num_blocks=_CHECK_NUM_BLOCKS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How an engine is built and scheduled.

    Attributes:
      model: a Hugging Face-format directory (config.json, *.safetensors, tokenizer.json),
        a GGUF file (or a directory holding one), or a Hugging Face Hub id ("org/name",
        fetched into the Hub cache; a local path of that name wins); None = the packaged
        default model.
      revision: a Hub id's branch, tag or commit (None = "main"); ignored for local paths.
      quantization: None = the checkpoint's weights as stored (FP8/INT8 checkpoints stay
        quantized; AWQ, GPTQ and compressed-tensors pack-quantized checkpoints, GGUF
        files and gpt-oss's MXFP4 experts stay packed); "fp8" (e4m3, per-channel scales) or "int8" (per-channel)
        quantizes a float checkpoint (or a GGUF file, dequantized first) at load;
        "dequantize" stores every weight in the compute dtype (the comparison baseline).
        Weights stay quantized or packed on the device; the step dequantizes them inside
        the jitted matmuls.
      kv_cache_dtype: "auto" = the compute dtype; "fp8" = float8_e4m3fn pages with one
        scale per layer for K and one for V (the checkpoint's k_scale/v_scale when it has
        them, else calibrated: `calculate_kv_scales`), about twice the tokens in the same
        memory.
      calculate_kv_scales: FP8 pages of a checkpoint without k_scale/v_scale: True = the
        scales are calibrated from one prefill of a fixed prompt when the engine is built
        (`arcjax.model.kv_scales`); False = 1.0 (vLLM's default for the option of this
        name). Read only with kv_cache_dtype="fp8".
      dtype: "float32" | "bfloat16" | "float16"; None = float32 on CPU, bfloat16 on GPU.
      max_model_len: longest prompt + output; None = min(model's limit, 4096).
      num_kv_blocks: KV cache size in blocks; None = from gpu_memory_utilization (or
        kv_memory_fraction) of the device's memory on a device that reports it (GPU), room
        for max_num_seqs full sequences on CPU (at most a sixteenth of the host's
        memory, 256 MiB to 4 GiB: `build.cpu_kv_cache_bytes`).
      kv_memory_fraction: share of free device memory the KV cache takes (GPU default).
      kv_offloading_size: GiB of host memory for KV blocks the device's prefix cache evicts
        (the host tier, vLLM's option): they are copied there instead of being dropped, and
        a prefix hit on one is loaded back (scheduler/host_tier.py,
        arcjax/runtime/kv_tiers.py). 0 = off; needs prefix caching and one process.
      disable_hybrid_kv_cache_manager: keep one block table for every layer of a model that
        mixes sliding-window and full-attention layers (vLLM's option); by default such a
        model gets one KV cache group per attention type (arcjax/model/kv_layout.py), and
        its sliding layers free what fell out of their window.
      gpu_memory_utilization: vLLM's: the share of the device's whole memory this engine
        may use, weights and all; the KV cache gets what is left of it once the weights are
        loaded (None: kv_memory_fraction decides). Devices that report no memory (CPU)
        keep their default cache.
      tokenizer: a directory with the tokenizer (tokenizer.json, its configs and chat
        template) to use instead of the model's; None = the model's.
      attention_impl: "auto" (per bucket, what this installation runs best: a GPU kernel
        on a GPU, the compiled CPU kernel on the CPU where it builds, xla elsewhere; the
        trace summary names it) | "xla" | "cpu" (the compiled CPU kernel,
        pallas_kernels/cpu_attention.py) | "pallas_gpu" (Pallas-Triton) | "triton" (the
        Triton kernel through jax-triton). A kernel that cannot run on this machine is
        refused when the engine is built.
      packed_matmul_impl: how the projections multiply inside the step
        (`arcjax.model.packed_matmul`): "auto" (the W4A16 Pallas kernel for packed 4-bit
        weights in decode-sized matmuls on a GPU with one device; the compiled CPU kernel
        for bfloat16 weights in decode-sized matmuls on one CPU device; XLA's
        dequantize-then-dot elsewhere; the trace summary names it) | "xla" | "cpu" (the
        CPU kernel, `pallas_kernels.cpu_matmul`) | "w4a16" (the kernel; NVIDIA GPU, one
        device) | "w4a16_interpret" (the kernel in Pallas' interpreter, on any platform:
        tests).
      layer_loop: how the step runs the decoder's layers (arcjax/model/layer_arrays.py):
        "auto" ("unrolled" on the CPU for one device and a model without experts, "scan"
        elsewhere; the trace summary names it) | "scan" (one `lax.scan` over the stacked
        layer weights: compile time flat in depth) | "unrolled" (the layers one after the
        other over weights held one array per layer: XLA:CPU reads them in place instead of
        copying each layer's slice out of the stack; compile time grows with depth). The
        same tokens either way.
      seed: seeds requests whose SamplingParams have no seed.
      cache_dir: where converted params are cached (orbax); None = no cache.
      trace_capacity: engine steps the trace ring keeps (oldest dropped first).
      tensor_parallel_size: devices the model is split over (heads, KV heads, MLP and
        vocabulary; see `arcjax.parallel`); they may span processes (`jax.distributed`,
        `arcjax.parallel.initialize`). 1 = one device, no mesh.
      expert_parallel_size: devices a mixture of experts' experts are split over (attention
        stays split over tensor_parallel_size; the mesh spans the larger of the two, and
        one must be a multiple of the other; see `arcjax.parallel.layout`). 1 = experts
        split like the rest of the MLP (by width).
      async_scheduling: plan and pack step N+1 while the device runs step N, the sampled
        tokens fed forward on the device (`scheduler.advance`); greedy outputs are identical
        either way. None = on where it is faster: with an accelerator, or on the CPU backend
        with more than one core available (not across several processes: multi-host runs
        the serial step, and True is refused there); True / False force it.
      speculative_config: speculative decoding, vLLM's keys: {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_min": 2, "prompt_lookup_max": 4} or
        {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}, optionally
        "disable_by_batch_size" (`arcjax.spec_decode.speculative_config.SpeculativeConfig`; a dict or
        its JSON text is turned into one); None = off. Outputs are the same either way.
      reasoning_parser: how outputs split into reasoning and content (`CompletionOutput.
        reasoning` / `.content`) and where structured outputs start (after the reasoning):
        "deepseek_r1", "qwen3", "openai_gptoss" (vLLM's names; the vocabulary must have
        the format's markers), "none", or None: implied by each prompt (a request whose
        prompt shows a `<think>` block is split as deepseek_r1 splits; see
        `arcjax.reasoning.model_reasoning`).
      structured_outputs_in_reasoning: structured outputs constrain the reasoning too
        (the whole output, as vLLM's `--structured-outputs-config.enable_in_reasoning`);
        False (default): the grammar starts after the reasoning (`ReasoningGate`).
      enable_lora: serve LoRA adapters (`lora_request=` on each request; docs/design/lora.md):
        `max_loras` (a scheduler knob: adapters running at once, one device slot each),
        `max_lora_rank` (the largest rank, every slot's), `max_cpu_loras` (adapters kept
        loaded on the host; None = max_loras) and `lora_impl` (the per-token delta:
        "auto" | "ragged_dot" | "gather" | "masked") are read only with it
        (`lora_config`).
      runner: "generate" (generation requests only) or "pooling": embedding requests
        (`PoolingParams`, `LLM.embed`) too, pooled as the model's
        sentence-transformers files say (`arcjax.model.formats.pooler_config`), batched
        with generation requests in the same steps.
      batch_invariant: every request's logprobs bitwise the same whatever else the engine
        runs beside it, however its prompt is chunked, whatever the prefix cache held and
        whether its drafts are verified (docs/design/batch-invariance.md): every row-wise
        operation runs over fixed row tiles and attention over fixed query tiles and
        position-aligned key blocks (the xla path's, or the GPU kernels' batch-invariant
        plan when attention_impl names one). attention_impl and packed_matmul_impl "auto"
        then mean the compiled CPU kernels on one CPU device (row-invariant by
        construction; the products computed for a tile's live rows only), else "xla";
        packed_matmul_impl "auto", "xla" or "cpu"; tensor_parallel_size 1 or 2; not with
        enable_lora or expert_parallel_size > 1.
      scheduler: the scheduling knobs and the KV block size (`scheduler.SchedulerConfig`:
        policy, max_num_batched_tokens, max_num_seqs, prefill_max_seqs,
        prefill_floor_steps, chunk_tile, long_prefill_token_threshold,
        max_num_partial_prefills, block_size (a power of two here), watermark_blocks,
        enable_prefix_caching); `from_options` takes them as options of the same names.
        max_num_seqs defaults to ENGINE_MAX_NUM_SEQS (64) here; prefix caching is on.
    """

    model: str | None = None
    revision: str | None = None
    dtype: str | None = None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    calculate_kv_scales: bool = True
    max_model_len: int | None = None
    num_kv_blocks: int | None = None
    kv_memory_fraction: float = 0.5
    kv_offloading_size: float = 0.0
    disable_hybrid_kv_cache_manager: bool = False
    gpu_memory_utilization: float | None = None
    tokenizer: str | None = None
    attention_impl: str = "auto"
    packed_matmul_impl: str = "auto"
    layer_loop: str = "auto"
    seed: int = 0
    cache_dir: str | None = None
    trace_capacity: int = 10_000
    tensor_parallel_size: int = 1
    expert_parallel_size: int = 1
    async_scheduling: bool | None = None
    speculative_config: SpeculativeConfig | Mapping | str | None = None
    reasoning_parser: str | None = None
    structured_outputs_in_reasoning: bool = False
    enable_lora: bool = False
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_impl: str = "auto"
    runner: str = "generate"
    batch_invariant: bool = False
    scheduler: scheduler.SchedulerConfig = dataclasses.field(default_factory=default_scheduler)

    def __post_init__(self):
        if self.model is not None and not isinstance(self.model, (str, os.PathLike)):
            raise EngineConfigError("model", f"must be a path, a Hub id or None, got "
                                             f"{self.model!r}")
        if self.model is not None:
            object.__setattr__(self, "model", os.fspath(self.model))
        if self.revision is not None and (not isinstance(self.revision, str)
                                          or not self.revision.strip()):
            raise EngineConfigError("revision", f"must be a non-empty string or None, got "
                                                f"{self.revision!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise EngineConfigError("quantization", f"must be one of {QUANTIZATIONS} or None, "
                                                    f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got "
                                                      f"{self.kv_cache_dtype!r}")
        if not isinstance(self.calculate_kv_scales, bool):
            raise EngineConfigError("calculate_kv_scales", f"must be a bool, got "
                                                           f"{self.calculate_kv_scales!r}")
        if self.dtype is not None and str(self.dtype) not in DTYPES:
            raise EngineConfigError("dtype", f"must be one of {DTYPES} or None, got {self.dtype!r}")
        if self.dtype is not None:
            object.__setattr__(self, "dtype", str(self.dtype))
        _int("max_model_len", self.max_model_len, 1, optional=True)
        _int("num_kv_blocks", self.num_kv_blocks, 1, optional=True)
        if not isinstance(self.scheduler, scheduler.SchedulerConfig):
            raise EngineConfigError("scheduler", f"must be a scheduler.SchedulerConfig, got "
                                                 f"{self.scheduler!r}")
        block_size = self.scheduler.block_size
        if block_size & (block_size - 1):  # the kernels' page walk
            raise EngineConfigError("block_size", f"must be a power of two, got {block_size}")
        frac = self.kv_memory_fraction
        if (not isinstance(frac, (int, float)) or isinstance(frac, bool)
                or not math.isfinite(frac) or not 0 < frac <= 1):
            raise EngineConfigError("kv_memory_fraction", f"must be in (0, 1], got {frac!r}",
                                    limit=1)
        size = self.kv_offloading_size
        if (not isinstance(size, (int, float)) or isinstance(size, bool)
                or not math.isfinite(size) or size < 0):
            raise EngineConfigError("kv_offloading_size",
                                    f"must be a number of GiB >= 0, got {size!r}", limit=0)
        if size and not self.scheduler.enable_prefix_caching:
            raise EngineConfigError("kv_offloading_size", "the host tier keeps evicted "
                                    "prefix-cache blocks: it needs enable_prefix_caching")
        if size and _joined_processes() > 1:
            raise EngineConfigError("kv_offloading_size", "not supported across several "
                                    "processes yet")
        if not isinstance(self.disable_hybrid_kv_cache_manager, bool):
            raise EngineConfigError("disable_hybrid_kv_cache_manager", f"must be a bool, got "
                                    f"{self.disable_hybrid_kv_cache_manager!r}")
        util = self.gpu_memory_utilization
        if util is not None and (not isinstance(util, (int, float)) or isinstance(util, bool)
                                 or not math.isfinite(util) or not 0 < util <= 1):
            raise EngineConfigError("gpu_memory_utilization", f"must be in (0, 1], got "
                                                              f"{util!r}", limit=1)
        if self.tokenizer is not None:
            if not isinstance(self.tokenizer, (str, os.PathLike)) or not os.path.isfile(
                    os.path.join(os.fspath(self.tokenizer), "tokenizer.json")):
                raise EngineConfigError("tokenizer", f"must be a directory with a "
                                                     f"tokenizer.json, got {self.tokenizer!r}")
            object.__setattr__(self, "tokenizer", os.fspath(self.tokenizer))
        if self.attention_impl not in ATTENTION_IMPLS:
            raise EngineConfigError(
                "attention_impl", f"must be one of {ATTENTION_IMPLS} (the 'reference' oracle "
                f"is host-side numpy and cannot run in the jitted step; 'mosaic_gpu' serves "
                f"decode-only batches, which 'auto' gives it on a GPU where it has passed "
                f"scripts/gpu_check.sh), got {self.attention_impl!r}")
        if self.packed_matmul_impl not in PACKED_MATMUL_IMPLS:
            raise EngineConfigError("packed_matmul_impl", f"must be one of "
                                    f"{PACKED_MATMUL_IMPLS}, got {self.packed_matmul_impl!r}")
        if self.layer_loop not in LAYER_LOOPS:
            raise EngineConfigError("layer_loop", f"must be one of {LAYER_LOOPS}, got "
                                                  f"{self.layer_loop!r}")
        if self.runner not in RUNNERS:
            raise EngineConfigError("runner", f"must be one of {RUNNERS}, got {self.runner!r}")
        _int("seed", self.seed, 0)
        _int("trace_capacity", self.trace_capacity, 1)
        _int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _int("expert_parallel_size", self.expert_parallel_size, 1)
        if self.async_scheduling is not None and not isinstance(self.async_scheduling, bool):
            raise EngineConfigError("async_scheduling", f"must be a bool or None, got "
                                                        f"{self.async_scheduling!r}")
        if self.async_scheduling and _joined_processes() > 1:
            raise EngineConfigError("async_scheduling", "not supported across several "
                                    "processes (multi-host runs the serial step)")
        spec = SpeculativeConfig.create(self.speculative_config)
        object.__setattr__(self, "speculative_config", spec)
        if spec is not None and _joined_processes() > 1:
            raise EngineConfigError("speculative_config", "not supported across several "
                                    "processes yet")
        if self.cache_dir is not None:
            object.__setattr__(self, "cache_dir", os.fspath(self.cache_dir))
        names = (*REASONING_PARSERS, NO_PARSER)
        if self.reasoning_parser is not None and self.reasoning_parser not in names:
            raise EngineConfigError("reasoning_parser", f"must be one of {names} or None, got "
                                                        f"{self.reasoning_parser!r}")
        if not isinstance(self.enable_lora, bool):
            raise EngineConfigError("enable_lora", f"must be a bool, got {self.enable_lora!r}")
        if self.enable_lora:
            self.lora_config()  # its fields checked now
            if _joined_processes() > 1:
                raise EngineConfigError("enable_lora", "not supported across several "
                                        "processes yet")

        self._check_batch_invariant()

    def _check_batch_invariant(self) -> None:
        """What batch_invariant excludes, refused by the field that asks for it."""
        if not isinstance(self.batch_invariant, bool):
            raise EngineConfigError("batch_invariant", f"must be a bool, got "
                                                       f"{self.batch_invariant!r}")
        if not self.batch_invariant:
            return
        if self.packed_matmul_impl not in ("auto", "xla", "cpu"):
            raise EngineConfigError("packed_matmul_impl", f"batch_invariant runs XLA's "
                                    f"products or the CPU kernel's (the W4A16 kernel's tiles "
                                    f"are not fixed), got {self.packed_matmul_impl!r}")
        if self.tensor_parallel_size > 2:
            raise EngineConfigError("tensor_parallel_size", f"batch_invariant is built for 1 "
                                    f"or 2 devices: from 3 on, an all-reduce sums a row's "
                                    f"partials in an order set by its place in the buffer, "
                                    f"got {self.tensor_parallel_size}")
        for name, on in (("enable_lora", self.enable_lora),
                         ("expert_parallel_size", self.expert_parallel_size > 1)):
            if on:
                raise EngineConfigError(name, "not supported with batch_invariant yet")


    def lora_config(self) -> LoRAConfig | None:
        """The LoRA options as one `LoRAConfig`, or None without enable_lora."""
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.scheduler.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, lora_impl=self.lora_impl)

    def __getattr__(self, name: str):
        """The scheduling knobs read through: `config.max_num_seqs` is
        `config.scheduler.max_num_seqs` (declared once, in SchedulerConfig)."""
        if name in SCHEDULER_OPTIONS:
            return getattr(self.scheduler, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def from_options(cls, model=None, **options) -> "EngineConfig":
        """A config from keyword options and the ARC_* environment (explicit options win).

        Raises:
          EngineConfigError: an unknown option, or a value of the wrong type or range.
        """
        names = {f.name for f in dataclasses.fields(cls)} - {"model", "scheduler"}
        unknown = sorted(set(options) - names - set(SCHEDULER_OPTIONS))
        if unknown:
            raise EngineConfigError(unknown[0], f"unknown engine option(s) {unknown}; options "
                                    f"are {sorted(names | set(SCHEDULER_OPTIONS))}")
        knobs = {k: options.pop(k) for k in SCHEDULER_OPTIONS if k in options}
        # The cache size is not known yet: the knobs are checked against a generous
        # stand-in (or the size asked for), and `scheduler_config` fills in the real one.
        num_blocks = options.get("num_kv_blocks")
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1:
            num_blocks = _CHECK_NUM_BLOCKS  # EngineConfig names a bad num_kv_blocks itself
        try:
            sched = scheduler.SchedulerConfig.from_env(
                **{"max_num_seqs": ENGINE_MAX_NUM_SEQS, **knobs, "num_blocks": num_blocks})
            return cls(model=model, scheduler=sched, **options)
        except EngineConfigError:
            raise
        except ConfigError as e:  # the scheduler's: same field, same limit
            raise EngineConfigError(e.field, e.message, limit=e.limit) from e

    def scheduler_config(self, num_blocks: int, sliding_window: int | None = None,
                         kv_cache_groups: tuple = (),
                         num_host_blocks: int = 0) -> scheduler.SchedulerConfig:
        """The scheduler's config for a cache of `num_blocks` blocks; `sliding_window`: the
        model's window when every layer slides (blocks behind it return to the pool);
        `kv_cache_groups`: each group's window, for a hybrid model; `num_host_blocks`: the
        host tier's blocks."""
        return dataclasses.replace(self.scheduler, num_blocks=num_blocks,
                                   sliding_window=sliding_window,
                                   kv_cache_groups=kv_cache_groups,
                                   num_host_blocks=num_host_blocks)


def _joined_processes() -> int:
    """Processes of the `jax.distributed` run this process joined (1 when it joined none);
    read without starting a JAX backend."""
    from jax._src import distributed

    state = distributed.global_state
    return state.num_processes if state.client is not None and state.num_processes else 1


def _int(name: str, value, minimum: int, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineConfigError(name, f"must be an int{' or None' if optional else ''}, "
                                      f"got {value!r}")
    if value < minimum:
        raise EngineConfigError(name, f"must be >= {minimum}, got {value}", limit=minimum)
