"""A validated request (`protocol.py`) -> what the engine runs (`ParsedRequest`).

`parse_completion(raw, ...)` / `parse_chat(raw, ...)` validate the body, refuse the vLLM
fields arcjax cannot honour (`REFUSED`, unless they carry their neutral value), and build
the request's `SamplingParams`: the request's values, else the model's
`generation_config.json` defaults (`GenerationDefaults`, vLLM's `--generation-config
auto`), else OpenAI's. Chat requests also get their template inputs (messages ready for
the template, `tool_calls.ToolPlan`, template kwargs: `chat_template_kwargs`, `documents`,
`reasoning_effort`, which turns `enable_thinking` on unless it is "none", as vLLM does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from arcjax.entrypoints.openai import structured_fields
from arcjax.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                ProtocolError, SamplingFields, parse_body)
from arcjax.entrypoints.openai.tool_calls import ToolPlan, plan_tools, template_messages
from arcjax.errors import SamplingParamsError
from arcjax.sampling_params import INT32_MAX, SamplingParams

DEFAULT_MAX_STOP_STRINGS = 16
# vLLM request fields arcjax cannot honour, with the values that mean "not used".
REFUSED = {"use_beam_search": (False,), "length_penalty": (1.0, 1), "watermarking": (None, False),
           "truncation_side": (None, "left"), "logprob_token_ids": (None,),
           "routed_experts_prompt_start": (0,), "kv_transfer_params": (None,),
           "ec_transfer_params": (None,), "vllm_xargs": (None, {}), "cache_salt": (None,),
           "repetition_detection": (None,), "thinking_token_budget": (None, -1),
           "stream_interval": (None, 1), "best_of": (None, 1), "functions": (None, []),
           "function_call": (None, "none"), "suffix": (None, ""), "prompt_embeds": (None,),
           "media_io_kwargs": (None, {}), "mm_processor_kwargs": (None, {}),
           "logits_processors": (None, []), "structural_tag": (None,)}
# chat fields a completion request may carry only with their neutral values
COMPLETION_REFUSED = {"top_logprobs": (None, 0), "tools": (None, []),
                      "tool_choice": (None, "none"), "parallel_tool_calls": (None,)}
# request field -> SamplingParams field (the same name unless given)
_SAMPLING = ("presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids",
             "ignore_eos", "min_tokens", "n", "skip_special_tokens",
             "spaces_between_special_tokens", "include_stop_str_in_output",
             "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "prompt_logprobs")
DEFAULTED = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# max_tokens of a request that leaves it to the server until its prompt's length is known
# (the largest SamplingParams allows, so min_tokens is checked against the real value)
UNTIL_FILLED = INT32_MAX


@dataclasses.dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults for requests that leave a field unset: `values` ({SamplingParams
    field: value}: temperature, top_p, top_k, min_p, repetition_penalty) and `max_tokens`
    (generation_config's max_new_tokens: the default when a request gives none)."""

    values: Mapping[str, float | int] = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """What a request asks the engine for.

    Attributes:
      request: the validated body.
      params: its sampling parameters (max_tokens: as given or defaulted; chat's default
        is filled in once the prompt's length is known).
      prompts: completions: text or token ids per prompt; chat: ().
      max_tokens_field: how the client spelled max_tokens (for error messages), and
        max_tokens_given: whether it gave one.
      fill_max_tokens: max_tokens is up to the context left after the prompt (chat
        without one, completions with null), capped by generation_config's default.
      ignored: unknown fields, accepted and ignored (sorted).
      messages, tools, template_kwargs: chat: the template's inputs.
      constraint: the output constraint and the field it came from.
    """

    request: CompletionRequest | ChatCompletionRequest
    params: SamplingParams
    prompts: tuple = ()
    max_tokens_field: str = "max_tokens"
    max_tokens_given: bool = False
    fill_max_tokens: bool = False
    ignored: tuple[str, ...] = ()
    messages: tuple = ()
    tools: ToolPlan | None = None
    template_kwargs: Mapping = dataclasses.field(default_factory=dict)
    constraint: structured_fields.Constraint = structured_fields.Constraint(None, None)

    @property
    def stream(self) -> bool:
        return bool(self.request.stream)

    @property
    def include_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and (opts.include_usage or opts.continuous_usage_stats))

    @property
    def continuous_usage(self) -> bool:
        opts = self.request.stream_options
        return bool(opts and opts.continuous_usage_stats)


def _refuse_unhonoured(req: SamplingFields, refused: Mapping = REFUSED) -> None:
    for name, neutral in refused.items():
        value = getattr(req, name, None)
        if not any(type(value) is type(v) and value == v for v in neutral):
            raise ProtocolError(name, f"not supported by this server (got {value!r})")


