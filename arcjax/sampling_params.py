"""vLLM's import path for the sampling parameters: `from arcjax.sampling_params import
SamplingParams, StructuredOutputsParams` (the classes live in `arcjax.runtime`)."""

from arcjax.runtime.sampling_params import SamplingParams
from arcjax.runtime.structured_params import StructuredOutputsParams

__all__ = ["SamplingParams", "StructuredOutputsParams"]
