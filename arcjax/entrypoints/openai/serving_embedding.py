"""`POST /v1/embeddings` (vLLM's `OpenAIServingEmbedding`): `input` as a string, a list of
strings, token ids or a list of token-id lists; `encoding_format` "float" or "base64"
(little-endian float32 bytes, what the `openai` client asks for by default); `dimensions`
(Matryoshka truncation, where the model allows it); vLLM's `normalize` and
`add_special_tokens`. Served by an engine built with runner="pooling" (`arcjax serve MODEL
--runner pooling`), beside the generation endpoints: every input is one prefill-only
request in the same scheduler as the generation requests. A server whose engine does not
pool refuses with 400 (param "model", code "embeddings_not_supported").

The flow is the generation endpoints' (`serving_engine.OpenAIServingBase`): validated and
tokenized in the worker pool, queued in one admission step, collected while a watcher
waits for the client's disconnect (which aborts what is left).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import Sequence
from typing import Literal

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, field_validator

from arcjax.entrypoints.openai.http_server import HTTPError, close_outputs, until_disconnect
from arcjax.entrypoints.openai.protocol import (PROMPT_FORMS, OpenAIBaseModel, ProtocolError,
                                                parse_body, prompt_forms)
from arcjax.entrypoints.openai.serving_engine import OpenAIServingBase
from arcjax.errors import RequestError
from arcjax.outputs import PoolingRequestOutput
from arcjax.pooling_params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    """`POST /v1/embeddings` (OpenAI's fields, vLLM's `normalize` and
    `add_special_tokens`)."""

    model: str | None = None
    # typed here so pydantic-core checks a long token list without Python code per token
    input: str | list[int] | list[str | list[int]] | None = Field(None, validate_default=True)
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    normalize: bool | None = None
    add_special_tokens: bool = True
    user: str | None = None  # OpenAI's end-user id: ignored, as vLLM does

    @field_validator("input")
    @classmethod
    def _input(cls, v):
        return prompt_forms(v)


def parse_embedding(raw: bytes) -> EmbeddingRequest:
    """A /v1/embeddings body. Raises InputError naming the field."""
    try:
        return parse_body(EmbeddingRequest, raw)
    except ProtocolError as e:
        if e.field.startswith("input"):  # the union's members
            raise ProtocolError("input", PROMPT_FORMS) from None
        raise


@dataclasses.dataclass(frozen=True)
class EmbeddingPrepared:
    """An embeddings request ready to queue: validated, its params, every input's ids."""

    request: EmbeddingRequest
    params: PoolingParams
    prompts: tuple[tuple[int, ...], ...]


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
            raise HTTPError(400, "this server's model does not embed: start it with "
                                 "--runner pooling to serve /v1/embeddings",
                            "invalid_request_error", "model", "embeddings_not_supported")
        prep = await self._in_pool(self._prepare, raw)
        rid = f"embd-{uuid.uuid4().hex}"
        created = int(time.time())
        headers = self.tracker.ignored_header(prep.request.extra_fields())
        params = [prep.params] * len(prep.prompts)
        streams = self._submit(rid, prep.prompts, params)
        outputs = self._outputs(streams, params)
        self.tracker.in_flight += 1
        try:
            ok, finals = await until_disconnect(request, self._collect(outputs,
                                                                       len(prep.prompts)))
            if not ok:
                return Response(status_code=499)  # nobody is listening
            failed = next((o for o in finals if o.finish_reason != "stop"), None)
            if failed is not None:
                raise HTTPError(500, f"embedding failed: {failed.error or failed.finish_reason}",
                                "internal_error")
            return JSONResponse(embedding_response(rid, created, self.models.model_name, finals,
                                                   prep.request.encoding_format),
                                headers=headers)
        finally:
            await close_outputs(outputs, streams)
            self.tracker.in_flight -= 1

    def _prepare(self, raw: bytes) -> EmbeddingPrepared:
        """(worker pool) The validated request, its params and every input's token ids (all
        checked by the engine)."""
        self.check_body_values(raw)
        req = parse_embedding(raw)
        if self.models.check_model(req.model) is not None:
            raise RequestError("model", f"{req.model!r} is a LoRA adapter: embeddings run "
                               "the base model")
        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        engine, ids = self.llm.engine, []
        for i, p in enumerate(req.input):
            field = "input" if len(req.input) == 1 else f"input[{i}]"
            try:
                if isinstance(p, str):
                    p = engine.inputs.encode(p, add_special_tokens=req.add_special_tokens)
                ids.append(engine.check(p, params)[1])
            except RequestError as e:  # the request's own field names
                name = field if e.field in ("prompt", "params") else e.field
                raise type(e)(name, e.message, limit=e.limit) from None
        return EmbeddingPrepared(req, params, tuple(ids))
