"""gpt-oss's expert weights as its checkpoints store them: one fused tensor per layer, read
one expert at a time.

A gpt-oss layer stores all its experts in four tensors (`E` experts, hidden `H`, width `I`):

    model.layers.{i}.mlp.experts.gate_up_proj       [E, H, 2I]  columns interleave gate, up
    model.layers.{i}.mlp.experts.gate_up_proj_bias  [E, 2I]
    model.layers.{i}.mlp.experts.down_proj          [E, I, H]
    model.layers.{i}.mlp.experts.down_proj_bias     [E, H]

already `[in, out]`; the published checkpoints replace the two weights by MXFP4
`*_blocks` / `*_scales` (`mxfp4`, `[E, out, in / 32, 16]`), decoded here at load.

`hf_layout.GPT_OSS_LAYER_NAMES` gives each arcjax weight a name `"<fused tensor>@<part>"`
(`gate.{e}`, `up.{e}` or `{e}`) that `reader(read)` answers from the fused tensor, so
`hf_layout.assemble_host`'s per-(layer, expert) walk reads gpt-oss like any other family.
The reader keeps the last fused tensor it read: the walk reads a layer's experts one after
the other.
"""

from __future__ import annotations

import numpy as np

from arcjax.model.formats import mxfp4
from arcjax.model.formats.hf_layout import FUSED

ARCHITECTURE = "GptOssForCausalLM"


def reader(read):
    """`read(name) -> np.ndarray | None` extended with the `"<fused>@<part>"` names.

    A fused weight missing as a float tensor is decoded from its MXFP4 `_blocks` and
    `_scales` (float32, transposed to `[E, in, out]`); None when neither is there.
    """
    last: dict[str, np.ndarray | None] = {}

    def fused(base: str) -> np.ndarray | None:
        if base not in last:
            arr = read(base)
            if arr is None and base.rsplit(".", 1)[-1] in mxfp4.EXPERT_TENSORS:
                blocks, scales = read(base + "_blocks"), read(base + "_scales")
                if blocks is not None and scales is not None:
                    arr = np.swapaxes(mxfp4.decode(np.asarray(blocks), np.asarray(scales),
                                                   base), -1, -2)  # [E, in, out]
            last.clear()
            last[base] = arr
        return last[base]

    def read_part(name: str) -> np.ndarray | None:
        if FUSED not in name:
            return read(name)
        base, part = name.split(FUSED, 1)
        arr = fused(base)
        if arr is None:
            return None
        half, _, expert = part.rpartition(".")
        x = arr[int(expert)]  # [in, out] or [out] of one expert
        if half:
            gate, up = mxfp4.split_gate_up(x, axis=-1)
            x = gate if half == "gate" else up
        return x

    return read_part
