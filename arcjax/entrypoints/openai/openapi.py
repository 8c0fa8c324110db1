"""The server's OpenAPI schema (`/openapi.json`, `/docs`) from the request models
(`protocol.py`) and `openai`'s response types.

Generation routes read their bodies themselves (under the size cap, parsed in the worker
pool: `api_server._admit`), so FastAPI does not see the models; `document(app, path,
endpoint)` registers such a route with its request body's schema and its response model,
and `install_schema(app)` makes the app's `openapi()` add the request models' schemas to
the components.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from openai.types import Completion, CreateEmbeddingResponse
from openai.types.chat import ChatCompletion
from openai.types.responses import Response as ResponseObject
from pydantic import BaseModel

from arcjax.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                DetokenizeRequest, TokenizeRequest)
from arcjax.entrypoints.openai.responses_protocol import ResponsesRequest
from arcjax.entrypoints.openai.serving_embedding import EmbeddingRequest


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


# path -> (request model, response model, summary); streamed responses are
# server-sent events of `openai.types.Completion` / `ChatCompletionChunk` objects
ROUTES = {
    "/v1/completions": (CompletionRequest, Completion,
                        "Create a completion (stream: server-sent events)"),
    "/v1/chat/completions": (ChatCompletionRequest, ChatCompletion,
                             "Create a chat completion (stream: server-sent events)"),
    "/v1/responses": (ResponsesRequest, ResponseObject,
                      "Create a response (stream: typed server-sent events)"),
    "/v1/embeddings": (EmbeddingRequest, CreateEmbeddingResponse, "Create embeddings"),
    "/tokenize": (TokenizeRequest, TokenizeResponse, "Tokenize a prompt or a conversation"),
    "/detokenize": (DetokenizeRequest, DetokenizeResponse, "Detokenize token ids"),
}


def document(app: FastAPI, path: str, endpoint) -> None:
    """Registers `endpoint` for POST `path` with its documented body and response."""
    request, response, summary = ROUTES[path]
    body = {"required": True, "content": {"application/json": {"schema": {
        "$ref": f"#/components/schemas/{request.__name__}"}}}}
    app.post(path, summary=summary, response_model=None,
             responses={200: {"model": response}},
             openapi_extra={"requestBody": body})(endpoint)


def install_schema(app: FastAPI) -> None:
    """The app's `openapi()` (what /openapi.json and /docs serve) with the request models."""
    app.openapi = lambda: _openapi(app)


def _openapi(app: FastAPI) -> dict:
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for request, _, _ in ROUTES.values():
            model = request.model_json_schema(ref_template="#/components/schemas/{model}")
            components.update(model.pop("$defs", {}))
            components[request.__name__] = model
        app.openapi_schema = schema
    return app.openapi_schema