def _logit_bias(bias: Mapping[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(k): v for k, v in bias.items()}
    except ValueError:
        raise ProtocolError("logit_bias", f"keys must be token ids, got {sorted(bias)!r}") from None


def _params(req: SamplingFields, max_field: str, max_tokens: int, logprobs: int | None,
            defaults: GenerationDefaults, constraint, max_stop_strings: int,
            logprobs_field: str = "logprobs") -> SamplingParams:
    stop = req.stop
    if isinstance(stop, list) and len(stop) > max_stop_strings:
        raise ProtocolError("stop", f"at most {max_stop_strings} stop strings, got {len(stop)}",
                            limit=max_stop_strings)
    if req.prompt_logprobs is not None and req.stream:
        raise ProtocolError("prompt_logprobs", "not available when stream is true")
    kwargs = {name: getattr(req, name) for name in _SAMPLING if getattr(req, name) is not None}
    for name in DEFAULTED:
        value = getattr(req, name)
        if value is None:
            value = defaults.values.get(name)
        if value is not None:
            kwargs[name] = value
    try:
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs,
                              logit_bias=_logit_bias(req.logit_bias),
                              structured_outputs=constraint.params)
    except SamplingParamsError as e:
        field = {"max_tokens": max_field, "logprobs": logprobs_field}.get(e.field, e.field)
        raise SamplingParamsError(field, e.message, limit=e.limit) from None


def parse_completion(raw: bytes, defaults: GenerationDefaults = GenerationDefaults(),
                     max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS) -> ParsedRequest:
    """A /v1/completions body. Raises InputError naming the field."""
    req = parse_body(CompletionRequest, raw)
    _refuse_unhonoured(req, {**REFUSED, **COMPLETION_REFUSED})
    constraint = structured_fields.constraint_from_request(req)
    given = "max_tokens" in req.model_fields_set and req.max_tokens is not None
    fill = "max_tokens" in req.model_fields_set and req.max_tokens is None
    # (fill: set per prompt, from the context left)
    max_tokens = UNTIL_FILLED if req.max_tokens is None else req.max_tokens
    if req.echo and max_tokens == 0:  # vLLM: echo the prompt, generate nothing
        max_tokens = 1
    logprobs = req.logprobs
    params = _params(req, "max_tokens", max_tokens, logprobs, defaults, constraint,
                     max_stop_strings)
    if req.echo and logprobs is not None and params.prompt_logprobs is None:
        params = dataclasses.replace(params, prompt_logprobs=logprobs)  # vLLM's echo
    return ParsedRequest(req, params, req.prompt, "max_tokens", given, fill,
                         req.extra_fields(), constraint=constraint)


def _chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """Chat's `logprobs: bool` and `top_logprobs: int` -> the top-k count, or None."""
    k = req.top_logprobs
    if k is not None and k != 0 and not req.logprobs:
        raise ProtocolError("top_logprobs", "requires logprobs: true")
    return (k or 0) if req.logprobs else None


def _template_kwargs(req: ChatCompletionRequest) -> dict:
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.setdefault("enable_thinking", req.reasoning_effort != "none")
    if req.documents is not None:
        kwargs["documents"] = req.documents
    return kwargs


def parse_chat(raw: bytes, defaults: GenerationDefaults = GenerationDefaults(),
               max_stop_strings: int = DEFAULT_MAX_STOP_STRINGS,
               tool_parser: str | None = None,
               check_text_length: Callable[[int, str], None] | None = None) -> ParsedRequest:
    """A /v1/chat/completions body. Raises InputError naming the field. `developer`
    messages become `system` ones (templates know that role); an assistant's
    `reasoning_content` / `reasoning` is passed under both names; `tool_parser`: the
    server's parser of the model's tool calls (None: "auto" refused);
    `check_text_length(chars, field)`: refuses a conversation whose text (contents and
    roles) is too long to ever fit, before anything else is done with it."""
    req = parse_body(ChatCompletionRequest, raw)
    if check_text_length is not None:
        check_text_length(sum(len(m.role) + (len(m.content) if isinstance(m.content, str)
                                             else sum(len(p.text or "") for p in m.content or ()))
                              for m in req.messages), "messages")
    _refuse_unhonoured(req)
    # vLLM: max_completion_tokens wins when both are given (max_tokens is deprecated)
    max_field = ("max_completion_tokens" if req.max_completion_tokens is not None
                 else "max_tokens")
    given = getattr(req, max_field) is not None
    messages = []
    for i, m in enumerate(req.messages):
        if m.function_call:
            raise ProtocolError(f"messages[{i}].function_call", "not supported by this server "
                                                                "(use tool_calls)")
        fields = {**m.model_dump(exclude_unset=True), "content": m.text(f"messages[{i}]")}
        fields.pop("function_call", None)
        if m.role == "developer":
            fields["role"] = "system"
        thought = fields.get("reasoning_content", fields.get("reasoning"))
        if thought is not None:
            fields["reasoning"] = fields["reasoning_content"] = thought
        messages.append(fields)
    tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, tool_parser)
    constraint = structured_fields.constraint_from_request(req, tools.constraint)
    params = _params(req, max_field, getattr(req, max_field) if given else UNTIL_FILLED,
                     _chat_logprobs(req), defaults, constraint, max_stop_strings, "top_logprobs")
    return ParsedRequest(req, params, (), max_field, given, not given, req.extra_fields(),
                         tuple(template_messages(messages)), tools, _template_kwargs(req),
                         constraint)
