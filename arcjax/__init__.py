"""arcjax: a JAX/Pallas LLM inference engine with chunked, mixed prefill+decode scheduling.

Public API: `LLM` (batch and online use), `AsyncLLM` (a background engine loop for servers),
`SamplingParams` (with `RequestOutputKind` and `StructuredOutputsParams`), `LoRARequest`
(the LoRA adapter a request runs with), `RequestOutput`,
`PoolingParams` and the embedding outputs (`EmbeddingRequestOutput`, `PoolingRequestOutput`),
the typed errors of `arcjax.errors` (`EngineDeadError` among them), and `EngineConfig` /
`build_engine` for embedding the engine.
"""

from arcjax.engine.build import build_engine, default_model_path
from arcjax.engine.engine_config import EngineConfig
from arcjax.outputs import (CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, Logprob,
                            PoolingOutput, PoolingRequestOutput, RequestMetrics, RequestOutput)
from arcjax.entrypoints.async_llm import AsyncLLM
from arcjax.entrypoints.llm import LLM
from arcjax.errors import (ConfigError, EngineConfigError, EngineDeadError, InputError,
                           ModelFileError, PoolingParamsError, RequestError, SamplingParamsError,
                           StructuredOutputsError, UnknownRequestError)
from arcjax.lora.lora_request import LoRARequest
from arcjax.pooling_params import PoolingParams
from arcjax.sampling_params import SamplingParams
from arcjax.sampling_params import RequestOutputKind
from arcjax.sampling_params import StructuredOutputsParams

__all__ = ["AsyncLLM", "CompletionOutput", "ConfigError", "EmbeddingOutput",
           "EmbeddingRequestOutput", "EngineConfig", "EngineConfigError",
           "EngineDeadError", "InputError", "LLM", "Logprob", "LoRARequest", "ModelFileError",
           "PoolingOutput", "PoolingParams", "PoolingParamsError", "PoolingRequestOutput",
           "RequestError",
           "RequestMetrics", "RequestOutput", "RequestOutputKind", "SamplingParams",
           "SamplingParamsError", "StructuredOutputsError", "StructuredOutputsParams",
           "UnknownRequestError", "build_engine", "default_model_path"]
