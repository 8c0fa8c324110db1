"""Input processing: a request as submitted -> validated, tokenized engine state.

1. `check(prompt, params)`: the prompt is tokenized (text) or type-checked (token ids),
   cut to its last `truncate_prompt_tokens` tokens when asked, and checked against the
   model (vocabulary, max_model_len; the token ids of logit_bias, allowed_token_ids,
   stop_token_ids); every refusal is a `RequestError` naming the field and the limit.
   A structured-output constraint is compiled here (or found in the grammar cache): one
   that cannot compile is a `StructuredOutputsError` naming its field. An embedding
   request (`PoolingParams`) needs an engine built with runner="pooling"; its
   `dimensions` must be one the model allows. A LoRA adapter (`lora_request`) is loaded
   and validated here too (the engine's `AdapterCache`, `check_adapter`): a bad one is a
   `LoRAAdapterError` naming the adapter and the field.
2. `build(...)`: the request's `RequestState` (with its incremental detokenizer, its
   reasoning split, its bad words' ids and its host mask: the structured-output grammar,
   behind the reasoning gate, stacked with multi-token bad words; its LoRA adapter pinned)
   and its
   `scheduler.Request` (an embedding's: prefill only, `pooling=True`, with its
   `PooledState`), or, for n > 1, the `RequestGroup` of its n children (child i has
   seed `seed + i`; with prefix caching only child 0 enters the scheduler at once, the
   others once its prompt is computed, so they hit the prefix cache: `engine/group.py`).
3. The inbox items the core drains (`NewRequest`, `NewGroup`, `Abort`), and their wire
   form for multi-host runs (`to_wire` on the leader, `from_wire` on the followers).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np

import scheduler
from arcjax.engine.group import RequestGroup, child_id, child_seed
from arcjax.engine.pooled_state import PooledState
from arcjax.engine.request_state import RequestState
from arcjax.engine.tokenizer import Tokenizer, make_detokenizer
from arcjax.errors import (LoRAAdapterError, PoolingParamsError, RequestError,
                           StructuredOutputsError)
from arcjax.lora.adapter_cache import AdapterCache
from arcjax.lora.lora_request import LoRARequest
from arcjax.model.formats.pooler_config import PoolerConfig
from arcjax.pooling_params import PoolingParams
from arcjax.reasoning.abstract_reasoning_parser import PROMPT_TAIL_TOKENS
from arcjax.reasoning.model_reasoning import ModelReasoning
from arcjax.sampling_params import RequestOutputKind, SamplingParams
from arcjax.structured import StructuredOutputManager
from arcjax.structured.bad_words import BadWordsMask, bad_word_ids
from arcjax.structured.mask_source import stack

# What a pooling request's state carries as its sampling params: its one row samples nothing.
POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0,
                                  output_kind=RequestOutputKind.FINAL_ONLY)


@dataclasses.dataclass(frozen=True)
class NewRequest:
    state: RequestState
    request: scheduler.Request


@dataclasses.dataclass(frozen=True)
class NewGroup:
    group: RequestGroup
    entering: list  # (RequestState, scheduler.Request) pairs that enter the scheduler now


@dataclasses.dataclass(frozen=True)
class Abort:
    request_id: str


class InputProcessor:
    """Validation, tokenization and request-state construction (any thread: no state).

    Args:
      tokenizer: the model's tokenizer, or None (token-id prompts only).
      vocab_size, max_model_len: the model's limits.
      sched_config: the scheduler's config (its own request checks).
      seed: seeds requests whose SamplingParams have no seed (with the request id).
      structured: compiles structured-output constraints (None: they are refused).
      reasoning: the model's reasoning parser (`arcjax.reasoning.model_reasoning`), or None.
      adapters: the loaded LoRA adapters (None: LoRA is off, `lora_request` is refused).
      pooler: how the model pools (runner="pooling"); None = embeddings are refused.
      hidden_size: the pooled vectors' size (what `dimensions` may not exceed).
    """

    def __init__(self, tokenizer: Tokenizer | None, vocab_size: int, max_model_len: int,
                 sched_config: scheduler.SchedulerConfig, seed: int = 0,
                 structured: StructuredOutputManager | None = None,
                 reasoning: ModelReasoning | None = None,
                 pooler: PoolerConfig | None = None, hidden_size: int = 0,
                 adapters: AdapterCache | None = None):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.sched_config, self.seed, self.structured = sched_config, seed, structured
        self.reasoning = reasoning
        self.pooler, self.hidden_size = pooler, hidden_size
        self.adapters = adapters

    def check_adapter(self, lora_request: LoRARequest | None) -> None:
        """Loads and validates a request's LoRA adapter (None: the base model).

        Raises:
          LoRAAdapterError: LoRA is off, or the adapter is refused (adapter and field named).
        """
        if lora_request is None:
            return
        if self.adapters is None:
            name = getattr(lora_request, "lora_name", str(lora_request))
            raise LoRAAdapterError(str(name), "lora_request", "LoRA is not enabled: build the "
                                   "engine with enable_lora=True")
        self.adapters.check(lora_request)

    def check(self, prompt, params: SamplingParams | PoolingParams
              ) -> tuple[str | None, tuple[int, ...]]:
        """Validates a request without queueing it. Returns (prompt text, token ids).

        Raises:
          RequestError (a ValueError naming `.field`): the request is refused.
        """
        if isinstance(params, PoolingParams):
            return self._check_pooling(prompt, params)
        if not isinstance(params, SamplingParams):
            raise RequestError("params", f"must be a SamplingParams or a PoolingParams, got "
                               f"{type(params).__name__}")
        keep = params.truncate_prompt_tokens
        text, ids = self._tokenize(prompt, check_length=keep is None)
        vocab, limit = self.vocab_size, self.max_model_len
        if keep is not None:  # vLLM: the last k tokens (-1: max_model_len of them)
            ids = ids[-(limit if keep == -1 else keep):]
        if len(ids) > limit:
            raise RequestError("prompt", f"{len(ids)} tokens, more than max_model_len "
                               f"{limit}", limit=limit)
        if len(ids) + params.max_tokens > limit:
            raise RequestError("max_tokens", f"prompt ({len(ids)} tokens) + max_tokens "
                               f"({params.max_tokens}) exceeds max_model_len {limit}",
                               limit=limit - len(ids))
        self._check_vocabulary(ids)
        for field, tokens in (("stop_token_ids", params.stop_token_ids),
                              ("logit_bias", params.logit_bias or ()),
                              ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(not t < vocab for t in tokens):
                raise RequestError(field, f"token ids must be in [0, {vocab})", limit=vocab)
        if params.bad_words and self.tokenizer is None:
            raise RequestError("bad_words", "needs the model's tokenizer")
        if params.structured_outputs is not None:
            if self.structured is None:
                raise StructuredOutputsError("structured_outputs", "not available here")
            self.structured.check(params.structured_outputs)
        return text, ids

    def _checked_prompt(self, prompt) -> tuple[str | None, tuple[int, ...]]:
        """The prompt tokenized, at most max_model_len tokens."""
        text, ids = self._tokenize(prompt)
        limit = self.max_model_len
        if len(ids) > limit:
            raise RequestError("prompt", f"{len(ids)} tokens, more than max_model_len "
                               f"{limit}", limit=limit)
        return text, ids

    def _check_vocabulary(self, ids: tuple[int, ...]) -> None:
        vocab = self.vocab_size
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError("prompt", f"token id {bad} is outside the vocabulary "
                               f"[0, {vocab})", limit=vocab)

    def _check_pooling(self, prompt, params: PoolingParams) -> tuple[str | None, tuple[int, ...]]:
        """An embedding request's checks: the engine pools, the prompt fits, `dimensions`
        is one the model allows."""
        pooler = self.pooler
        if pooler is None:
            raise RequestError("params", "embeddings need an engine built with "
                               "runner='pooling'")
        d = params.dimensions
        if d is not None:
            if not pooler.is_matryoshka:
                raise PoolingParamsError("dimensions", "the model does not support Matryoshka "
                                         "representations (its config.json sets neither "
                                         "matryoshka_dimensions nor is_matryoshka)")
            if d > self.hidden_size:
                raise PoolingParamsError("dimensions", f"{d} exceeds the model's hidden size "
                                         f"{self.hidden_size}", limit=self.hidden_size)
            allowed = pooler.matryoshka_dimensions
            if allowed is not None and d not in allowed:
                raise PoolingParamsError("dimensions", f"{d} is not one of the model's "
                                         f"matryoshka_dimensions {list(allowed)}")
        text, ids = self._checked_prompt(prompt)
        self._check_vocabulary(ids)
        return text, ids

    def encode(self, text: str, add_special_tokens: bool = True,
               check_length: bool = True) -> tuple[int, ...]:
        """The token ids of a text prompt. A text too long to fit max_model_len whatever
        its tokens is refused before it is tokenized: no token covers more characters than
        the vocabulary's longest entry (twice that, for normalizers that merge characters);
        `check_length=False` skips that (the prompt is truncated afterwards).

        Raises:
          RequestError (field "prompt"): no tokenizer, text that cannot be encoded, empty,
            or longer than max_model_len can hold.
        """
        if self.tokenizer is None:
            raise RequestError("prompt", "a string prompt needs a tokenizer; pass token ids")
        if check_length:
            self.check_text_length(len(text))
        try:
            text.encode("utf-8")
            ids = tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        except (UnicodeError, TypeError) as e:
            raise RequestError("prompt", f"text cannot be encoded ({e})") from None
        if not ids:
            raise RequestError("prompt", "must not be empty", limit=1)
        return ids

    @property
    def max_text_chars(self) -> int | None:
        """Characters no prompt that fits max_model_len can exceed: no token covers more
        than the vocabulary's longest entry (twice that, for normalizers that merge
        characters); None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return 2 * self.tokenizer.max_token_chars * self.max_model_len

    def check_text_length(self, chars: int, field: str = "prompt") -> None:
        """Refuses text of `chars` characters that cannot fit max_model_len, before it is
        tokenized (or rendered).

        Raises:
          RequestError (`field`): too long whatever its tokens.
        """
        limit = self.max_text_chars
        if limit is not None and chars > limit:
            per_token = limit // self.max_model_len
            raise RequestError(field, f"{chars} characters: more than {chars // per_token} "
                               f"tokens, more than max_model_len {self.max_model_len}",
                               limit=self.max_model_len)

    def _tokenize(self, prompt, check_length: bool = True) -> tuple[str | None, tuple[int, ...]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt, check_length=check_length)
        if check_length and isinstance(prompt, (list, tuple, np.ndarray)) and (
                len(prompt) > self.max_model_len):  # refused before it is read token by token
            raise RequestError("prompt", f"{len(prompt)} tokens, more than max_model_len "
                               f"{self.max_model_len}", limit=self.max_model_len)
        if isinstance(prompt, np.ndarray):
            if prompt.ndim != 1 or not np.issubdtype(prompt.dtype, np.integer):
                raise RequestError("prompt", f"a token-id array must be 1-D integers, got "
                                   f"{prompt.dtype} with shape {prompt.shape}")
            ids = tuple(int(t) for t in prompt)
        elif isinstance(prompt, (list, tuple)):
            bad = next((t for t in prompt if not isinstance(t, (int, np.integer))
                        or isinstance(t, (bool, np.bool_))), None)
            if bad is not None:
                raise RequestError("prompt", f"token ids must be ints, got {bad!r}")
            ids = tuple(int(t) for t in prompt)
        else:
            raise RequestError("prompt", "must be a string or a list of token ids, got "
                               f"{type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt", "must not be empty", limit=1)
        return None, ids

    @staticmethod
    def check_options(request_id, arrival, priority) -> None:
        """The submission options' types (RequestError naming the bad one)."""
        if request_id is not None and (not isinstance(request_id, (str, int))
                                       or isinstance(request_id, bool)):
            raise RequestError("request_id", f"must be a str, got {request_id!r}")
        if not isinstance(arrival, (int, float)) or isinstance(arrival, bool):
            raise RequestError("arrival_time", f"must be a number, got {arrival!r}")
        if not isinstance(priority, (int, np.integer)) or isinstance(priority, (bool, np.bool_)):
            raise RequestError("priority", f"must be an int, got {priority!r}")

    def build(self, request_id: str, text, ids: tuple[int, ...],
              params: SamplingParams | PoolingParams, arrival: float, priority: int,
              sink, lora_request: LoRARequest | None = None) -> NewRequest | NewGroup:
        """The inbox item of one validated request (its scheduler checks run here; its
        adapter, checked by `check_adapter`, is pinned once per sample).

        Raises:
          RequestError: the scheduler refuses the request (e.g. it can never fit).
        """
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise LoRAAdapterError(lora_request.lora_name, "lora_request", "embedding "
                                       "requests run the base model (no adapters yet)")
            return self._build_pooling(request_id, text, ids, params, arrival, priority, sink)
        request = scheduler.Request(request_id=request_id, prompt_token_ids=ids,
                                    max_tokens=params.max_tokens, arrival_time=arrival,
                                    priority=int(priority))
        scheduler.validate_request(request, self.sched_config)
        seed = params.seed if params.seed is not None else zlib.crc32(
            f"{self.seed}:{request_id}".encode())
        if params.n == 1:
            state = self.state(request_id, text, ids, params, seed, arrival)
            state.sink = sink
            state.adapter = self._pin(lora_request, 1)[0]  # last: nothing raises after
            if state.adapter is not None:
                request = dataclasses.replace(request, adapter=state.adapter.key)
            return NewRequest(state, request)
        states = []
        for i in range(params.n):
            cp = dataclasses.replace(params, n=1, seed=child_seed(seed, i), prompt_logprobs=(
                params.prompt_logprobs if i == 0 else None))  # the group reports child 0's
            states.append(self.state(child_id(request_id, i), text, ids, cp, cp.seed, arrival))
        refs = self._pin(lora_request, params.n)  # last: nothing raises after
        if refs[0] is not None:
            request = dataclasses.replace(request, adapter=refs[0].key)
        pairs = []
        for i, (state, ref) in enumerate(zip(states, refs)):
            state.index, state.parent_id, state.adapter = i, request_id, ref
            pairs.append((state, dataclasses.replace(request, request_id=state.request_id)))
        hold = 1 if self.sched_config.enable_prefix_caching else params.n
        group = RequestGroup(request_id, [st for st, _ in pairs], pairs[hold:], sink)
        return NewGroup(group, pairs[:hold])

    def _pin(self, lora_request: LoRARequest | None, n: int) -> list:
        """n pins of the adapter (one per sample), or n Nones for the base model; all or
        none (a failed load releases what it pinned)."""
        if lora_request is None:
            return [None] * n
        refs = []
        try:
            for _ in range(n):
                refs.append(self.adapters.acquire(lora_request))
        except BaseException:
            for ref in refs:
                self.adapters.release(ref)
            raise
        return refs
    def _build_pooling(self, request_id: str, text, ids: tuple[int, ...],
                       params: PoolingParams, arrival: float, priority: int,
                       sink) -> NewRequest:
        """An embedding request: prefill only in the scheduler, no detokenizer, no seed."""
        request = scheduler.Request(request_id=request_id, prompt_token_ids=ids, max_tokens=0,
                                    arrival_time=arrival, priority=int(priority), pooling=True)
        scheduler.validate_request(request, self.sched_config)
        state = RequestState(request_id, text, ids, POOLING_SAMPLING, 0, float(arrival), None)
        normalize = self.pooler.normalize if params.normalize is None else params.normalize
        state.pooling = PooledState(params, self.pooler.pooling_type, normalize)
        state.sink = sink
        return NewRequest(state, request)

    def state(self, rid: str, text, ids, params: SamplingParams, seed: int,
              arrival: float) -> RequestState:
        """A fresh request state (with its detokenizer when there is a tokenizer)."""
        detok = make_detokenizer(
            self.tokenizer, ids, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens,
        ) if self.tokenizer else None
        state = RequestState(rid, text, ids, params, seed, float(arrival), detok)
        if self.reasoning is not None:
            tail = self.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
            state.reasoning = self.reasoning.request(tail, params.skip_special_tokens)
        grammar = None
        if params.structured_outputs is not None:
            grammar = self.structured.grammar(params.structured_outputs)
            if state.reasoning is not None:
                grammar = state.reasoning.gate(grammar)
        bad_words = None
        if params.bad_words:
            sequences = [s for s in bad_word_ids(params.bad_words, lambda w: self.tokenizer.encode(
                w, add_special_tokens=False)) if max(s) < self.vocab_size]  # others never sampled
            state.banned_ids = tuple(s[0] for s in sequences if len(s) == 1)
            if any(len(s) > 1 for s in sequences):
                bad_words = BadWordsMask(sequences)
        state.grammar = stack(grammar, bad_words)
        return state

    # --- multi-host wire form ------------------------------------------------------------
    @staticmethod
    def to_wire(items: list) -> list[tuple]:
        """Inbox items as plain tuples (n == 1 only: n > 1 is refused across hosts)."""
        return [("add", it.state.request_id, it.state.prompt, it.state.prompt_ids,
                 it.state.params, it.state.seed, it.state.arrival, it.request.priority)
                if isinstance(it, NewRequest) else ("abort", it.request_id) for it in items]

    def from_wire(self, wire: list[tuple]) -> list:
        """The leader's inbox items, rebuilt on a follower."""
        items = []
        for item in wire:
            if item[0] == "abort":
                items.append(Abort(item[1]))
                continue
            _, rid, text, ids, params, seed, arrival, priority = item
            request = scheduler.Request(request_id=rid, prompt_token_ids=ids,
                                        max_tokens=params.max_tokens, arrival_time=arrival,
                                        priority=priority)
            items.append(NewRequest(self.state(rid, text, ids, params, seed, arrival), request))
        return items
