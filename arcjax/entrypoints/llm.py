"""`arcjax.LLM`: batch generation, streaming and online use over one `Engine`.

`generate` and `stream` see only their own requests: each registers a sink per request,
steps the engine until its requests finish, and aborts whatever is left if the caller
abandons the call (an exception, a closed or dropped stream). Requests added through the
online API (`add_request`) get their outputs from `step()`, whoever else steps.
`generate` asks for final outputs only (`RequestOutputKind.FINAL_ONLY`, as vLLM's
`LLM.generate`); `stream` yields what each request's `output_kind` says. A dead engine
raises `EngineDeadError` out of both. `lora_request=` (one `LoRARequest` for every prompt,
or a list of one per prompt, None entries for the base model) runs prompts with LoRA
adapters (an engine built with enable_lora=True).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from arcjax.engine.build import build_engine
from arcjax.engine.engine_config import SCHEDULER_OPTIONS, EngineConfig
from arcjax.outputs import EmbeddingRequestOutput, RequestOutput
from arcjax.engine.trace import attention_report, layer_loop_report, summarize, write_jsonl
from arcjax.entrypoints.chat_template import ChatTemplate, ChatTemplateError
from arcjax.errors import EngineDeadError, RequestError
from arcjax.lora.lora_request import LoRARequest
from arcjax.model.kv_report import kv_cache_report
from arcjax.model.quant import storage_dtypes
from arcjax.pooling_params import PoolingParams
from arcjax.sampling_params import SamplingParams
from arcjax.sampling_params import RequestOutputKind


class LLM:
    """A model plus engine. `LLM(model=None, **options)` loads the packaged default model.

    Args:
      model: a Hugging Face-format directory (config.json, *.safetensors, tokenizer.json),
        a GGUF file (or a directory holding one), or a Hub id "org/name" (`revision=`).
      **options: engine options (see `arcjax.engine.engine_config.EngineConfig`): revision,
        quantization ("fp8" | "int8" | "dequantize"), kv_cache_dtype ("auto" | "fp8"), dtype,
        max_model_len, num_kv_blocks, kv_memory_fraction, block_size, attention_impl, seed,
        cache_dir, trace_capacity, and the scheduler knobs policy, max_num_batched_tokens,
        max_num_seqs, prefill_max_seqs, prefill_floor_steps, chunk_tile,
        long_prefill_token_threshold, max_num_partial_prefills, watermark_blocks.
        ARC_PREFILL_MAX_SEQS / ARC_PREFILL_FLOOR_STEPS fill their knobs unless given here.
    """

    def __init__(self, model: str | os.PathLike | None = None, **options):
        self.engine_config = EngineConfig.from_options(model, **options)
        self.engine = build_engine(self.engine_config)
        self.model_dir = self.engine.model_dir
        self.config = self.engine.runner.cfg
        self.tokenizer = self.engine.tokenizer
        self._chat_template: ChatTemplate | None = None  # read on the first chat()
        self.scheduler_options = {k: getattr(self.engine.sched_config, k)
                                  for k in SCHEDULER_OPTIONS}

    # --- online use -------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, *,
                    lora_request: LoRARequest | None = None) -> str:
        return self.engine.add_request(prompt, params, request_id, arrival_time,
                                       lora_request=lora_request)

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
    def _normalize(self, prompts, sampling_params, params_type: type = SamplingParams,
                   field: str = "sampling_params", lora_request=None
                   ) -> tuple[list, list, list]:
        """(prompts, their params, their LoRARequests or None), checked."""
        single = (isinstance(prompts, str) or (isinstance(prompts, np.ndarray) and prompts.ndim == 1)
                  or (isinstance(prompts, (list, tuple)) and len(prompts) > 0
                      and all(isinstance(t, (int, np.integer)) for t in prompts)))
        if single:
            prompts = [prompts]
        elif isinstance(prompts, np.ndarray) and prompts.ndim == 2:
            prompts = list(prompts)
        elif not isinstance(prompts, (list, tuple)):
            raise RequestError("prompts", "must be a prompt or a list of prompts, got "
                               f"{type(prompts).__name__}")
        if sampling_params is None or isinstance(sampling_params, params_type):
            sampling_params = [sampling_params] * len(prompts)
        if not isinstance(sampling_params, (list, tuple)) or len(sampling_params) != len(prompts):
            raise RequestError(field, f"expected one {params_type.__name__} or "
                               f"{len(prompts)} of them")
        params = [sp if sp is not None else params_type() for sp in sampling_params]
        bad = next((sp for sp in params if not isinstance(sp, params_type)), None)
        if bad is not None:
            raise RequestError(field, f"expected {params_type.__name__}, got "
                               f"{type(bad).__name__}")
        loras = lora_request
        if loras is None or isinstance(loras, LoRARequest):
            loras = [loras] * len(prompts)
        if not isinstance(loras, (list, tuple)) or len(loras) != len(prompts):
            raise RequestError("lora_request", f"expected one LoRARequest (or None) or "
                               f"{len(prompts)} of them")
        for p, sp, lr in zip(prompts, params, loras):  # all-or-nothing: check before queueing
            self.engine.check(p, sp, lr)
        return list(prompts), params, list(loras)

    def _run(self, prompts, sampling_params, ids: list[str],
             kind: RequestOutputKind | None = None, params_type: type = SamplingParams,
             field: str = "sampling_params", lora_request=None) -> Iterator[RequestOutput]:
        """Submits every prompt with a collecting sink (their ids appended to `ids`, in
        prompt order; `kind`, when given, replaces each request's output kind); yields
        outputs as steps complete; aborts what is left if the caller stops early."""
        prompts, params, loras = self._normalize(prompts, sampling_params, params_type, field,
                                                 lora_request)
        if kind is not None:
            params = [dataclasses.replace(p, output_kind=kind) for p in params]
        inbox: list[RequestOutput] = []
        try:
            for p, sp, lr in zip(prompts, params, loras):
                ids.append(self.engine.add_request(p, sp, sink=inbox.append, lora_request=lr))
            left = set(ids)
            while left:
                self.engine.run_step()
                outs, inbox[:] = list(inbox), []
                for out in outs:
                    if out.finished:
                        left.discard(out.request_id)
                    yield out
        finally:
            for rid in ids:
                try:
                    self.engine.abort(rid)
                except (RequestError, EngineDeadError):  # finished already, or all gone
                    pass

    def stream(self, prompts, sampling_params=None, *,
               lora_request=None) -> Iterator[RequestOutput]:
        """Yields the outputs of these prompts as steps complete (as each request's
        `output_kind` says; `delta_text` is the new text in every kind). Closing the
        iterator early aborts the requests still running.

        Raises:
          EngineDeadError: the engine died (its requests are gone).
        """
        yield from self._run(prompts, sampling_params, [], lora_request=lora_request)

    def generate(self, prompts: str | Sequence, sampling_params=None, *,
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """Generates for every prompt; returns final outputs in prompt order (whatever
        their `output_kind`: each carries everything its request generated).

        Raises:
          RequestError: a prompt or its params are refused (nothing is queued).
          EngineDeadError: the engine died (its requests are gone).
        """
        from tqdm.auto import tqdm

        ids: list[str] = []
        final: dict[str, RequestOutput] = {}
        generated = 0
        with tqdm(disable=not use_tqdm, desc="generate", unit="req") as bar:
            for out in self._run(prompts, sampling_params, ids, RequestOutputKind.FINAL_ONLY,
                                 lora_request=lora_request):
                if out.finished:
                    final[out.request_id] = out
                    generated += len(out.token_ids)
                    bar.update(1)
                    rate = bar.format_dict.get("elapsed") or 0
                    bar.set_postfix(tok_s=f"{generated / rate:.1f}" if rate else "-")
        return [final[rid] for rid in ids]

    def embed(self, prompts: str | Sequence, pooling_params=None, *,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """Embeds every prompt (text or token ids); returns one `EmbeddingRequestOutput`
        per prompt, in order (`out.outputs.embedding`: the vector). Needs an engine built
        with runner="pooling"; the prompts run as prefill-only rows, batched with any
        generation requests in the same steps. A request that did not finish normally has
        `outputs` None and says why (`finish_reason`, `error`).

        Args:
          pooling_params: one `PoolingParams` (dimensions, normalize) for every prompt, a
            list of them, or None (the model's pooling as it is).

        Raises:
          RequestError: a prompt or its params are refused (nothing is queued), or the
            engine does not pool (field "params").
          EngineDeadError: the engine died (its requests are gone).
        """
        from tqdm.auto import tqdm

        ids: list[str] = []
        final: dict[str, EmbeddingRequestOutput] = {}
        with tqdm(disable=not use_tqdm, desc="embed", unit="req") as bar:
            for out in self._run(prompts, pooling_params, ids, params_type=PoolingParams,
                                 field="pooling_params"):
                final[out.request_id] = EmbeddingRequestOutput.from_base(out)
                bar.update(1)
        return [final[rid] for rid in ids]

    def chat(self, messages, sampling_params=None, *, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None, chat_template_kwargs: Mapping | None = None,
             tools: list | None = None, lora_request=None,
             **template_kwargs) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} dicts) or a
        list of conversations; returns one output per conversation, in order.

        The model's chat template (tokenizer_config.json `chat_template`, or
        chat_template.jinja; `chat_template`: another one, its text or file) is rendered in
        jinja2's sandbox as transformers' `apply_chat_template` does
        (`arcjax.entrypoints.chat_template`), with `tools`, `chat_template_kwargs` (vLLM's:
        e.g. {"enable_thinking": False}) and any other keyword, then tokenized without adding
        special tokens (the template prints them). `continue_final_message` leaves the last
        message open for the model to continue. `output.prompt` is the rendered text; with a
        reasoning parser (the engine's `reasoning_parser`) each completion carries
        `reasoning` and `content`.

        Raises:
          ChatTemplateError (field "messages"): no template, or the template refused the
            conversation. RequestError: a malformed conversation or bad sampling_params.
        """
        if self.tokenizer is None or self.model_dir is None:
            raise ChatTemplateError("messages", "chat needs a model directory with a tokenizer")
        if isinstance(messages, (list, tuple)) and messages and all(
                isinstance(m, Mapping) for m in messages):
            conversations = [messages]
        elif isinstance(messages, (list, tuple)) and messages and all(
                isinstance(c, (list, tuple)) and c and all(isinstance(m, Mapping) for m in c)
                for c in messages):
            conversations = list(messages)
        else:
            raise RequestError("messages", "must be a conversation (a non-empty list of "
                               "message dicts) or a list of conversations")
        if self._chat_template is None:
            self._chat_template = ChatTemplate.from_dir(self.engine_config.tokenizer
                                                        or self.model_dir)
        template = (self._chat_template if chat_template is None else ChatTemplate.from_source(
            chat_template, self._chat_template.special_tokens))
        kwargs = {**(chat_template_kwargs or {}), **template_kwargs}
        if tools is not None:
            kwargs["tools"] = tools
        texts = [template.render(c, add_generation_prompt=add_generation_prompt,
                                 continue_final_message=continue_final_message, **kwargs)
                 for c in conversations]
        ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        outs = self.generate(ids, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)
        return [dataclasses.replace(o, prompt=t) for o, t in zip(outs, texts)]

    # --- trace ------------------------------------------------------------------------
    def trace_summary(self, wall_time: float) -> dict:
        """The trace's run summary (`arcjax.engine.trace.summarize`) with the weights' and
        KV pages' storage dtypes, the KV bytes per token (`kv_cache_report`), how packed
        weights multiply (`packed_matmul`: "xla" or the W4A16 kernel,
        `arcjax.model.packed_matmul`), how the traced steps ran the layers (`layer_loop`,
        per bucket kind: `arcjax.engine.trace.layer_loop_report`) and the attention
        implementation they ran (`attention`, per bucket kind:
        `arcjax.engine.trace.attention_report`)."""
        configured = {k: v for k, v in self.scheduler_options.items()
                      if k in ("prefill_max_seqs", "prefill_floor_steps",
                               "long_prefill_token_threshold") and v}
        records = list(self.engine.trace)
        summary = summarize(records, wall_time, configured)
        runner = self.engine.runner
        return {**summary, **storage_dtypes(runner.params, runner.cache),
                **kv_cache_report(runner.cfg, runner.kv_cache_dtype),
                "packed_matmul": runner.matmul_impl,
                "layer_loop": layer_loop_report(runner.layer_loop, dict(runner.layer_loops),
                                                records),
                "attention": attention_report(runner.attn_impl, dict(runner.attention_impls),
                                              records, dict(runner.attention_verified))}

    def export_trace(self, path) -> None:
        write_jsonl(self.engine.trace, path)
