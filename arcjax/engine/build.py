"""`build_engine(config)`: load the model, size the KV cache, build buckets, runner, engine."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import jax
import jax.numpy as jnp

import pallas_kernels
from pallas_kernels.mla import MLA_IMPLS
from arcjax.engine.engine_config import EngineConfig
from arcjax.engine.engine import Engine
from arcjax.spec_decode.speculator import Speculator
from arcjax.engine.tokenizer import Tokenizer
from arcjax.errors import EngineConfigError
from arcjax.lora.adapter_cache import AdapterCache
from arcjax.model.lora_delta import resolve_impl
from arcjax.lora.peft_adapter import load_peft_adapter
from arcjax.lora.slot_table import SlotTable
from arcjax.model.formats.gguf_tokenizer import has_tokenizer
from arcjax.model.formats.hub import ModelSource, resolve_model
from arcjax.model.formats.loader import load_model, model_config
from arcjax.model.formats.pooler_config import read_pooler_config
from arcjax.model.formats.quant_config import checkpoint_quantization
from arcjax.model.kv_layout import kv_layout
from arcjax.model.kv_scales import calibrated_kv_scales, calibration_ids
from arcjax.model import packed_matmul
from arcjax.model.specs import page_shapes
from arcjax.parallel import StepSync, TensorParallel, follow
from arcjax.reasoning.model_reasoning import ModelReasoning
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.kv_tiers import HostKVPool
from arcjax.runtime.executable_cache import SHARED_EXECUTABLES
from arcjax.runtime.runner import ModelRunner
from arcjax.spec_decode.draft_model import DraftModelProposer
from arcjax.spec_decode.ngram_proposer import NgramProposer

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
# The default KV cache cap on CPU (`cpu_kv_cache_bytes`): a sixteenth of the host's memory,
# rounded down to a power of two, within these bounds (4 GiB: vLLM's CPU default space).
CPU_KV_CACHE_MIN_BYTES, CPU_KV_CACHE_MAX_BYTES = 256 << 20, 4 << 30
CPU_KV_MEMORY_SHARE = 16
# What latent attention runs under jit: `MLA_IMPLS` less the oracle (it reads host values).
LATENT_ATTENTION_IMPLS = tuple(impl for impl in MLA_IMPLS if impl != "reference")
# Checkpoint formats a latent attention model loads (besides float): values + scales, read
# for both layer stacks (`quantized_checkpoint.quantized_host`).
LATENT_CHECKPOINT_FORMATS = ("fp8", "int8")


def default_model_path() -> Path:
    """The packaged default model's directory."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the packaged default model is missing ({DEFAULT_MODEL_DIR}); "
                                "pass model=PATH to a Hugging Face model directory")
    return DEFAULT_MODEL_DIR


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _overlap_pays() -> bool:
    """Whether overlapped scheduling is faster here: always with an accelerator (host and
    device run side by side); on the CPU backend only with more than one core available
    (on one core the host's planning and XLA's compute share it, and overlapping only adds
    work: scripts/bench_throughput.py pinned to one core, RESULTS.md)."""
    if jax.default_backend() != "cpu":
        return True
    try:
        return len(os.sched_getaffinity(0)) > 1
    except AttributeError:  # no affinity API (macOS): count the cores
        return (os.cpu_count() or 1) > 1


def cpu_kv_cache_bytes(host_bytes: int | None = None) -> int:
    """The default KV cache cap on CPU: `host_bytes` (default: this host's physical memory)
    over CPU_KV_MEMORY_SHARE, as a power of two, clamped to [CPU_KV_CACHE_MIN_BYTES,
    CPU_KV_CACHE_MAX_BYTES]. 24 GB give 1 GiB: the 32 requests of scripts/bench_throughput.py's
    SmolLM2 workload at once (401 MiB in float32), where the old fixed 256 MiB preempted a
    third of its steps (docs/design/cpu-step-profile.md); a sixteenth leaves room for the
    weights and for several engines on one host."""
    if host_bytes is None:
        try:
            host_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):  # not reported: the lower bound
            host_bytes = 0
    share = host_bytes // CPU_KV_MEMORY_SHARE
    cap = 1 << (share.bit_length() - 1) if share > 0 else 0
    return min(CPU_KV_CACHE_MAX_BYTES, max(CPU_KV_CACHE_MIN_BYTES, cap))


