"""`LoRAConfig`: how many adapters the engine holds and how it computes their deltas.

The fields carry vLLM's option names (`max_loras`, `max_lora_rank`, `max_cpu_loras`) plus
`lora_impl`; frozen and hashable. `max_loras` is also the scheduler's
(`SchedulerConfig.max_loras`): the adapters that may run at once, one device slot each.
`EngineConfig.lora_config` builds it from the engine options (docs/design/lora.md).
"""

from __future__ import annotations

import dataclasses

from arcjax.errors import EngineConfigError
from arcjax.model.lora_delta import IMPLS

LORA_IMPLS = ("auto", *IMPLS)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Attributes:
      max_loras: device slots: adapters running at once (slot 0 more, the base model's).
      max_lora_rank: the largest rank `r` an adapter may have; every slot holds this rank
        (a smaller adapter's A and B are padded with zeros).
      max_cpu_loras: adapters kept loaded in host memory (an LRU; adapters of unfinished
        requests are never dropped); None = max_loras.
      lora_impl: the delta's implementation (`arcjax.model.lora_delta`): "auto" (per
        platform) | "ragged_dot" | "gather" | "masked".
    """

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_impl: str = "auto"

    def __post_init__(self):
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise EngineConfigError(name, f"must be an int >= 1, got {value!r}", limit=1)
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or isinstance(cpu, bool)
                                or cpu < self.max_loras):
            raise EngineConfigError("max_cpu_loras", f"must be None or an int >= max_loras "
                                    f"({self.max_loras}), got {cpu!r}", limit=self.max_loras)
        if self.lora_impl not in LORA_IMPLS:
            raise EngineConfigError("lora_impl", f"must be one of {LORA_IMPLS}, got "
                                                 f"{self.lora_impl!r}")

    @property
    def cpu_capacity(self) -> int:
        """Adapters the host cache keeps loaded when none is in use."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
