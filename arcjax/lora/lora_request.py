"""`LoRARequest`: which LoRA adapter a request runs with (vLLM's `vllm.lora.request`).

Passed as `lora_request=` to `LLM.generate` / `chat` / `stream` / `add_request` and
`AsyncLLM.generate`; None runs the base model. `lora_int_id` is the adapter's identity:
requests with equal ids share one loaded adapter (and its prefix-cache blocks), so one id
must always name the same adapter while it is loaded.
"""

from __future__ import annotations

import dataclasses
import os

from arcjax.errors import LoRAAdapterError


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter to run a request with.

    Attributes:
      lora_name: the adapter's name (what the server's `model` field selects).
      lora_int_id: its identity, an int >= 1, unique among the adapters in use.
      lora_path: a PEFT adapter directory (adapter_config.json and adapter_model.safetensors
        or .bin) or a Hugging Face Hub id of one.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    def __post_init__(self):
        name = self.lora_name
        if not isinstance(name, str) or not name.strip():
            raise LoRAAdapterError(str(name), "lora_request.lora_name",
                                   "must be a non-empty string")
        lid = self.lora_int_id
        if not isinstance(lid, int) or isinstance(lid, bool) or lid < 1:
            raise LoRAAdapterError(name, "lora_request.lora_int_id",
                                   f"must be an int >= 1, got {lid!r}", limit=1)
        path = self.lora_path
        if isinstance(path, os.PathLike):
            object.__setattr__(self, "lora_path", os.fspath(path))
        elif not isinstance(path, str):
            raise LoRAAdapterError(name, "lora_request.lora_path",
                                   f"must be a path or a Hub id, got {path!r}")
        if not self.lora_path.strip():
            raise LoRAAdapterError(name, "lora_request.lora_path",
                                   "must name a PEFT adapter directory or a Hub id")
