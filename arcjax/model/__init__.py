"""The model: its config, its layers (`layers`: flax.nnx modules, imported where a model is
built, not here), parameter/cache specs, the decoder; checkpoint formats in `formats/`."""

from arcjax.model.model_config import SUPPORTED_ARCHITECTURES, ModelConfig
from arcjax.model.decoder import StepBatch, forward, forward_dense, forward_with_stats, lm_head
from arcjax.model.specs import (Cache, ParamSpec, Params, cache_specs, init_params, make_cache,
                                param_specs)

__all__ = ["Cache", "ModelConfig", "ParamSpec", "Params", "SUPPORTED_ARCHITECTURES",
           "StepBatch", "cache_specs", "forward", "forward_dense", "forward_with_stats",
           "init_params", "lm_head", "make_cache", "param_specs"]
