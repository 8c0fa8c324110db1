"""The OpenAI / vLLM request bodies as pydantic models (vLLM's field names and defaults).

`CompletionRequest`, `ChatCompletionRequest`, `TokenizeRequest` and `DetokenizeRequest`
are validated straight from the body's JSON (`parse_body`: pydantic-core parses and checks
it in one pass, in the worker pool), in strict mode: `"n": "2"` is refused, not coerced.
The models also give the server its OpenAPI schema (`/openapi.json`, `/docs`).

NOTE: one place per check. The models check types and shapes; ranges are
`SamplingParams`' (`arcjax/sampling_params.py`) and lengths, vocabularies and grammars the
engine's (`Engine.check`); fields vLLM has and arcjax cannot honour are refused by name
unless neutral (`request_params.REFUSED`). Every refusal is an `InputError` naming the
request's own field (`messages[0].content`, `stream_options.include_usage`), so the server
answers 400 with `param` set. Fields neither vLLM nor arcjax knows are accepted and listed
(`extra_fields`), as vLLM does.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from arcjax.errors import RequestError

_NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,64}$")
PROMPT_FORMS = ("must be a string, a list of strings, a list of token ids or a list of lists of "
                "token ids (non-empty)")


def prompt_forms(v) -> tuple:
    """A prompt field's value (a completion's `prompt`, an embedding's `input`) as a tuple of
    prompts, each text or a tuple of token ids; ValueError(PROMPT_FORMS) for any other form."""
    if v is None:
        raise ValueError("is required")
    if isinstance(v, str):
        return (v,)
    if not v:
        raise ValueError(PROMPT_FORMS)
    if isinstance(v[0], int):
        return (tuple(v),)
    if any(isinstance(p, list) and not p for p in v):
        raise ValueError(PROMPT_FORMS)
    return tuple(p if isinstance(p, str) else tuple(p) for p in v)


class ProtocolError(RequestError):
    """A request body the server refuses (field: the request's own field name)."""


class OpenAIBaseModel(BaseModel):
    """Strict types; fields the model does not declare are kept (`extra_fields`)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    def extra_fields(self) -> tuple[str, ...]:
        return tuple(sorted(self.model_extra or ()))


class ClosedModel(BaseModel):
    """A nested object whose unknown fields are refused (naming them)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class StreamOptions(ClosedModel):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _known(cls, data):
        if isinstance(data, dict) and set(data) - {"include_usage", "continuous_usage_stats"}:
            raise ValueError(f"only include_usage and continuous_usage_stats are supported, "
                             f"got {data!r}")
        return data


class JsonSchemaSpec(ClosedModel):
    name: str
    json_schema: dict | bool = Field(default_factory=lambda: {"type": "object"},
                                     alias="schema")  # OpenAI: a missing schema = {}
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(ClosedModel):
    type: str
    json_schema: JsonSchemaSpec | None = None

    @field_validator("type")
    @classmethod
    def _type(cls, v: str) -> str:
        if v == "structural_tag":
            raise ValueError("\"structural_tag\" is not supported by this server")
        if v not in ("text", "json_object", "json_schema"):
            raise ValueError(f"must be \"text\", \"json_object\" or \"json_schema\", got {v!r}")
        return v

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type \"json_schema\" needs json_schema: {name, schema}")
        return self


class StructuredOutputsField(ClosedModel):
    """vLLM's `structured_outputs` object: one constraint, and/or JSON options."""

    json_: dict | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False  # accepted: there is one backend and no fallback
    structural_tag: Any = None

    @field_validator("structural_tag")
    @classmethod
    def _no_structural_tag(cls, v):
        if v is not None:
            raise ValueError("structural tags are not supported by this server")
        return v


class FunctionDefinition(OpenAIBaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"must be 1-64 characters of a-z, A-Z, 0-9, _ . -; got {v!r}")
        return v


