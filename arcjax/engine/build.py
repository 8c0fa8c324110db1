"""`build_engine(config)`: load the model, size the KV cache, build buckets, runner, engine."""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp

from arcjax.engine.config import EngineConfig
from arcjax.engine.engine import Engine
from arcjax.engine.tokenizer import Tokenizer
from arcjax.errors import EngineConfigError
from arcjax.model.weights import load_hf, read_config
from arcjax.parallel import StepSync, TensorParallel, follow, kv_repeat, sharded_config
from arcjax.runtime.buckets import BucketSet
from arcjax.runtime.runner import SHARED_EXECUTABLES, ModelRunner

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "default_model"
CPU_KV_CACHE_BYTES = 256 << 20  # default KV cache cap on CPU


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


def _default_num_blocks(cfg, dtype, block_size: int, max_blocks: int, max_num_seqs: int,
                        fraction: float, tp: int = 1) -> int:
    # Per device: the cache is split by KV head over tp devices (cfg: the sharded config).
    per_block = (2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim
                 * dtype.itemsize) // tp
    if _on_gpu():
        stats = jax.devices()[0].memory_stats() or {}
        free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
        return max(max_blocks, int(free * fraction) // per_block)
    return max(max_blocks, min(max_blocks * max_num_seqs, CPU_KV_CACHE_BYTES // per_block))


def build_engine(config: EngineConfig, clock=None) -> Engine:
    """Loads `config.model` and returns a ready `Engine` (executables compile lazily or in
    `engine.runner.warmup()`).

    Raises:
      EngineConfigError: an option the model cannot honour (max_model_len beyond its limit).
      ModelFileError subclasses: the model directory cannot be loaded.
    """
    model_dir = Path(config.model) if config.model is not None else default_model_path()
    dtype = jnp.dtype(config.dtype or ("bfloat16" if _on_gpu() else "float32"))
    parallel = None
    if jax.process_count() > 1 and config.async_scheduling:
        raise EngineConfigError("async_scheduling", "not supported across several processes "
                                "(multi-host runs the serial step)")
    if jax.process_count() > 1 and config.tensor_parallel_size != jax.device_count():
        raise EngineConfigError("tensor_parallel_size", f"over {jax.process_count()} "
                                f"processes it must span all {jax.device_count()} devices, "
                                f"got {config.tensor_parallel_size}", limit=jax.device_count())
    shards = {}
    if config.tensor_parallel_size > 1 or jax.process_count() > 1:
        file_cfg, tp = read_config(model_dir), config.tensor_parallel_size
        parallel = TensorParallel.create(file_cfg, tp)
        shards = dict(shardings=parallel.param_shardings(sharded_config(file_cfg, tp)),
                      kv_repeat=kv_repeat(file_cfg, tp))
    # With shardings, cfg is the sharded config (KV heads repeated when tp exceeds them).
    cfg, params = load_hf(model_dir, dtype=dtype, cache_dir=config.cache_dir, **shards)
    tokenizer = (Tokenizer.from_dir(model_dir)
                 if (model_dir / "tokenizer.json").is_file() else None)
    max_model_len = config.max_model_len or min(cfg.max_position_embeddings, 4096)
    if max_model_len > cfg.max_position_embeddings:
        raise EngineConfigError("max_model_len", f"{max_model_len} exceeds the model's limit "
                                f"{cfg.max_position_embeddings}",
                                limit=cfg.max_position_embeddings)
    max_blocks = -(-max_model_len // config.block_size)
    num_blocks = config.num_kv_blocks or _default_num_blocks(
        cfg, dtype, config.block_size, max_blocks, config.max_num_seqs,
        config.kv_memory_fraction, config.tensor_parallel_size)
    sched = config.scheduler_config(num_blocks)
    step_tokens = max(sched.max_num_batched_tokens,
                      max_model_len if sched.policy == "prefill_first" else 0)
    buckets = BucketSet.create(tile=sched.chunk_tile, max_tokens=step_tokens,
                               max_seqs=sched.max_num_seqs)
    runner = ModelRunner(cfg, params, num_blocks=num_blocks, block_size=config.block_size,
                         max_blocks_per_seq=max_blocks, buckets=buckets, dtype=dtype,
                         attn_impl=config.attention_impl, executables=SHARED_EXECUTABLES,
                         parallel=parallel)
    options = {} if clock is None else {"clock": clock}
    multi_host = jax.process_count() > 1
    overlapped = (config.async_scheduling if config.async_scheduling is not None
                  else not multi_host and _overlap_pays())
    engine = Engine(runner, tokenizer, sched, max_model_len=max_model_len, seed=config.seed,
                    model_dir=model_dir, trace_capacity=config.trace_capacity,
                    async_scheduling=overlapped, **options)
    if multi_host:  # process 0 admits; every process runs the same plans
        engine.sync = StepSync.create()
    return engine


def run_follower(model=None, **options) -> int:
    """A multi-host follower process's whole run: the engine the leader builds (same model,
    same options), stepped in lockstep until the leader stops it (`arcjax.parallel.follow`).
    Returns the steps taken; raises `EngineDeadError` when the run failed on any process."""
    return follow(build_engine(EngineConfig.from_options(model, **options)))