def _default_num_blocks(cfg, dtype, block_size: int, max_blocks: int, max_num_seqs: int,
                        fraction: float, tp: int = 1, num_slots: int | None = None,
                        utilization: float | None = None) -> int:
    """Blocks for the KV cache: `fraction` of the device's free memory, or (vLLM's
    gpu_memory_utilization) what `utilization` of its whole memory leaves once the
    weights are in; on a device that reports no memory (CPU), room for max_num_seqs
    sequences (at most `cpu_kv_cache_bytes()`)."""
    # Per device: the cache is split `tp` ways (by KV head, cfg the sharded config; latent
    # attention's pages are whole on every device: `TensorParallel.cache_split`).
    # A block holds `num_slots` layers' pages (arcjax/model/kv_layout.py).
    slots = cfg.num_layers if num_slots is None else num_slots
    per_block = (slots * block_size * cfg.kv_values_per_token() * dtype.itemsize) // tp
    stats = (jax.devices()[0].memory_stats() or {}) if _on_gpu() else {}
    if stats.get("bytes_limit"):
        limit, used = stats["bytes_limit"], stats.get("bytes_in_use", 0)
        if utilization is None:
            return max(max_blocks, int((limit - used) * fraction) // per_block)
        budget = utilization * limit - used
        if budget < max_blocks * per_block:  # vLLM refuses too: no memory for the cache
            raise EngineConfigError("gpu_memory_utilization",
                                    f"{utilization} of {limit} bytes leaves "
                                    f"{max(int(budget), 0)} for the KV cache once the weights "
                                    f"({used} bytes) are in: less than one max_model_len "
                                    f"sequence needs ({max_blocks * per_block})")
        return int(budget) // per_block
    return max(max_blocks, min(max_blocks * max_num_seqs, cpu_kv_cache_bytes() // per_block))


def build_engine(config: EngineConfig, clock=None) -> Engine:
    """Loads `config.model` and returns a ready `Engine` (executables compile lazily or in
    `engine.runner.warmup()`).

    Raises:
      EngineConfigError: an option the model or this machine cannot honour (max_model_len
        beyond its limit, a draft model that does not fit it, an attention_impl that cannot
        run here), found before any weights load.
      ModelFileError subclasses: the model directory cannot be loaded.
    """
    source = (resolve_model(config.model, config.revision) if config.model is not None
              else ModelSource(default_model_path(), "default"))
    model_dir = source.path  # a directory, or the .gguf file
    dtype = jnp.dtype(config.dtype or ("bfloat16" if _on_gpu() else "float32"))
    reason = pallas_kernels.impl_unavailable(config.attention_impl,
                                             platform=jax.default_backend())
    if reason is not None:  # a GPU kernel off the GPU, or without its packages
        raise EngineConfigError("attention_impl", reason)
    # runner="pooling": how it pools, read (and refused) before any weights load
    pooler = (read_pooler_config(None if source.is_gguf else model_dir)
              if config.runner == "pooling" else None)
    spec, draft = config.speculative_config, None
    if spec is not None and spec.method == "draft_model":  # checked before any weights load
        limit = model_config(source).max_position_embeddings
        draft = spec.check_draft_model(source, config.max_model_len or min(limit, 4096))
    _check_latent_attention(config, source)
    parallel = None
    if jax.process_count() > 1 and config.async_scheduling:
        raise EngineConfigError("async_scheduling", "not supported across several processes "
                                "(multi-host runs the serial step)")
    tp, ep = config.tensor_parallel_size, config.expert_parallel_size
    if jax.process_count() > 1 and max(tp, ep) != jax.device_count():
        raise EngineConfigError("tensor_parallel_size", f"over {jax.process_count()} "
                                f"processes it must span all {jax.device_count()} devices, "
                                f"got {max(tp, ep)}", limit=jax.device_count())
    meshed = max(tp, ep) > 1 or jax.process_count() > 1
    reason = packed_matmul.impl_unavailable(config.packed_matmul_impl,
                                            platform=jax.default_backend(), parallel=meshed)
    if reason is not None:  # the kernel off the GPU, or under a mesh
        raise EngineConfigError("packed_matmul_impl", reason)
    if meshed:
        parallel = TensorParallel.create(model_config(source), tp, ep=ep)
    # With `parallel`, cfg is the sharded config (KV heads repeated when tp exceeds them).
    model = load_model(source, dtype=dtype, cache_dir=config.cache_dir, parallel=parallel,
                       quantization=config.quantization)
    cfg, params = model.cfg, model.params
    if config.tokenizer is not None:
        tokenizer = Tokenizer.from_dir(config.tokenizer)
    elif source.is_gguf:
        tokenizer = (Tokenizer.from_gguf(model.gguf_file)
                     if has_tokenizer(model.gguf_file) else None)
    else:
        tokenizer = (Tokenizer.from_dir(model_dir)
                     if (model_dir / "tokenizer.json").is_file() else None)
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_model_len > cfg.max_position_embeddings:
        raise EngineConfigError("max_model_len", f"{max_model_len} exceeds the model's limit "
                                f"{cfg.max_position_embeddings}",
                                limit=cfg.max_position_embeddings)
    max_blocks = -(-max_model_len // config.scheduler.block_size)
    # FP8 pages: one byte a value, so the same memory holds twice the blocks of bf16.
    kv_dtype = jnp.dtype(jnp.float8_e4m3fn) if config.kv_cache_dtype == "fp8" else dtype
    kv = kv_layout(cfg, hybrid=not config.disable_hybrid_kv_cache_manager)
    num_blocks = config.num_kv_blocks or _default_num_blocks(
        cfg, kv_dtype, config.scheduler.block_size, kv.num_groups * max_blocks,
        config.scheduler.max_num_seqs, config.kv_memory_fraction,
        1 if parallel is None else parallel.cache_split(cfg),
        kv.num_slots, config.gpu_memory_utilization)
    pages = page_shapes(cfg, config.scheduler.block_size)  # K's and V's, every device's
    host_blocks = HostKVPool.slots_for(int(config.kv_offloading_size * (1 << 30)),
                                       num_slots=kv.num_slots, page_shape=pages[0],
                                       v_page_shape=pages[1], dtype=kv_dtype)
    if config.kv_offloading_size and not host_blocks:
        raise EngineConfigError("kv_offloading_size", f"{config.kv_offloading_size} GiB holds "
                                f"no KV block of this model")
    sched = config.scheduler_config(num_blocks, kv.sliding_window, kv.scheduler_groups,
                                    host_blocks)
    step_tokens = max(sched.max_num_batched_tokens,
                      max_model_len if sched.policy == "prefill_first" else 0)
    buckets = BucketSet.create(tile=sched.chunk_tile, max_tokens=step_tokens,
                               max_seqs=sched.max_num_seqs,
                               spec_width=1 + (spec.num_speculative_tokens if spec else 0))
    lora, adapters, slots, lora_impl = config.lora_config(), None, None, "masked"
    if lora is not None:  # adapters are read against the file's config, slots the device's
        adapters = AdapterCache(functools.partial(
            load_peft_adapter, cfg=model_config(source), max_rank=lora.max_lora_rank,
            base_model=config.model), lora.cpu_capacity)
        slots = SlotTable(cfg, max_loras=lora.max_loras, rank=lora.max_lora_rank, dtype=dtype,
                          parallel=parallel)
        lora_impl = resolve_impl(lora.lora_impl, jax.default_backend())
    runner = ModelRunner(cfg, params, num_blocks=num_blocks, block_size=sched.block_size,
                         max_blocks_per_seq=max_blocks, buckets=buckets, dtype=dtype,
                         attn_impl=config.attention_impl,
                         executables=SHARED_EXECUTABLES, parallel=parallel,
                         kv_cache_dtype=kv_dtype,
                         kv_scales=_kv_scales(config, model, tokenizer, dtype),
                         kv=kv, host_slots=host_blocks, pooling=config.runner == "pooling",
                         lora=slots, lora_impl=lora_impl,
                         matmul_impl=packed_matmul.resolve_impl(
                             config.packed_matmul_impl, params,
                             platform=jax.default_backend(), parallel=parallel is not None,
                             batch_invariant=config.batch_invariant),
                         batch_invariant=config.batch_invariant,
                         layer_loop=config.layer_loop)
    speculator = (_speculator(config, draft, sched, max_model_len, dtype) if spec is not None
                  else None)
    options = {} if clock is None else {"clock": clock}
    multi_host = jax.process_count() > 1
    overlapped = (config.async_scheduling if config.async_scheduling is not None
                  else not multi_host and _overlap_pays())
    engine = Engine(runner, tokenizer, sched, max_model_len=max_model_len, seed=config.seed,
                    model_dir=model_dir, trace_capacity=config.trace_capacity,
                    async_scheduling=overlapped, speculator=speculator, pooler=pooler,
                    adapters=adapters,
                    reasoning=ModelReasoning.create(
                        config.reasoning_parser, tokenizer,
                        gate=not config.structured_outputs_in_reasoning),
                    **options)
    if multi_host:  # process 0 admits; every process runs the same plans
        engine.sync = StepSync.create()
    return engine


def _check_latent_attention(config: EngineConfig, source: ModelSource) -> None:
    """Refuses, before any weights load, what latent attention (DeepSeek's MLA,
    arcjax/model/mla_layers.py) does not run with yet: FP8 pages (the latent pages carry no
    scales), weights quantized at load (`quant.quantize_params` walks one layer stack) and
    packed checkpoints (untested), LoRA adapters (none target its projections),
    batch-invariant mode (the latent kernels have no fixed tiles), and attention
    implementations other than `pallas_kernels.mla`'s."""
    cfg = model_config(source)
    if not cfg.is_mla:
        return
    arch = cfg.architecture
    if config.kv_cache_dtype == "fp8":
        raise EngineConfigError("kv_cache_dtype", f"fp8 pages are not supported for {arch}'s "
                                "latent attention (its latent pages carry no scales)")
    stored = None if source.is_gguf else checkpoint_quantization(source.path)
    if config.quantization not in (None, "dequantize") or (
            stored is not None and stored.fmt not in LATENT_CHECKPOINT_FORMATS):
        raise EngineConfigError("quantization", f"{arch} loads float checkpoints and FP8 / "
                                "INT8 ones (DeepSeek-V3's block-scaled FP8) as stored; "
                                f"got quantization={config.quantization!r}, checkpoint "
                                f"{stored.fmt if stored is not None else 'float'}")
    if config.enable_lora:
        raise EngineConfigError("enable_lora", f"LoRA adapters are not supported for {arch}'s "
                                "latent attention")
    if config.batch_invariant:
        raise EngineConfigError("batch_invariant", f"not built for {arch}'s latent attention "
                                "yet (its kernels' tiles follow the batch)")
    if config.attention_impl not in LATENT_ATTENTION_IMPLS:
        raise EngineConfigError("attention_impl", f"{config.attention_impl!r} does not run "
                                f"latent attention ({arch}); supported: "
                                f"{', '.join(LATENT_ATTENTION_IMPLS)}")


def _kv_scales(config: EngineConfig, model, tokenizer, dtype):
    """FP8 pages' [2, L] K and V scales: the checkpoint's, else calibrated from one
    prefill of a fixed prompt (`arcjax.model.kv_scales`) unless `calculate_kv_scales` is
    off; None (the runner's 1.0) for other pages or without calibration."""
    if config.kv_cache_dtype != "fp8":
        return None
    if model.kv_scales is not None:
        return model.kv_scales
    if not config.calculate_kv_scales:
        return None
    return calibrated_kv_scales(model.cfg, model.params, calibration_ids(tokenizer, model.cfg),
                                dtype)


def _speculator(config: EngineConfig, draft: ModelSource | None, sched, max_model_len: int,
                dtype) -> Speculator:
    """The proposer of `config.speculative_config`: n-gram lookup, or the draft model
    (`draft`, loaded here, unsharded, its own KV cache: one slot per request it may draft
    for)."""
    spec = config.speculative_config
    if spec.method == "ngram":
        return Speculator(spec, NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max))
    model = load_model(draft, dtype=dtype, cache_dir=config.cache_dir)
    slots = min(sched.max_num_seqs, spec.disable_by_batch_size or sched.max_num_seqs)
    return Speculator(spec, DraftModelProposer(
        model.cfg, model.params, num_slots=slots, max_model_len=max_model_len,
        max_drafts=spec.num_speculative_tokens, block_size=config.scheduler.block_size,
        token_budget=sched.max_num_batched_tokens, tile=sched.chunk_tile, dtype=dtype,
        attn_impl=config.attention_impl, executables=SHARED_EXECUTABLES))


def run_follower(model=None, **options) -> int:
    """A multi-host follower process's whole run: the engine the leader builds (same model,
    same options), stepped in lockstep until the leader stops it (`arcjax.parallel.follow`).
    Returns the steps taken; raises `EngineDeadError` when the run failed on any process."""
    return follow(build_engine(EngineConfig.from_options(model, **options)))