class ToolParam(OpenAIBaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ContentPart(OpenAIBaseModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIBaseModel):
    """One message; `content` may be text parts (joined with newlines by `text`); keys the
    chat template may read (name, tool_calls, tool_call_id, reasoning) pass through.

    NOTE: typed, with no Python validator: pydantic-core checks a long conversation without
    Python code per message (a body of 100k messages holds the GIL once, briefly)."""

    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list | None = None
    function_call: Any = None

    def text(self, where: str) -> str:
        """The content as one string ("" for none). Raises ProtocolError (field `where`)
        for parts that are not text."""
        v = self.content
        if v is None or isinstance(v, str):
            return v or ""
        if not all(p.type == "text" and p.text is not None for p in v):
            raise ProtocolError(f"{where}.content", "only text content parts are supported")
        return "\n".join(p.text for p in v)


def _stop(v):
    if v is None or isinstance(v, str) or (isinstance(v, list)
                                           and all(isinstance(s, str) for s in v)):
        return v
    raise ValueError(f"must be a string or a list of strings, got {v!r}")


class SamplingFields(OpenAIBaseModel):
    """The fields both generation endpoints share (vLLM's names and defaults)."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    n: int | None = 1
    seed: int | None = None
    stop: Any = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None  # OpenAI's end-user id: ignored, as vLLM does
    # vLLM's sampling extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = Field(default_factory=list)
    # vLLM's extra parameters
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    priority: int = 0
    request_id: str | None = None
    session_id: str | None = None  # a routing identity in vLLM: no effect on the output
    return_tokens_as_token_ids: bool | None = None
    return_token_ids: bool | None = None
    return_token_offsets: bool | None = None  # render endpoints only: ignored, as vLLM
    return_mm_kwargs: bool | None = None  # render endpoints only: ignored, as vLLM
    guided_json: dict | str | bool | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # llguidance is the only backend
    # vLLM fields arcjax refuses unless neutral (`request_params.REFUSED`)
    use_beam_search: Any = False
    length_penalty: Any = 1.0
    watermarking: Any = None
    truncation_side: Any = None
    logprob_token_ids: Any = None
    routed_experts_prompt_start: Any = 0
    kv_transfer_params: Any = None
    ec_transfer_params: Any = None
    vllm_xargs: Any = None
    cache_salt: Any = None  # the prefix cache is not salted here
    repetition_detection: Any = None
    thinking_token_budget: Any = None
    stream_interval: Any = None
    best_of: Any = None
    functions: Any = None  # OpenAI's deprecated function calling (use tools)
    function_call: Any = None
    logits_processors: Any = None  # server-side Python classes by qualified name
    structural_tag: Any = None  # vLLM's deprecated top-level form

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        return _stop(v)

    @model_validator(mode="after")
    def _stream_options(self):
        if self.stream_options is not None and not self.stream:
            raise _FieldError("stream_options", "only allowed when stream is true")
        return self


class CompletionRequest(SamplingFields):
    """`POST /v1/completions`."""

    # typed here so pydantic-core checks a long token list without Python code per token
    prompt: str | list[int] | list[str | list[int]] | None = Field(None, validate_default=True)
    echo: bool | None = False
    logprobs: Any = None
    max_tokens: int | None = 16
    suffix: Any = None
    prompt_embeds: Any = None
    add_special_tokens: bool = True
    # chat's fields, refused here unless neutral (`request_params.COMPLETION_REFUSED`)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        return prompt_forms(v)

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        """The top-k count; None and false: none."""
        if v is None or v is False:
            return None
        if not _is_int(v):
            raise ValueError(f"must be an int in [0, 20], got {v!r}")
        return v


class ChatCompletionRequest(SamplingFields):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[ToolParam] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh",
                              "max"] | None = None
    include_reasoning: bool = True
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    return_prompt_text: bool | None = None
    media_io_kwargs: Any = None
    mm_processor_kwargs: Any = None

    @model_validator(mode="after")
    def _generation_prompt(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise _FieldError("continue_final_message", "cannot be true together with "
                              "add_generation_prompt (set it to false)")
        return self


class TokenizeRequest(OpenAIBaseModel):
    """`POST /tokenize` (vLLM's): `prompt` (completions' form) or `messages` (chat's,
    rendered by the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict | None = None
    tools: list[ToolParam] | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise _FieldError("prompt", "give prompt or messages (one of them)")
        return self


class DetokenizeRequest(OpenAIBaseModel):
    """`POST /detokenize` (vLLM's)."""

    model: str | None = None
    tokens: list[int]


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _FieldError(ValueError):
    """A check across fields, raised inside a model: names the field it blames."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


# a union member's tag in an error location (pydantic names the member it tried): field
# names are snake_case, tags are type names
_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|dict\[.*\]|list\[.*\]|[A-Z]\w*)$")


def _param(loc: tuple) -> str:
    """A pydantic error location as the request names the field: messages[0].content (a
    union member's tag and what follows it left out)."""
    out = ""
    for part in loc:
        if isinstance(part, str) and _TYPE_TAG.match(part):
            break
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + str(part)
    return out or "body"


def parse_body(model: type[BaseModel], raw: bytes):
    """The request `model` validated from the JSON body `raw`.

    Raises:
      ProtocolError (field: the request's field, "body" for the JSON itself).
    """
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as e:
        err = e.errors(include_url=False)[0]
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, _FieldError):
            raise ProtocolError(cause.field, str(cause)) from None
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            raise ProtocolError("body", f"the body is not valid JSON ({message})") from None
        if err["type"] == "model_type" and not err["loc"]:
            raise ProtocolError("body", "must be a JSON object") from None
        loc = err["loc"]
        if loc[:1] == ("prompt",) and model is CompletionRequest:  # the union's members
            raise ProtocolError("prompt", PROMPT_FORMS) from None
        if len(loc) == 3 and loc[0] == "messages" and loc[2] == "role":
            raise ProtocolError(_param(loc[:2]), "must be an object with a string role") from None
        raise ProtocolError(_param(loc), message) from None
