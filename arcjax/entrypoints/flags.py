"""absl flags from a frozen config dataclass, and the dataclass back from the flags.

Every field of the dataclass becomes a flag of the same name, type and default; scripts
and entry points read their settings as one validated, frozen config object.
"""

from __future__ import annotations

import dataclasses
import typing

from absl import flags

_DEFINE = {bool: flags.DEFINE_bool, int: flags.DEFINE_integer, float: flags.DEFINE_float,
           str: flags.DEFINE_string}


def define_flags(cls, help_texts: dict[str, str] | None = None, prefix: str = "") -> None:
    """Defines a flag per field of dataclass `cls` (bool, int, float or str fields)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        if name in flags.FLAGS:
            continue
        kind = hints[f.name]
        if kind not in _DEFINE:
            raise TypeError(f"{cls.__name__}.{f.name}: flags support bool/int/float/str, "
                            f"not {kind}")
        help_text = (help_texts or {}).get(f.name, f"{cls.__name__}.{f.name}")
        _DEFINE[kind](name, f.default, help_text)


def config_from_flags(cls, prefix: str = ""):
    """An instance of `cls` built from the parsed flags `define_flags(cls)` declared."""
    return cls(**{f.name: flags.FLAGS[prefix + f.name].value for f in dataclasses.fields(cls)})
