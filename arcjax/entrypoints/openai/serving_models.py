"""The model this server serves (vLLM's `OpenAIServingModels`): its name, the cards of
`GET /v1/models` and `GET /v1/models/{model}`, and the check of a request's `model`."""

from __future__ import annotations

import time

from arcjax.engine.trace import attention_report
from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.openai.http_server import HTTPError
from arcjax.model.quant import storage_dtypes

DEFAULT_MODEL_NAME = "arcjax-default"  # the packaged model's id


class OpenAIServingModels:
    """The model card and name checks of one `AsyncLLM`.

    Args:
      llm: the engine whose model is served.
      served_model_name: the id clients send; None = the model as given to the engine, or
        `DEFAULT_MODEL_NAME` for the packaged model.
    """

    def __init__(self, llm: AsyncLLM, served_model_name: str | None = None):
        self.llm = llm
        self.model_name = served_model_name or llm.engine_config.model or DEFAULT_MODEL_NAME
        self.created = int(time.time())

    def model_card(self) -> dict:
        """The served model's card, with its context length, storage dtypes and the
        attention implementation of every bucket compiled so far (all after a warm-up),
        and whether a recorded GPU pass vouches for each."""
        engine = self.llm.engine
        runner = engine.runner
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "arcjax", "max_model_len": engine.max_model_len,
                **storage_dtypes(runner.params, runner.cache),
                "attention": attention_report(runner.attn_impl, dict(runner.attention_impls),
                                              verified=dict(runner.attention_verified))}

    def show_available_models(self) -> dict:
        """The body of `GET /v1/models`."""
        return {"object": "list", "data": [self.model_card()]}

    def show_model(self, model: str) -> dict:
        """The body of `GET /v1/models/{model}`. Raises HTTPError 404 for another model."""
        self.check_model(model)
        return self.model_card()

    def check_model(self, model: str | None) -> None:
        """Refuses (404, param "model") a request for a model this server does not serve;
        None (the field left out) means the served one."""
        if model is not None and model != self.model_name:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", "not_found_error", "model",
                            "model_not_found")
