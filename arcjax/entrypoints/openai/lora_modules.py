"""The LoRA adapters a server is told about, as vLLM spells them: `--lora-modules` items
(`LoRAModulePath`, parsed by `parse_lora_module`) and the bodies of
`POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`.

`--lora-modules` takes `name=path` or vLLM's JSON form
`{"name": ..., "path": ..., "base_model_name": ...}` (the base model an adapter's card names
as its `parent`; one of the served names). Runtime updates are refused unless the server
allows them (`--allow-runtime-lora-updating`, or vLLM's `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
set to 1 or true: `runtime_updating_allowed`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from arcjax.entrypoints.openai.protocol import OpenAIBaseModel
from arcjax.errors import ConfigError

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_MODULE_FIELDS = ("name", "path", "base_model_name")


@dataclasses.dataclass(frozen=True)
class LoRAModulePath:
    """One adapter served from start (vLLM's `LoRAModulePath`).

    Attributes:
      name: the id clients send as `model`.
      path: a PEFT adapter directory or a Hub id.
      base_model_name: the served model it adapts (its card's `parent`); None = the
        first served name.
    """

    name: str
    path: str
    base_model_name: str | None = None

    def __post_init__(self):
        for field in ("name", "path"):
            value = getattr(self, field)
            if not isinstance(value, str) or not value.strip():
                raise ConfigError(f"lora_modules.{field}", f"must be a non-empty string, got "
                                  f"{value!r}")
        base = self.base_model_name
        if base is not None and (not isinstance(base, str) or not base.strip()):
            raise ConfigError("lora_modules.base_model_name", f"must be a non-empty string "
                              f"or null, got {base!r}")


def parse_lora_module(text: str) -> LoRAModulePath:
    """One `--lora-modules` item: `name=path`, or a JSON object with `name`, `path` and
    optionally `base_model_name` (vLLM's two forms).

    Raises:
      ConfigError (field "lora_modules" or "lora_modules.<key>"): neither form.
    """
    if "=" in text and "," not in text and not text.lstrip().startswith("{"):
        name, _, path = text.partition("=")
        return LoRAModulePath(name.strip(), path.strip())
    try:
        item = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("lora_modules", f"{text!r} is neither name=path nor a JSON object "
                          f"({e})") from None
    if not isinstance(item, dict):
        raise ConfigError("lora_modules", f"{text!r}: the JSON form must be an object")
    unknown = sorted(set(item) - set(_MODULE_FIELDS))
    if unknown:
        raise ConfigError(f"lora_modules.{unknown[0]}", f"unknown key in {text!r} (known: "
                          f"{', '.join(_MODULE_FIELDS)})")
    return LoRAModulePath(item.get("name"), item.get("path"), item.get("base_model_name"))


def runtime_updating_allowed(flag: bool, environ=os.environ) -> bool:
    """Whether `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` answer: the flag, or
    vLLM's variable set to 1 / true."""
    return flag or environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/load_lora_adapter` (vLLM's): `load_inplace` replaces an adapter of the same
    name (its running requests finish with the old weights)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    """`POST /v1/unload_lora_adapter` (vLLM's); the adapter is found by name (`lora_int_id`
    is accepted, as vLLM accepts it, and not needed)."""

    lora_name: str
    lora_int_id: int | None = None
