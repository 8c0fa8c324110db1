"""The model this server serves (vLLM's `OpenAIServingModels`): its names, the cards of
`GET /v1/models` and `GET /v1/models/{model}`, the check of a request's `model`, and the
sampling defaults of its `generation_config.json`.

`generation_defaults(source, model_dir)` is vLLM's `--generation-config`: "auto" (the
model directory's generation_config.json), "vllm" (none: OpenAI's defaults), or a folder
holding a generation_config.json; temperature, top_p, top_k, min_p and
repetition_penalty apply to requests that leave them unset, max_new_tokens is the
default max_tokens.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence

from arcjax.engine.trace import attention_report
from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.openai.http_server import HTTPError
from arcjax.entrypoints.openai.request_params import DEFAULTED, GenerationDefaults
from arcjax.errors import EngineConfigError
from arcjax.model.kv_report import kv_cache_report
from arcjax.model.quant import storage_dtypes

DEFAULT_MODEL_NAME = "arcjax-default"  # the packaged model's id
GENERATION_CONFIGS = ("auto", "vllm")  # besides a folder path


def generation_defaults(source: str, model_dir) -> GenerationDefaults:
    """The sampling defaults `--generation-config source` names (see the module docstring).

    Raises:
      EngineConfigError (field "generation_config"): a folder without a readable
        generation_config.json.
    """
    if source == "vllm":
        return GenerationDefaults()
    folder = model_dir if source == "auto" else source
    path = os.path.join(os.fspath(folder), "generation_config.json") if folder else None
    if path is None or not os.path.isfile(path):
        if source == "auto":  # a model without one (or a GGUF file): OpenAI's defaults
            return GenerationDefaults()
        raise EngineConfigError("generation_config", f"{path}: no generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise EngineConfigError("generation_config", f"{path}: cannot read it ({e})") from None
    values = {k: cfg[k] for k in DEFAULTED if isinstance(cfg.get(k), (int, float))
              and not isinstance(cfg.get(k), bool)}
    max_new = cfg.get("max_new_tokens")
    return GenerationDefaults(values, max_new if isinstance(max_new, int) and max_new > 0
                              else None)


class OpenAIServingModels:
    """The model card and name checks of one `AsyncLLM`.

    Args:
      llm: the engine whose model is served.
      served_model_names: the ids clients may send (the first is the one responses carry);
        () = the model as given to the engine, or `DEFAULT_MODEL_NAME` for the packaged one.
    """

    def __init__(self, llm: AsyncLLM, served_model_names: Sequence[str] = ()):
        self.llm = llm
        self.names = tuple(served_model_names) or (llm.engine_config.model
                                                   or DEFAULT_MODEL_NAME,)
        self.model_name = self.names[0]
        self.root = llm.engine_config.model or DEFAULT_MODEL_NAME
        self.created = int(time.time())

    def model_card(self, name: str | None = None) -> dict:
        """A served name's card (vLLM's: root, parent, permission, max_model_len), with the
        storage dtypes, the KV bytes per token (`kv_cache_report`), the attention
        implementation of every bucket compiled so far (all after a warm-up), and whether a
        recorded GPU pass vouches for each."""
        engine = self.llm.engine
        runner = engine.runner
        name = name or self.model_name
        return {"id": name, "object": "model", "created": self.created, "owned_by": "arcjax",
                "root": self.root, "parent": None, "max_model_len": engine.max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*",
                                "group": None, "is_blocking": False}],
                **storage_dtypes(runner.params, runner.cache),
                **kv_cache_report(runner.cfg, runner.kv_cache_dtype),
                "attention": attention_report(runner.attn_impl, dict(runner.attention_impls),
                                              verified=dict(runner.attention_verified))}

    def show_available_models(self) -> dict:
        """The body of `GET /v1/models`."""
        return {"object": "list", "data": [self.model_card(n) for n in self.names]}

    def show_model(self, model: str) -> dict:
        """The body of `GET /v1/models/{model}`. Raises HTTPError 404 for another model."""
        self.check_model(model)
        return self.model_card(model)

    def check_model(self, model: str | None) -> None:
        """Refuses (404, param "model") a request for a model this server does not serve;
        None (the field left out) means the served one."""
        if model is not None and model not in self.names:
            raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                                 f"{self.model_name!r}", "not_found_error", "model",
                            "model_not_found")
