"""What every benchmark script writes next to its figures: the machine and the command."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys


def machine() -> str:
    """The hardware and OS the figures were measured on."""
    return f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}"


def write_json(path: str | None, config, **results) -> None:
    """Writes {"meta": machine, config (a dataclass), argv; **results} to `path` (if set)."""
    if not path:
        return
    meta = {"machine": machine(), "config": dataclasses.asdict(config), "argv": sys.argv}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"meta": meta, **results}, f, indent=1)
