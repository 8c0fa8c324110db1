"""`arcjax.LLM`: batch generation, streaming and online use over one `Engine`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp

import scheduler
from arcjax.buckets import BucketSet
from arcjax.engine import Engine
from arcjax.errors import EngineConfigError, RequestError
from arcjax.outputs import RequestOutput
from arcjax.runner import ModelRunner
from arcjax.sampling import SamplingParams
from arcjax.tokenizer import Tokenizer
from arcjax.trace import summarize, write_jsonl
from arcjax.weights import load_hf

DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"

_SCHED_OPTIONS = ("policy", "max_num_batched_tokens", "max_num_seqs", "prefill_max_seqs",
                  "prefill_floor_steps", "chunk_tile", "long_prefill_token_threshold",
                  "max_num_partial_prefills", "watermark_blocks")


def default_model_path() -> Path:
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(f"the packaged default model is missing ({DEFAULT_MODEL_DIR}); "
                                "pass model=PATH to a Hugging Face model directory")
    return DEFAULT_MODEL_DIR


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


class LLM:
    """A model plus engine. `LLM(model=None)` loads the packaged default model.

    Args:
      model: a Hugging Face-format directory (config.json, *.safetensors, tokenizer.json).
      dtype: compute/cache dtype; default float32 on CPU, bfloat16 on GPU.
      max_model_len: longest prompt + output; default min(model's limit, 4096).
      num_kv_blocks: KV cache size in blocks; default from kv_memory_fraction of the
        device's memory on GPU, and room for max_num_seqs full sequences on CPU.
      block_size: tokens per KV block.
      attention_impl: "auto" | "xla" | "pallas_gpu" (the "reference" oracle is host-side
        numpy and cannot run inside the jitted step).
      seed: seeds requests whose SamplingParams have no seed.
      cache_dir: where converted params are cached (orbax); None = no cache.
      compilation_cache_dir: if set, JAX's persistent compilation cache is enabled there
        (a process-wide JAX setting), so a later process warms up in a fraction of the time.
      **scheduler options: policy, max_num_batched_tokens, max_num_seqs, prefill_max_seqs,
        prefill_floor_steps, chunk_tile, long_prefill_token_threshold,
        max_num_partial_prefills, watermark_blocks (see scheduler.SchedulerConfig).
    """

    def __init__(self, model: str | os.PathLike | None = None, *, dtype=None,
                 max_model_len: int | None = None, num_kv_blocks: int | None = None,
                 kv_memory_fraction: float = 0.5, block_size: int = 16,
                 attention_impl: str = "auto", seed: int = 0,
                 cache_dir: str | os.PathLike | None = None,
                 compilation_cache_dir: str | os.PathLike | None = None, **scheduler_options):
        unknown = set(scheduler_options) - set(_SCHED_OPTIONS)
        if unknown:
            raise EngineConfigError(f"unknown engine options {sorted(unknown)}; scheduler "
                                    f"options are {_SCHED_OPTIONS}")
        if attention_impl not in ("auto", "xla", "pallas_gpu"):
            raise EngineConfigError(f"attention_impl must be 'auto', 'xla' or 'pallas_gpu', "
                                    f"got {attention_impl!r}")
        if not 0 < kv_memory_fraction <= 1:
            raise EngineConfigError(f"kv_memory_fraction must be in (0, 1], got {kv_memory_fraction}")
        if compilation_cache_dir is not None:
            jax.config.update("jax_compilation_cache_dir", str(compilation_cache_dir))
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        model_dir = Path(model) if model is not None else default_model_path()
        dtype = jnp.dtype(dtype or (jnp.bfloat16 if _on_gpu() else jnp.float32))
        cfg, params = load_hf(model_dir, dtype=dtype, cache_dir=cache_dir)
        tokenizer = (Tokenizer.from_dir(model_dir)
                     if (model_dir / "tokenizer.json").is_file() else None)
        max_model_len = max_model_len or min(cfg.max_position_embeddings, 4096)
        if max_model_len > cfg.max_position_embeddings:
            raise EngineConfigError(f"max_model_len {max_model_len} exceeds the model's "
                                    f"limit {cfg.max_position_embeddings}")
        opts = {"max_num_seqs": 64, **scheduler_options}
        max_blocks = -(-max_model_len // block_size)
        if num_kv_blocks is None:
            num_kv_blocks = self._default_num_blocks(cfg, dtype, block_size, max_blocks,
                                                     opts["max_num_seqs"], kv_memory_fraction)
        sched = scheduler.SchedulerConfig(block_size=block_size, num_blocks=num_kv_blocks,
                                          **opts)
        step_tokens = max(sched.max_num_batched_tokens,
                          max_model_len if sched.policy == "prefill_first" else 0)
        buckets = BucketSet.create(tile=sched.chunk_tile, max_tokens=step_tokens,
                                   max_seqs=sched.max_num_seqs)
        impl = attention_impl
        runner = ModelRunner(cfg, params, num_blocks=num_kv_blocks, block_size=block_size,
                             max_blocks_per_seq=max_blocks, buckets=buckets, dtype=dtype,
                             attn_impl=impl)
        self.model_dir, self.config, self.tokenizer = model_dir, cfg, tokenizer
        self.engine = Engine(runner, tokenizer, sched, max_model_len=max_model_len, seed=seed)
        self.scheduler_options = {k: getattr(sched, k) for k in _SCHED_OPTIONS}

    @staticmethod
    def _default_num_blocks(cfg, dtype, block_size, max_blocks, max_num_seqs, fraction) -> int:
        per_block = 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
        if _on_gpu():
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 0) - stats.get("bytes_in_use", 0)
            return max(max_blocks, int(free * fraction) // per_block)
        return max(max_blocks, min(max_blocks * max_num_seqs, (256 << 20) // per_block))

    # --- online use -------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        return self.engine.add_request(prompt, params, request_id, arrival_time)

    def step(self) -> list[RequestOutput]:
        return self.engine.step()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def warmup(self) -> float:
        """Compiles every bucket; returns seconds."""
        return self.engine.runner.warmup()

    # --- batch use --------------------------------------------------------------------
    def _submit(self, prompts, sampling_params) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise RequestError(f"got {len(sampling_params)} sampling_params for "
                               f"{len(prompts)} prompts")
        sampling_params = [sp if sp is not None else SamplingParams() for sp in sampling_params]
        for p, sp in zip(prompts, sampling_params):  # all-or-nothing: check before queueing
            self.engine.check(p, sp)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, sampling_params)]
        return ids

    def stream(self, prompts, sampling_params=None) -> Iterator[RequestOutput]:
        """Yields incremental outputs (`delta_text`) as steps complete."""
        ids = set(self._submit(prompts, sampling_params))
        while any(self.engine.requests[r].finish_reason is None for r in ids):
            for out in self.engine.step():
                if out.request_id in ids:
                    yield out

    def generate(self, prompts: str | Sequence, sampling_params=None, *,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in prompt order."""
        from tqdm.auto import tqdm

        ids = self._submit(prompts, sampling_params)
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), disable=not use_tqdm, desc="generate", unit="req")
        generated = 0
        with bar:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id not in final and out.request_id in ids:
                        final[out.request_id] = out
                        generated += len(out.token_ids)
                        bar.update(1)
                        rate = bar.format_dict.get("elapsed") or 0
                        bar.set_postfix(tok_s=f"{generated / rate:.1f}" if rate else "-")
        return [final[i] for i in ids]

    # --- trace ------------------------------------------------------------------------
    def trace_summary(self, wall_time: float) -> dict:
        configured = {k: v for k, v in self.scheduler_options.items()
                      if k in ("prefill_max_seqs", "prefill_floor_steps",
                               "long_prefill_token_threshold") and v}
        return summarize(self.engine.trace, wall_time, configured)

    def export_trace(self, path) -> None:
        write_jsonl(self.engine.trace, path)
