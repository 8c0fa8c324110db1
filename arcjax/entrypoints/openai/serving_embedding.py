"""`POST /v1/embeddings` (vLLM's `OpenAIServingEmbedding`): `input` as a string, a list of
strings, token ids or a list of token-id lists; `encoding_format` "float" or "base64"
(little-endian float32 bytes, what the `openai` client asks for by default); `dimensions`
(Matryoshka truncation, where the model allows it); vLLM's `normalize`. Served by an
engine built with runner="pooling" (`arcjax serve MODEL --runner pooling`): every input is
one prefill-only request in the same scheduler as the generation requests.

The flow is the generation endpoints' (`serving_engine.OpenAIServingBase`): parsed and
tokenized in the worker pool, queued in one admission step, collected while a watcher
waits for the client's disconnect (which aborts what is left).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import Sequence

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from arcjax.entrypoints.openai.http_server import (HTTPError, close_outputs, parse_json,
                                                   until_disconnect)
from arcjax.entrypoints.openai.protocol import ProtocolError
from arcjax.entrypoints.openai.serving_engine import OpenAIServingBase
from arcjax.errors import RequestError
from arcjax.outputs import PoolingRequestOutput
from arcjax.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")
_FIELDS = {"model", "input", "encoding_format", "dimensions", "normalize", "user"}


@dataclasses.dataclass(frozen=True)
class ParsedEmbedding:
    """What an embeddings request asks for."""

    model: str | None
    inputs: tuple  # str | tuple[int, ...] per embedding
    params: PoolingParams
    encoding_format: str
    ignored: tuple[str, ...] = ()  # unknown fields, accepted and ignored (sorted)


def _is_ids(x) -> bool:
    return isinstance(x, list) and bool(x) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def parse_embedding(body) -> ParsedEmbedding:
    """A /v1/embeddings body (decoded JSON). Raises InputError naming the field."""
    if not isinstance(body, dict):
        raise ProtocolError("body", f"must be a JSON object, got {type(body).__name__}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise ProtocolError("model", f"must be a string, got {model!r}")
    if "input" not in body:
        raise ProtocolError("input", "is required")
    raw = body["input"]
    if isinstance(raw, str):
        inputs = (raw,)
    elif _is_ids(raw):
        inputs = (tuple(raw),)
    elif isinstance(raw, list) and raw and all(isinstance(x, str) or _is_ids(x) for x in raw):
        inputs = tuple(x if isinstance(x, str) else tuple(x) for x in raw)
    else:
        raise ProtocolError("input", "must be a string, a list of strings, a list of token "
                                     "ids or a list of lists of token ids (non-empty)")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ENCODING_FORMATS:
        raise ProtocolError("encoding_format", f"must be one of {ENCODING_FORMATS}, got "
                                               f"{fmt!r}")
    params = PoolingParams(dimensions=body.get("dimensions"), normalize=body.get("normalize"))
    ignored = tuple(sorted(n for n in body if n not in _FIELDS))
    return ParsedEmbedding(model, inputs, params, fmt, ignored)


def _encoded(vector: np.ndarray, fmt: str):
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embedding_response(rid: str, created: int, model: str,
                       outputs: Sequence[PoolingRequestOutput], fmt: str) -> dict:
    """The response body: one embedding per input, in order, and the prompt tokens."""
    tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {"id": rid, "object": "list", "created": created, "model": model,
            "data": [{"index": i, "object": "embedding",
                      "embedding": _encoded(o.outputs.data, fmt)} for i, o in enumerate(outputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


class OpenAIServingEmbedding(OpenAIServingBase):
    """The embeddings endpoint (see the module docstring)."""

    async def create_embedding(self, request: Request, raw: bytes) -> Response:
        """Answers one admitted request whose body is `raw`."""
        if self.llm.engine.pooler is None:
            raise HTTPError(400, "this server's engine does not embed: start it with "
                                 "--runner pooling", "invalid_request_error", "model",
                            "embeddings_not_supported")
        parsed, prompts = await self._in_pool(self._prepare, raw)
        rid = f"embd-{uuid.uuid4().hex}"
        created = int(time.time())
        headers = self.tracker.ignored_header(parsed)
        streams = self._submit(rid, prompts, parsed.params)
        outputs = self._outputs(streams)
        self.tracker.in_flight += 1
        try:
            ok, finals = await until_disconnect(request, self._collect(outputs, len(prompts)))
            if not ok:
                return Response(status_code=499)  # nobody is listening
            failed = next((o for o in finals if o.finish_reason != "stop"), None)
            if failed is not None:
                raise HTTPError(500, f"embedding failed: {failed.error or failed.finish_reason}",
                                "internal_error")
            return JSONResponse(embedding_response(rid, created, self.models.model_name, finals,
                                                   parsed.encoding_format), headers=headers)
        finally:
            await close_outputs(outputs, streams)
            self.tracker.in_flight -= 1

    def _prepare(self, raw: bytes) -> tuple[ParsedEmbedding, list[tuple[int, ...]]]:
        """(worker pool) The parsed request and every input's token ids (all checked)."""
        parsed = parse_embedding(parse_json(raw))
        self.models.check_model(parsed.model)
        ids = []
        for p in parsed.inputs:
            try:
                ids.append(self.llm.engine.check(p, parsed.params)[1])
            except RequestError as e:  # the request's own field names
                field = "input" if e.field == "prompt" else e.field
                raise type(e)(field, e.message, limit=e.limit) from None
        return parsed, ids
