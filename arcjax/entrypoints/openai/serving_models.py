"""The model this server serves (vLLM's `OpenAIServingModels`): its names and LoRA
adapters, the cards of `GET /v1/models` and `GET /v1/models/{model}`, the check of a
request's `model` (a served name: the base model; an adapter's name: that adapter), the
adapters loaded and unloaded at run time, and the sampling defaults of its
`generation_config.json`.

LoRA adapters (engines built with enable_lora): `--lora-modules` are loaded (read and
validated into the engine's host cache) when the server is built; `load_lora_adapter` and
`unload_lora_adapter` are vLLM's runtime updates. Every adapter gets a fresh
`lora_int_id` (`AdapterCache.fresh_id`), so a name loaded again never meets KV or weights
of its earlier copy; an unloaded adapter's requests already queued run to the end
(`AdapterCache.forget`).

`generation_defaults(source, model_dir)` is vLLM's `--generation-config`: "auto" (the
model directory's generation_config.json), "vllm" (none: OpenAI's defaults), or a folder
holding a generation_config.json; temperature, top_p, top_k, min_p and
repetition_penalty apply to requests that leave them unset, max_new_tokens is the
default max_tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from arcjax.engine.trace import attention_report
from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.openai.http_server import HTTPError
from arcjax.entrypoints.openai.lora_modules import (LoadLoRAAdapterRequest, LoRAModulePath,
                                                    UnloadLoRAAdapterRequest)
from arcjax.entrypoints.openai.protocol import parse_body
from arcjax.entrypoints.openai.request_params import DEFAULTED, GenerationDefaults
from arcjax.errors import ConfigError, EngineConfigError, LoRAAdapterError
from arcjax.lora.lora_request import LoRARequest
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


def adapter_error(e: LoRAAdapterError) -> HTTPError:
    """A refused adapter as an HTTP error: 404 when its path names nothing (vLLM's
    NotFoundError), else 400; `param` is the body's "lora_path", the message names the
    adapter and what is wrong with it."""
    if e.field == "lora_request.lora_path":
        return HTTPError(404, str(e), "not_found_error", "lora_path", "lora_adapter_not_found")
    return HTTPError(400, str(e), "invalid_request_error", "lora_path", "lora_adapter_invalid")


class OpenAIServingModels:
    """The model cards, name checks and LoRA adapters of one `AsyncLLM`.

    Args:
      llm: the engine whose model is served.
      served_model_names: the ids clients may send (the first is the one responses carry);
        () = the model as given to the engine, or `DEFAULT_MODEL_NAME` for the packaged one.
      lora_modules: adapters served from start (loaded now).

    Raises:
      ConfigError (field "lora_modules..."): adapters without enable_lora, a name served
        twice, a `base_model_name` that is not a served name.
      LoRAAdapterError: an adapter refused by the engine (files, rank, shapes, ...).
    """

    def __init__(self, llm: AsyncLLM, served_model_names: Sequence[str] = (),
                 lora_modules: Sequence[LoRAModulePath] = ()):
        self.llm = llm
        self.names = tuple(served_model_names) or (llm.engine_config.model
                                                   or DEFAULT_MODEL_NAME,)
        self.model_name = self.names[0]
        self.root = llm.engine_config.model or DEFAULT_MODEL_NAME
        self.created = int(time.time())
        self.lora_requests: dict[str, LoRARequest] = {}  # adapter name -> its request
        self._parents: dict[str, str] = {}  # adapter name -> the served name it adapts
        self._lora_lock = asyncio.Lock()  # one runtime update at a time
        if lora_modules and llm.engine.adapters is None:
            raise ConfigError("lora_modules", "LoRA adapters need an engine built with "
                                              "enable_lora (--enable-lora)")
        for module in lora_modules:
            base = module.base_model_name
            if base is not None and base not in self.names:
                raise ConfigError("lora_modules.base_model_name", f"{base!r} (adapter "
                                  f"{module.name!r}) is not a served model name {self.names}")
            if module.name in self.names or module.name in self.lora_requests:
                raise ConfigError("lora_modules.name", f"{module.name!r} is served twice")
            lora = LoRARequest(module.name, llm.engine.adapters.fresh_id(), module.path)
            llm.engine.inputs.check_adapter(lora)
            self.lora_requests[module.name] = lora
            self._parents[module.name] = base or self.model_name

    # --- cards ----------------------------------------------------------------------------
    def _card(self, name: str, root: str, parent: str | None) -> dict:
        return {"id": name, "object": "model", "created": self.created, "owned_by": "arcjax",
                "root": root, "parent": parent, "max_model_len": self.llm.engine.max_model_len,
                "permission": [{"id": f"modelperm-{name}", "object": "model_permission",
                                "created": self.created, "allow_create_engine": False,
                                "allow_sampling": True, "allow_logprobs": True,
                                "allow_search_indices": False, "allow_view": True,
                                "allow_fine_tuning": False, "organization": "*",
                                "group": None, "is_blocking": False}]}

    def model_card(self, name: str | None = None) -> dict:
        """A served name's card (vLLM's: root, parent, permission, max_model_len), with the
        storage dtypes, the KV bytes per token (`kv_cache_report`), the attention
        implementation of every bucket compiled so far (all after a warm-up), and whether a
        recorded GPU pass vouches for each."""
        runner = self.llm.engine.runner
        return {**self._card(name or self.model_name, self.root, None),
                **storage_dtypes(runner.params, runner.cache),
                **kv_cache_report(runner.cfg, runner.kv_cache_dtype),
                "attention": attention_report(runner.attn_impl, dict(runner.attention_impls),
                                              verified=dict(runner.attention_verified))}

    def lora_card(self, name: str) -> dict:
        """An adapter's card (vLLM's): `root` its path, `parent` the served name it adapts."""
        return self._card(name, self.lora_requests[name].lora_path, self._parents[name])

    def show_available_models(self) -> dict:
        """The body of `GET /v1/models`: the served names, then every adapter."""
        return {"object": "list", "data": [*(self.model_card(n) for n in self.names),
                                           *(self.lora_card(n) for n in list(self.lora_requests))]}

    def show_model(self, model: str) -> dict:
        """The body of `GET /v1/models/{model}`. Raises HTTPError 404 for another model."""
        if self.check_model(model) is not None:
            return self.lora_card(model)
        return self.model_card(model)

    # --- requests' `model` ------------------------------------------------------------------
    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` selects: None for a served name (or the field
        left out: the served model), the `LoRARequest` for an adapter's name. Refuses (404,
        param "model") any other name."""
        if model is None or model in self.names:
            return None
        lora = self.lora_requests.get(model)
        if lora is not None:
            return lora
        adapters = f" and the LoRA adapters {sorted(self.lora_requests)}" if (
            self.lora_requests) else ""
        raise HTTPError(404, f"model {model!r} does not exist; this server serves "
                             f"{self.model_name!r}{adapters}", "not_found_error", "model",
                        "model_not_found")

    def check_served(self, lora: LoRARequest | None) -> None:
        """(event loop) Refuses (404) a request prepared for an adapter unloaded since."""
        if lora is not None and self.lora_requests.get(lora.lora_name) is not lora:
            raise HTTPError(404, f"the LoRA adapter {lora.lora_name!r} was unloaded",
                            "not_found_error", "model", "model_not_found")

    def model_name_of(self, lora: LoRARequest | None) -> str:
        """The `model` responses carry: the adapter's name, or the served model's."""
        return self.model_name if lora is None else lora.lora_name

    # --- runtime updates (event loop) ---------------------------------------------------------
    async def load_lora_adapter(self, raw: bytes, pool: ThreadPoolExecutor) -> str:
        """`POST /v1/load_lora_adapter` (vLLM's): reads and validates the adapter (in
        `pool`), then serves it under its name. Returns vLLM's success text.

        Raises:
          ProtocolError: a bad body. HTTPError: LoRA is off (400), the name is taken (400),
          the path names nothing (404), the adapter is refused (400, `adapter_error`).
        """
        body = parse_body(LoadLoRAAdapterRequest, raw)
        name, path = body.lora_name, body.lora_path
        if not name.strip() or not path.strip():
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                            "invalid_request_error", "lora_name" if not name.strip()
                            else "lora_path")
        if self.llm.engine.adapters is None:
            raise HTTPError(400, "LoRA is not enabled: start the server with --enable-lora",
                            "invalid_request_error", None, "lora_not_enabled")
        if name in self.names:
            raise HTTPError(400, f"{name!r} is the served model's name", "invalid_request_error",
                            "lora_name")
        async with self._lora_lock:
            old = self.lora_requests.get(name)
            if old is not None and not body.load_inplace:
                raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.",
                                "invalid_request_error", "lora_name")
            lora = LoRARequest(name, self.llm.engine.adapters.fresh_id(), path)
            try:
                await asyncio.get_running_loop().run_in_executor(
                    pool, self.llm.engine.inputs.check_adapter, lora)
            except LoRAAdapterError as e:
                raise adapter_error(e) from None
            self.lora_requests[name] = lora
            self._parents[name] = self.model_name
            if old is not None:  # load_inplace: the old copy's requests finish with it
                self.llm.engine.adapters.forget(old.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, raw: bytes) -> str:
        """`POST /v1/unload_lora_adapter` (vLLM's): new requests may no longer name it; the
        ones already queued run to the end. Returns vLLM's success text.

        Raises:
          ProtocolError: a bad body. HTTPError 404: no adapter of that name.
        """
        body = parse_body(UnloadLoRAAdapterRequest, raw)
        name = body.lora_name
        if not name.strip():
            raise HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                            "invalid_request_error", "lora_name")
        async with self._lora_lock:
            lora = self.lora_requests.pop(name, None)
            if lora is None:
                raise HTTPError(404, f"The lora adapter '{name}' cannot be found.",
                                "not_found_error", "lora_name", "lora_adapter_not_found")
            del self._parents[name]
            self.llm.engine.adapters.forget(lora.lora_int_id)
        return f"Success: LoRA adapter '{name}' removed successfully."
