"""arcjax: a JAX/Pallas LLM inference engine with chunked, mixed prefill+decode scheduling."""

from arcjax.api import LLM, default_model_path
from arcjax.errors import EngineConfigError, RequestError, UnknownRequestError
from arcjax.outputs import RequestMetrics, RequestOutput
from arcjax.sampling import SamplingParams, SamplingParamsError

__all__ = ["LLM", "SamplingParams", "SamplingParamsError", "RequestOutput", "RequestMetrics",
           "RequestError", "UnknownRequestError", "EngineConfigError", "default_model_path"]
