"""`POST /tokenize` and `POST /detokenize` (vLLM's `OpenAIServingTokenization`).

/tokenize takes a completions-style `prompt` (BOS added unless `add_special_tokens` is
false) or chat `messages` (rendered by the chat template, as /v1/chat/completions renders
them, special tokens not added again) and answers {"count", "max_model_len", "tokens",
"token_strs"} (`token_strs` with `return_token_strs`, else null). /detokenize takes
{"tokens"} and answers {"prompt": text} (special tokens kept). Both run in the worker pool.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

from arcjax.entrypoints.openai.protocol import (DetokenizeRequest, ProtocolError,
                                                TokenizeRequest, parse_body)
from arcjax.entrypoints.openai.request_params import ParsedRequest
from arcjax.entrypoints.openai.serving_chat import OpenAIServingChat
from arcjax.entrypoints.openai.serving_engine import ServingContext, in_pool
from arcjax.entrypoints.openai.tool_calls import plan_tools, template_messages
from arcjax.sampling_params import SamplingParams


class OpenAIServingTokenization:
    """The tokenizer endpoints (see the module docstring).

    Args:
      context: what the server's endpoints share (the engine, the model, the pool).
      chat: the chat endpoint, whose rendering /tokenize reuses.
    """

    def __init__(self, context: ServingContext, chat: OpenAIServingChat):
        self.llm, self.models, self._pool = context.llm, context.models, context.pool
        self.chat = chat

    async def tokenize(self, raw: bytes) -> JSONResponse:
        return JSONResponse(await in_pool(self._pool, self._tokenize, raw))

    async def detokenize(self, raw: bytes) -> JSONResponse:
        return JSONResponse(await in_pool(self._pool, self._detokenize, raw))

    def _tokenizer(self):
        tokenizer = self.llm.engine.tokenizer
        if tokenizer is None:
            raise ProtocolError("model", "this model has no tokenizer")
        return tokenizer

    def _tokenize(self, raw: bytes) -> dict:
        self.chat.check_body_values(raw)
        self.chat.check_size(raw)
        req = parse_body(TokenizeRequest, raw)
        self.models.check_model(req.model)
        tokenizer, engine = self._tokenizer(), self.llm.engine
        if req.prompt is not None:
            text = req.prompt
            add_special = True if req.add_special_tokens is None else req.add_special_tokens
        else:
            messages = [{**m.model_dump(exclude_unset=True), "content": m.text(f"messages[{i}]")}
                        for i, m in enumerate(req.messages)]
            tools = plan_tools(req.tools, "none")
            parsed = ParsedRequest(req, SamplingParams(), messages=tuple(
                template_messages(messages)), tools=tools,
                template_kwargs=dict(req.chat_template_kwargs or {}))
            text = self.chat.render(parsed)
            add_special = bool(req.add_special_tokens)
        tokens = tokenizer.encode(text, add_special_tokens=add_special)
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens,
                "token_strs": ([tokenizer.token_text(t) for t in tokens]
                               if req.return_token_strs else None)}

    def _detokenize(self, raw: bytes) -> dict:
        req = parse_body(DetokenizeRequest, raw)
        self.models.check_model(req.model)
        vocab = self.llm.engine.runner.cfg.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ProtocolError("tokens", f"token id {bad} is outside the vocabulary "
                                          f"[0, {vocab})", limit=vocab)
        return {"prompt": self._tokenizer().decode(req.tokens, skip_special_tokens=False)}
