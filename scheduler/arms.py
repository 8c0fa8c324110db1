"""Arm specs: one policy plus knob overrides, written "policy[:key=value]...".

One parser for every tool that compares scheduling configurations (scripts/simulate.py, the burst
benchmark): `parse_arm("token_budget:budget=512:floor=2")` gives an `Arm`, and
`Arm.config(base)` the `SchedulerConfig` it describes over `base`'s cache.

Keys are the short names of `ARM_KEYS` (budget, cap, floor, tile, threshold, partials, seqs) or the
SchedulerConfig field names they stand for; values are integers. A bad spec raises `ConfigError`
(a ValueError) naming the spec and the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from scheduler.scheduler_config import POLICIES, SchedulerConfig
from scheduler.scheduler_errors import ConfigError

# Arm spec key -> SchedulerConfig field.
ARM_KEYS = {
    "budget": "max_num_batched_tokens",
    "cap": "prefill_max_seqs",
    "floor": "prefill_floor_steps",
    "tile": "chunk_tile",
    "threshold": "long_prefill_token_threshold",
    "partials": "max_num_partial_prefills",
    "seqs": "max_num_seqs",
}

# SchedulerConfig field -> its short arm key (for compact reports).
KNOB_SHORT = {field: key for key, field in ARM_KEYS.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Arm:
    """One scheduling configuration of an experiment.

    Attributes:
      name: the spec it was parsed from ("policy[:key=value]...").
      policy: a scheduler policy.
      overrides: SchedulerConfig field -> value, as the spec set them.
    """

    name: str
    policy: str
    overrides: Mapping[str, int]

    def config(self, base: SchedulerConfig) -> SchedulerConfig:
        """`base` with this arm's policy and knobs (same cache geometry)."""
        return dataclasses.replace(base, policy=self.policy, **self.overrides)

    @property
    def configured_knobs(self) -> dict[str, int]:
        """The knobs this arm sets explicitly (nonzero); each should engage at least once."""
        return {k: v for k, v in self.overrides.items() if v}


def parse_arm(spec: str) -> Arm:
    """Parses "policy[:key=value]...".

    Raises:
      ConfigError (a ValueError): unknown policy (field "policy"), a pair that is not key=value
        with a known key (field: the key as written), or a value that is not an integer (field:
        the SchedulerConfig field).
    """
    policy, *pairs = spec.strip().split(":")
    if policy not in POLICIES:
        raise ConfigError("policy", f"arm {spec!r}: policy must be one of {POLICIES}, "
                                    f"got {policy!r}")
    overrides = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        field = ARM_KEYS.get(key, key)
        if not sep or field not in KNOB_SHORT:
            raise ConfigError(key or "arm", f"arm {spec!r}: expected key=value with key in "
                                            f"{sorted(ARM_KEYS)}, got {pair!r}")
        try:
            overrides[field] = int(value)
        except ValueError:
            raise ConfigError(field, f"arm {spec!r}: {key} must be an integer, "
                                     f"got {value!r}") from None
    return Arm(name=spec.strip(), policy=policy, overrides=overrides)
