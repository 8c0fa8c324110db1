"""The OpenAI / vLLM response bodies: whole responses, stream chunks, errors, SSE framing.

Built as plain dicts on the hot path (one per chunk) in the shapes of `openai`'s types
(`openai.types.Completion`, `openai.types.chat.ChatCompletion`, `ChatCompletionChunk`),
which the OpenAPI schema documents (`api_server`); tests validate the bodies against them.
vLLM's additions: `message.reasoning` (and `reasoning_content`, SGLang's and llama.cpp's
name for it), `delta.reasoning` / `delta.reasoning_content`, `prompt_logprobs`,
`token_ids` / `prompt_token_ids` (`return_token_ids`), `prompt_text`
(`return_prompt_text`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from arcjax.entrypoints.openai.chat_output import ChatOutput
from arcjax.outputs import RequestOutput


def error_body(message: str, type_: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(outputs: Sequence[RequestOutput], completion_tokens: int) -> dict:
    """Prompt tokens once per prompt; `completion_tokens` of every choice."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens
                                                           for o in outputs)}}


def sse(data: dict | str) -> str:
    """One server-sent event."""
    text = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False,
                                                         separators=(",", ":"))
    return f"data: {text}\n\n"


def completion_choice(index: int, text: str, logprobs: dict | None,
                      finish_reason: str | None, token_ids=None,
                      prompt_logprobs=None, prompt_token_ids=None) -> dict:
    choice = {"index": index, "text": text, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = list(prompt_token_ids)
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    return choice


def completion_body(rid: str, created: int, model: str, choices: list[dict],
                    usage_: dict | None = None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_message(out: ChatOutput, calls_json: list[dict], include_reasoning: bool) -> dict:
    """A whole choice's `message` (`tool_calls` only when there are calls, as vLLM)."""
    message = {"role": "assistant", "content": out.content}
    if include_reasoning and out.reasoning is not None:
        message["reasoning"] = message["reasoning_content"] = out.reasoning
    if calls_json:
        message["tool_calls"] = calls_json
    return message


def chat_choice(index: int, message: dict, logprobs: dict | None,
                finish_reason: str | None, token_ids=None) -> dict:
    choice = {"index": index, "message": message, "logprobs": logprobs,
              "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = list(token_ids)
    return choice


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage_: dict,
              extra: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_, **(extra or {})}


def chat_delta(reasoning: str, content: str, tool_items: Sequence[dict],
               include_reasoning: bool) -> dict:
    """A chunk's `delta`: only what is new (vLLM sends reasoning under both names)."""
    delta = {}
    if reasoning and include_reasoning:
        delta["reasoning"] = delta["reasoning_content"] = reasoning
    if content:
        delta["content"] = content
    if tool_items:
        delta["tool_calls"] = list(tool_items)
    return delta


def chunk(rid: str, created: int, model: str, obj: str, choice: dict,
          usage_: dict | None = None, extra: dict | None = None) -> dict:
    """One stream chunk of `obj` ("text_completion", "chat.completion.chunk")."""
    body = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice],
            **(extra or {})}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def usage_chunk(rid: str, created: int, model: str, obj: str,
                outputs: Sequence[RequestOutput], completion_tokens: int) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [],
            "usage": usage(outputs, completion_tokens)}
