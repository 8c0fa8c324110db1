"""A checkpoint's `quantization_config` (config.json) as a `CheckpointQuant`, every option
checked before any weight loads.

Read (`quant_method`):

- `fp8` (transformers' fine-grained FP8: Qwen3-*-FP8, DeepSeek-V3): e4m3, per tensor,
  channel or `weight_block_size` blocks.
- `compressed-tensors` (llm-compressor): formats `float-quantized`, `naive-quantized`,
  `int-quantized` (8-bit symmetric FP8 or INT8 weights), and `pack-quantized` (W4A16 and
  friends: 2-, 4- or 8-bit integer weights packed into int32, `group` / `channel` /
  `tensor` strategies, symmetric or with zero points, `weight_g_idx` when present).
- `awq` (AutoAWQ's GEMM layout): 4 bits, zero points, any group size.
- `gptq` (AutoGPTQ / GPTQModel / optimum): 2, 4 or 8 bits, `sym` true or false,
  `desc_act` true or false (rows read their group through `g_idx`; under tensor
  parallelism a device's rows read the whole, unsplit scales), `checkpoint_format`
  "gptq" (zero points stored minus one, as AutoGPTQ packs them) or "gptq_v2".
- `mxfp4` (gpt-oss's published checkpoints; `GptOssForCausalLM` only): the experts'
  `*_blocks` / `*_scales`, kept packed on the device (`fused_experts.packed_experts`), or
  decoded at load with `quantization="dequantize"` (`fused_experts.reader`, `mxfp4`).

Refused with a `QuantizationConfigError` naming the field: other methods; 3-bit (and any
width but 2, 4, 8) packing; AWQ's GEMV / Marlin / ExLlama layouts and AWQ without zero
points; GPTQ's Marlin / BitBLAS formats and per-module `dynamic` overrides; activation
quantization of packed checkpoints (`input_activations`: arcjax runs W4A16, weights
dequantized into the compute dtype; FP8 / INT8 checkpoints' activation scales are ignored,
run as W8A16, as before); block and tensor-group strategies for packed weights; config groups
of different schemes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from arcjax.errors import QuantizationConfigError
from arcjax.model.formats import fused_experts, mxfp4
from arcjax.model.formats.hf_layout import read_config, read_config_json

PACKED_BITS = (2, 4, 8)  # code widths whose int32 packing never splits a code
PACKED_METHODS = ("awq", "gptq", "pack-quantized")


@dataclasses.dataclass(frozen=True)
class CheckpointQuant:
    """What a checkpoint's quantization_config says.

    Attributes:
      fmt: "fp8", "int8" (values + scales), a packed method of `PACKED_METHODS`, or
        "mxfp4" (gpt-oss's experts in MXFP4).
      block: the block size of block-scaled FP8/INT8 weights (rows, columns) in [out, in]
        terms, or None when scales are per tensor or per channel.
      bits: bits per packed code.
      group: input rows per scale of packed weights (None: one per output channel).
      symmetric: packed codes have no zero points (a fixed midpoint instead).
      zero_plus_one: GPTQ v1: the stored zero points are one less than the real ones.
    """

    fmt: str
    block: tuple[int, int] | None = None
    bits: int = 8
    group: int | None = None
    symmetric: bool = True
    zero_plus_one: bool = False

    @property
    def packed(self) -> bool:
        return self.fmt in PACKED_METHODS


def checkpoint_quantization(model_dir: Path) -> CheckpointQuant | None:
    """The weight quantization config.json declares, None for a float checkpoint.

    Raises:
      ModelConfigError: a bad config.json (`hf_layout.read_config`'s errors come first).
      QuantizationConfigError: a method, format or option arcjax cannot load (`.field`
        names it, e.g. "quantization_config.bits").
    """
    cfg = read_config(model_dir)  # the typed errors of a bad config.json
    where = Path(model_dir) / "config.json"
    q = read_config_json(model_dir).get("quantization_config")
    if not q:
        return None

    def refuse(field: str, reason: str):
        raise QuantizationConfigError(where, f"quantization_config.{field}", reason)

    method = q.get("quant_method")
    if method == mxfp4.QUANT_METHOD:
        if cfg.architecture != fused_experts.ARCHITECTURE:
            refuse("quant_method", f"'mxfp4' is supported for {fused_experts.ARCHITECTURE} "
                                   "only")
        return CheckpointQuant(mxfp4.QUANT_METHOD)
    if method == "fp8":
        if q.get("fmt", "e4m3") != "e4m3":
            refuse("fmt", f"fp8 format {q.get('fmt')!r} is not supported (e4m3)")
        block = q.get("weight_block_size")
        return CheckpointQuant("fp8", tuple(block) if block else None)
    if method == "compressed-tensors":
        return _compressed_tensors(q, refuse)
    if method == "awq":
        return _awq(q, refuse)
    if method == "gptq":
        return _gptq(q, refuse)
    refuse("quant_method", f"{method!r} is not supported (fp8, awq, gptq, "
                           "compressed-tensors, mxfp4 for gpt-oss)")


def _group(value, field: str, refuse) -> int | None:
    """A group size: a positive int, or -1 / None for one scale per output channel."""
    if value in (None, -1):
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        refuse(field, f"must be a positive int or -1, got {value!r}")
    return value


def _bits(value, field: str, refuse) -> int:
    if value not in PACKED_BITS:
        refuse(field, f"{value!r}-bit weights are not supported ({', '.join(map(str, PACKED_BITS))}"
                      " bits: their int32 packing never splits a code)")
    return value


def _awq(q: dict, refuse) -> CheckpointQuant:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        refuse("version", f"AWQ layout {version!r} is not supported (gemm)")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        refuse("bits", f"AWQ with {bits!r} bits is not supported (4)")
    if not q.get("zero_point", True):
        refuse("zero_point", "AWQ without zero points is not supported (AutoAWQ's GEMM "
                             "layout always has them)")
    group = _group(q.get("group_size", q.get("q_group_size", 128)), "group_size", refuse)
    return CheckpointQuant("awq", bits=4, group=group, symmetric=False)


def _gptq(q: dict, refuse) -> CheckpointQuant:
    fmt = str(q.get("checkpoint_format", "gptq")).lower()
    if fmt not in ("gptq", "gptq_v2"):
        refuse("checkpoint_format", f"{fmt!r} is not supported (gptq, gptq_v2)")
    if q.get("dynamic"):
        refuse("dynamic", "per-module overrides are not supported")
    bits = _bits(q.get("bits"), "bits", refuse)
    group = _group(q.get("group_size", 128), "group_size", refuse)
    return CheckpointQuant("gptq", bits=bits, group=group, symmetric=bool(q.get("sym", True)),
                           zero_plus_one=fmt == "gptq")


def _compressed_tensors(q: dict, refuse) -> CheckpointQuant:
    fmt = q.get("format")
    if fmt not in ("float-quantized", "naive-quantized", "int-quantized", "pack-quantized"):
        refuse("format", f"compressed-tensors format {fmt!r} is not supported "
                         "(float-quantized, int-quantized, pack-quantized)")
    config_groups = q.get("config_groups") or {}
    if not config_groups:
        refuse("config_groups", "compressed-tensors config has no config_groups")
    groups = [g.get("weights") or {} for g in config_groups.values()]
    if fmt == "pack-quantized":
        for name, g in config_groups.items():
            for kind in ("input_activations", "output_activations"):
                if g.get(kind):
                    refuse(f"config_groups.{name}.{kind}", "activation quantization is not "
                           "supported (weights are dequantized into the compute dtype)")
        return _pack_quantized(groups, refuse)
    kinds = {(w.get("type"), w.get("num_bits"), w.get("symmetric", True)) for w in groups}
    if kinds == {("float", 8, True)}:
        kind = "fp8"
    elif kinds == {("int", 8, True)}:
        kind = "int8"
    else:
        refuse("config_groups", f"compressed-tensors weights {sorted(map(str, kinds))} are "
                                f"not supported in format {fmt} (8-bit symmetric float or int)")
    blocks = {tuple(w["block_structure"]) for w in groups if w.get("block_structure")}
    return CheckpointQuant(kind, blocks.pop() if len(blocks) == 1 else None)


def _pack_quantized(groups: list[dict], refuse) -> CheckpointQuant:
    keys = ("type", "num_bits", "symmetric", "strategy", "group_size")
    schemes = {tuple(w.get(k) for k in keys) for w in groups}
    if len(schemes) != 1:
        refuse("config_groups", f"config groups of different weight schemes {sorted(map(str, schemes))}"
                                " are not supported")
    w = groups[0]
    if w.get("type", "int") != "int":
        refuse("config_groups.weights.type", f"{w.get('type')!r} weights are not supported in "
                                            "pack-quantized (int)")
    bits = _bits(w.get("num_bits"), "config_groups.weights.num_bits", refuse)
    strategy = w.get("strategy")
    if strategy not in ("group", "channel", "tensor"):
        refuse("config_groups.weights.strategy", f"{strategy!r} is not supported for packed "
                                                "weights (group, channel, tensor)")
    if w.get("dynamic"):
        refuse("config_groups.weights.dynamic", "dynamic weight quantization is not supported")
    group = None
    if strategy == "group":
        group = _group(w.get("group_size"), "config_groups.weights.group_size", refuse)
    return CheckpointQuant("pack-quantized", bits=bits, group=group,
                           symmetric=bool(w.get("symmetric", True)))
