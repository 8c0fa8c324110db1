"""arcjax: a JAX/Pallas LLM inference engine with chunked, mixed prefill+decode scheduling.

Public API: `LLM` (batch and online use), `AsyncLLM` (a background engine loop for servers), `SamplingParams` (with `StructuredOutputsParams`), `RequestOutput`, the typed
errors of `arcjax.errors`, and `EngineConfig` / `build_engine` for embedding the engine.
"""

from arcjax.engine.build import build_engine, default_model_path
from arcjax.engine.config import EngineConfig
from arcjax.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.llm import LLM
from arcjax.errors import (ConfigError, EngineConfigError, InputError, ModelFileError,
                           RequestError, SamplingParamsError, StructuredOutputsError,
                           UnknownRequestError)
from arcjax.runtime.sampling import SamplingParams
from arcjax.runtime.structured_params import StructuredOutputsParams

__all__ = ["AsyncLLM", "CompletionOutput", "LLM", "Logprob", "ConfigError", "EngineConfig", "EngineConfigError", "InputError",
           "ModelFileError", "RequestError", "RequestMetrics", "RequestOutput",
           "SamplingParams", "SamplingParamsError", "StructuredOutputsError",
           "StructuredOutputsParams", "UnknownRequestError", "build_engine",
           "default_model_path"]
