"""gpt-oss's expert weights as its checkpoints store them: one fused tensor per layer, read
one expert at a time.

A gpt-oss layer stores all its experts in four tensors (`E` experts, hidden `H`, width `I`):

    model.layers.{i}.mlp.experts.gate_up_proj       [E, H, 2I]  columns interleave gate, up
    model.layers.{i}.mlp.experts.gate_up_proj_bias  [E, 2I]
    model.layers.{i}.mlp.experts.down_proj          [E, I, H]
    model.layers.{i}.mlp.experts.down_proj_bias     [E, H]

already `[in, out]`; the published checkpoints replace the two weights by MXFP4
`*_blocks` / `*_scales` (`mxfp4`, `[E, out, in / 32, 16]`). `packed_experts` keeps those
as they are stored (`Mxfp4Weight`s [L, E, ...], gate and up the even and odd output rows
of gate_up's blocks), dequantized on the device inside the grouped GEMMs; `reader` decodes
them at load instead (`quantization="dequantize"`, and any expert tensor stored as float).

`hf_layout.GPT_OSS_LAYER_NAMES` gives each arcjax weight a name `"<fused tensor>@<part>"`
(`gate.{e}`, `up.{e}` or `{e}`) that `reader(read)` answers from the fused tensor, so
`hf_layout.assemble_host`'s per-(layer, expert) walk reads gpt-oss like any other family.
The reader keeps the last fused tensor it read: the walk reads a layer's experts one after
the other.
"""

from __future__ import annotations

import numpy as np

from arcjax.errors import WeightsError
from arcjax.model.formats import mxfp4
from arcjax.model.formats.hf_layout import FUSED, hf_layer_name, layer_stacks
from arcjax.model.model_config import ModelConfig
from arcjax.model.mxfp4_weight import BLOCK, Mxfp4Weight
from arcjax.model.specs import param_specs

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


def packed_experts(cfg: ModelConfig, read, where) -> dict[str, dict[str, Mxfp4Weight]]:
    """gpt-oss's MXFP4 experts as stored: stack -> weight ("we_gate", "we_up", "we_down")
    -> an `Mxfp4Weight` of numpy arrays (blocks [L, E, out, in / 32, 16], scales
    [L, E, out, in / 32]), for each weight whose fused tensor's first layer has `_blocks`
    and `_scales` (the others are the `reader`'s: float tensors). Each fused tensor is read
    once per layer (gate and up share gate_up's).

    Args:
      cfg: the model config.
      read: `read(hf_name) -> np.ndarray | None` over the checkpoint's tensors.
      where: `where(hf_name)`: the file errors about that tensor name.

    Raises:
      WeightsError: a later layer lacks the blocks, or their shape, dtype or scales are
        not the config's MXFP4 (`mxfp4.check`).
    """
    last: dict[str, tuple] = {}

    def layer_blocks(base: str):  # (blocks [E, out, G, 16], scales [E, out, G]) or None
        if base not in last:
            blocks, scales = read(base + "_blocks"), read(base + "_scales")
            if blocks is not None and scales is not None:
                blocks, scales = np.asarray(blocks), np.asarray(scales)
                mxfp4.check(blocks, scales, base)
                last.clear()
                last[base] = (blocks, scales)
            else:
                return None
        return last[base]

    out: dict[str, dict[str, Mxfp4Weight]] = {}
    for stack, first in layer_stacks(cfg).items():
        specs = param_specs(cfg)[stack]

        def base_part(key: str, i: int) -> list[str]:  # the fused tensor, the part
            return hf_layer_name(cfg, key, first + i).split(FUSED, 1)

        keys = [k for k in ("we_gate", "we_up", "we_down")
                if k in specs and layer_blocks(base_part(k, 0)[0]) is not None]
        arrays = {}  # weight -> (blocks [L, E, out, G, 16], scales [L, E, out, G])
        for k in keys:
            num_layers, num_experts, rows, cols = specs[k].shape  # [L, E, in, out]
            scales_shape = (num_layers, num_experts, cols, -(-rows // BLOCK))
            arrays[k] = (np.empty((*scales_shape, BLOCK // 2), np.uint8),
                         np.empty(scales_shape, np.uint8))
        for i in range(specs[keys[0]].shape[0] if keys else 0):
            for key in keys:
                base, part = base_part(key, i)
                got = layer_blocks(base)
                if got is None:
                    raise WeightsError(where(base), f"tensor {base}_blocks or {base}_scales "
                                                    "is missing (its first layer is MXFP4)")
                blocks, scales = got
                half = part.rpartition(".")[0]  # "gate", "up" or "" (down_proj)
                if half:  # gate_up's output rows interleave gate and up
                    pick = 0 if half == "gate" else 1
                    blocks = mxfp4.split_gate_up(blocks, axis=1)[pick]
                    scales = mxfp4.split_gate_up(scales, axis=1)[pick]
                want = arrays[key][0].shape[1:]  # [E, out, G, 16]
                if blocks.shape != want or specs[key].shape[2] % BLOCK:
                    raise WeightsError(where(base), f"MXFP4 {key} of layer {first + i} has "
                                                    f"blocks {blocks.shape}, the config "
                                                    f"implies {want}")
                arrays[key][0][i], arrays[key][1][i] = blocks, scales
        if keys:
            out[stack] = {k: Mxfp4Weight(*arrays[k]) for k in keys}
    return out
