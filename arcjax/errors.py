"""arcjax's typed errors: the scheduler's hierarchy, plus the engine's own subclasses.

Every error caused by bad input is an `InputError` (a `ValueError`) carrying `.field` (what was
wrong, as the caller spelled it) and `.limit` (the bound it broke, or None). The scheduler's
classes are the same objects here (never re-wrapped), so `.field` survives from the planner to an
HTTP 400. Files that cannot be loaded raise `ModelFileError` subclasses naming the file.

`EngineDeadError` is not about input: the engine met a failure it cannot recover from (a KV
cache reset that failed, a lost process of a multi-host run, an error while recovering from
a failed step). Every waiter gets it, and so does every later call.
"""

from __future__ import annotations

from scheduler.scheduler_errors import (CommitError, ConfigError, DuplicateRequestError, InputError,
                              RequestError, RequestTooLargeError, StepOrderError,
                              UnknownRequestError)

__all__ = ["CommitError", "ConfigError", "DuplicateRequestError", "EngineConfigError",
           "EngineDeadError", "LoRAAdapterError",
           "InputError", "ModelConfigError", "ModelFileError", "PoolingParamsError",
           "QuantizationConfigError", "RequestError",
           "RequestTooLargeError", "SamplingParamsError", "StepOrderError",
           "StructuredOutputsError", "UnknownRequestError", "WeightsError"]


class EngineConfigError(ConfigError):
    """An engine option out of range (names the option and the limit)."""


class EngineDeadError(RuntimeError):
    """The engine stopped for good; `.reason` says why (the same text on every process of a
    multi-host run). Requests it held finished without output; later calls raise it too."""

    def __init__(self, reason: str):
        super().__init__(f"the engine is dead: {reason}")
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.reason,)


class SamplingParamsError(RequestError):
    """An invalid sampling parameter (field: the parameter's name)."""


class PoolingParamsError(RequestError):
    """An invalid pooling parameter (field: the parameter's name)."""


class StructuredOutputsError(SamplingParamsError):
    """A structured-output constraint that is malformed or cannot compile into a grammar
    (field: "structured_outputs.<kind>", e.g. "structured_outputs.json"; the server maps it
    to its own field: response_format, tools, guided_json, ...)."""


class LoRAAdapterError(RequestError):
    """A LoRA adapter refused when its request is submitted: `.adapter` names the adapter
    (its `lora_name`), `.field` what is wrong: a field of the request ("lora_request",
    "lora_request.lora_path", ...) or of the adapter's files ("adapter_config.json:r",
    "adapter_model.safetensors:<tensor name>"). No other request is disturbed."""

    def __init__(self, adapter: str, field: str, message: str, *,
                 limit: int | float | None = None):
        super().__init__(field, f"adapter {adapter!r}: {message}", limit=limit)
        self.adapter = adapter
        self.reason = message

    def __reduce__(self):
        return _rebuild_lora, (type(self), self.adapter, self.field, self.reason, self.limit)


def _rebuild_lora(cls, adapter, field, message, limit):
    return cls(adapter, field, message, limit=limit)


class ModelFileError(ValueError):
    """A model file arcjax cannot use; `.path` names the file, the message says what is wrong."""

    def __init__(self, path, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason

    def __reduce__(self):
        return type(self), (self.path, self.reason)


class WeightsError(ModelFileError):
    """A checkpoint that cannot be loaded (missing, truncated or mismatched tensors)."""


class ModelConfigError(ModelFileError):
    """A config.json that arcjax cannot run (names the field and why)."""


class QuantizationConfigError(ModelConfigError):
    """A `quantization_config` arcjax cannot load; `.field` names the option
    ("quantization_config.bits", ...)."""

    def __init__(self, path, field: str, reason: str):
        super().__init__(path, f"{field}: {reason}")
        self.field = field
        self.detail = reason

    def __reduce__(self):
        return type(self), (self.path, self.field, self.detail)
