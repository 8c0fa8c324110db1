"""GGUF files (llama.cpp's format): metadata and dequantized weights.

1. `GGUFFile(path)` reads the header, the metadata and the tensor table (struct reads over
   a memory map: milliseconds, where `gguf.GGUFReader` spends seconds building a view per
   array element); tensor data stays on disk until read.
2. `gguf_config(f)` (`gguf_config.py`) builds the `ModelConfig` from the metadata.
3. `load_gguf(path, dtype)` dequantizes every tensor at load with the `gguf` package
   (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K and the i-quants it knows),
   undoes llama.cpp's rotary permutation of q/k for the `llama` architecture (Mixtral
   included: its converter interleaves each head's halves for GGML's rope mode 0; qwen
   and gemma use NEOX mode and are stored unpermuted), splits the merged expert tensors
   `ffn_{gate,up,down}_exps` [E, out, in] into the stacked expert weights, joins
   DeepSeek's split `attn_k_b` / `attn_v_b` back into `kv_b_proj` (`deepseek2`: stored
   unpermuted, GGML's rope mode 0 rotates DeepSeek's interleaved pairs), takes 1 off
   Gemma's norm weights (llama.cpp stores 1 + w, as transformers' GGUF loader undoes too),
   and fills the params tree through the same assembly as safetensors checkpoints
   (`hf_layout.assemble_host`, by Hugging Face tensor name: `gguf_name` maps each to its
   GGUF tensor). `gguf_host(f, dtype)` is the same in host memory, for the loader to place.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import os
import re
import struct
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from arcjax.errors import WeightsError
from arcjax.model.formats.gguf_config import ARCHITECTURES, gguf_config
from arcjax.model.formats.gguf_packed import (BLOCKS, PACKED_TYPES, BlockCodes, common_layout,
                                              decode_blocks, packed_tensor, permute_rows,
                                              to_common)
from arcjax.model.formats.hf_layout import (TOP_NAMES, HostModel, assemble_host, hf_layer_name,
                                            layer_stacks, tree_at)
from arcjax.model.model_config import ModelConfig
from arcjax.model.packed import stack_packed
from arcjax.model.quant import LINEAR_WEIGHTS
from arcjax.model.specs import Params, param_specs

_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    # mixtures of experts (the experts themselves: `_EXPERT`)
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    # DeepSeek-V2/V3: latent attention, the noaux_tc correction, the shared experts
    # (kv_b_proj: `attn_kv_b`, or split in newer files: `_split_kv_b`)
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "self_attn.kv_b_proj.weight": "attn_kv_b.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    # Gemma (post_attention_layernorm: `_GEMMA_TENSORS`)
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# Gemma's post_attention_layernorm normalizes the attention output (not the MLP's input).
_GEMMA_TENSORS = {"post_attention_layernorm.weight": "post_attention_norm.weight"}
# One expert's matrix of a merged [E, out, in] tensor (Qwen names, Mixtral's w1/w3/w2).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_TENSORS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
                   "down_proj": "down", "w2": "down"}
_TOP_TENSORS = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

# GGUF metadata value types: id -> struct format (scalars); 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_ARRAY_DTYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4",
                 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # GGUF order (ne0 first: the contiguous dimension)
    ggml_type: int
    offset: int  # absolute, in the file


class GGUFFile:
    """A GGUF file's metadata and tensor table; tensors read on demand (memory-mapped).

    Raises:
      WeightsError: not a GGUF file, an unsupported version, or truncated.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as fh:
                self._buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise WeightsError(self.path, f"cannot open ({e})") from e
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, IndexError) as e:
            raise WeightsError(self.path, f"not a valid GGUF file ({e})") from e

    def _parse(self) -> None:
        buf, pos = self._buf, 0
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic (expected 'GGUF')")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in (2, 3):
            raise ValueError(f"version {version} is not supported (2 or 3)")
        pos = 24

        def string(pos):
            (n,) = struct.unpack_from("<Q", buf, pos)
            return buf[pos + 8:pos + 8 + n].decode("utf-8", errors="replace"), pos + 8 + n

        def value(kind, pos):
            if kind in _SCALARS:
                fmt = _SCALARS[kind]
                return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
            if kind == 8:
                return string(pos)
            if kind != 9:
                raise ValueError(f"unknown metadata value type {kind}")
            item, count = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if item in _ARRAY_DTYPES:
                arr = np.frombuffer(buf, _ARRAY_DTYPES[item], count, pos)
                return arr.tolist(), pos + arr.nbytes
            out = []
            for _ in range(count):
                v, pos = value(item, pos)
                out.append(v)
            return out, pos

        self.metadata: dict = {}
        for _ in range(n_kv):
            key, pos = string(pos)
            (kind,) = struct.unpack_from("<I", buf, pos)
            self.metadata[key], pos = value(kind, pos + 4)
        infos = []
        for _ in range(n_tensors):
            name, pos = string(pos)
            (n_dims,) = struct.unpack_from("<I", buf, pos)
            shape = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
            ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
            pos += 4 + 8 * n_dims + 12
            infos.append((name, tuple(shape), ggml_type, offset))
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-pos // align) * align
        self.tensors = {n: TensorInfo(n, s, t, data_start + o) for n, s, t, o in infos}

    def get(self, key: str, default=None):
        return self.metadata.get(key, default)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def type_name(self, name: str) -> str:
        """Tensor `name`'s GGML type ("Q4_1", "F32", ...).

        Raises:
          WeightsError: a type the gguf package does not know.
        """
        import gguf

        try:
            return gguf.GGMLQuantizationType(self.tensors[name].ggml_type).name
        except ValueError:
            raise WeightsError(self.path, f"tensor {name} has unknown GGML type "
                                          f"{self.tensors[name].ggml_type}") from None

    def raw(self, name: str) -> np.ndarray:
        """Tensor `name`'s blocks as stored: [rows, bytes per row] uint8 (memory-mapped).

        Raises:
          WeightsError: an unknown type, rows not whole blocks, or data past the end.
        """
        import gguf

        info, qtype = self.tensors[name], self.type_name(name)
        block, type_size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
        ne0, rows = info.shape[0], int(np.prod(info.shape[1:], dtype=np.int64))
        if ne0 % block:
            raise WeightsError(self.path, f"tensor {name}: row of {ne0} is not a multiple of "
                                          f"{qtype}'s block of {block}")
        row_bytes = ne0 // block * type_size
        if info.offset + rows * row_bytes > len(self._buf):
            raise WeightsError(self.path, f"tensor {name} runs past the end of the file "
                                          "(truncated?)")
        return np.frombuffer(self._buf, np.uint8, rows * row_bytes, info.offset).reshape(
            rows, row_bytes)

    def read(self, name: str) -> np.ndarray:
        """Tensor `name` dequantized to float32, numpy order (GGUF shape reversed).

        Raises:
          WeightsError: a type the gguf package cannot dequantize, or data past the end.
        """
        import gguf

        raw, qtype = self.raw(name), self.type_name(name)
        try:
            out = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])
        except NotImplementedError as e:
            raise WeightsError(self.path, f"tensor {name}: {qtype} cannot be "
                                          f"dequantized ({e})") from e
        return np.asarray(out, np.float32).reshape(self.tensors[name].shape[::-1])

    def read_codes(self, name: str) -> BlockCodes:
        """Tensor `name`'s blocks as integer codes and per-group floats (a type of
        `gguf_packed.PACKED_TYPES`), [rows, ne0] order."""
        return decode_blocks(self.raw(name).reshape(-1, BLOCKS[self.type_name(name)][1]),
                             self.type_name(name))


def gguf_name(hf_name: str, gemma: bool = False) -> tuple[str, int | None]:
    """(GGUF tensor name, expert) of a Hugging Face tensor name: an expert's matrix is
    entry `expert` of the layer's merged `ffn_{gate,up,down}_exps` tensor (else None)."""
    m = _LAYER_NAME.match(hf_name)
    if not m:
        return _TOP_TENSORS[hf_name], None
    layer, rest = m.groups()
    expert = _EXPERT.match(rest)
    if expert:
        return f"blk.{layer}.ffn_{_EXPERT_TENSORS[expert.group(2)]}_exps.weight", int(
            expert.group(1))
    names = {**_LAYER_TENSORS, **_GEMMA_TENSORS} if gemma else _LAYER_TENSORS
    return f"blk.{layer}.{names[rest]}", None


def unpermute_rotary(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undoes llama.cpp's q/k permutation: rows [out] of each head go from interleaved
    pairs back to Hugging Face's two halves. w: [out, ...] (a weight or a bias)."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _split_kv_b(f: GGUFFile, name: str) -> np.ndarray | None:
    """`attn_kv_b` [Hq * (dn + dv), Dl] from llama.cpp's split `attn_k_b` [Hq, Dl, dn]
    (transposed) and `attn_v_b` [Hq, dv, Dl] (files converted for its absorbed MLA, which
    drop `attn_kv_b`); None when they are absent too."""
    k_name, v_name = (name.replace("attn_kv_b", part) for part in ("attn_k_b", "attn_v_b"))
    if k_name not in f.tensors or v_name not in f.tensors:
        return None
    k_b, v_b = f.read(k_name), f.read(v_name)
    if k_b.ndim != 3 or v_b.ndim != 3 or k_b.shape[:2] != (v_b.shape[0], v_b.shape[2]):
        raise WeightsError(f.path, f"tensors {k_name} {k_b.shape[::-1]} and {v_name} "
                                   f"{v_b.shape[::-1]} do not split one kv_b")
    kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [Hq, dn + dv, Dl]
    return kv_b.reshape(-1, kv_b.shape[-1])


def gguf_host(f: GGUFFile, dtype=jnp.float32, packed: bool = False) -> HostModel:
    """A GGUF model in host memory: every tensor dequantized, or with `packed` the linear
    weights, embedding and LM head of `gguf_packed.PACKED_TYPES` kept packed
    (`PackedWeight`s, converted from the blocks without going through float) and the
    rest dequantized.

    Raises:
      ModelConfigError: unsupported or inconsistent metadata.
      WeightsError: a tensor is missing, malformed or of a type that cannot be dequantized.
    """
    cfg = gguf_config(f)
    permuted = ARCHITECTURES[f.architecture][1]
    gemma = cfg.norm_unit_offset
    merged: dict[str, np.ndarray] = {}  # the last merged expert tensor read, [E, out, in]

    def read_expert(name: str, expert: int) -> np.ndarray | None:
        if name not in f.tensors:  # older files: one tensor per expert, blk.N.ffn_gate.E
            single = name.replace("_exps.weight", f".{expert}.weight")
            return f.read(single) if single in f.tensors else None
        if name not in merged:
            merged.clear()
            merged[name] = f.read(name)
        if merged[name].shape[0] != cfg.num_experts:
            raise WeightsError(f.path, f"tensor {name} holds {merged[name].shape[0]} experts, "
                                       f"expert_count is {cfg.num_experts}")
        return merged[name][expert]

    def rotary_heads(name: str) -> int | None:
        """Heads whose rows llama.cpp permuted in tensor `name` (None: not permuted)."""
        if permuted and (".attn_q." in name or ".attn_k." in name):
            return cfg.num_heads if ".attn_q." in name else cfg.num_kv_heads
        return None

    def read(hf_name: str) -> np.ndarray | None:
        name, expert = gguf_name(hf_name, gemma)
        if expert is not None:
            return read_expert(name, expert)
        if name not in f.tensors:
            return _split_kv_b(f, name) if name.endswith(".attn_kv_b.weight") else None
        w = f.read(name)
        if rotary_heads(name):
            w = unpermute_rotary(w, rotary_heads(name))
        if gemma and name.endswith("norm.weight"):  # llama.cpp stores Gemma's norms as 1 + w
            w = w - 1.0
        if name.endswith("ffn_gate_inp_shexp.weight"):  # [H] or [1, H]: HF's [1, H]
            w = w.reshape(1, -1)
        return w

    sources = _packable(f, cfg, gemma) if packed else {}
    host = assemble_host(cfg, read, dtype, lambda _: f.path,
                         skip=tuple(dict.fromkeys(path[-1] for path in sources)))
    specs = param_specs(cfg)
    for path, tensors in sources.items():
        shape = tree_at(specs, path).shape
        want = shape[::-1] if path == ("embed",) else shape  # embed: stored [H, V]
        tree_at(host, path[:-1])[path[-1]] = _packed_weight(f, tensors, want, rotary_heads)
    return HostModel(cfg, host)


def _packable(f: GGUFFile, cfg: ModelConfig, gemma: bool) -> dict[tuple[str, ...], list[str]]:
    """The weights kept packed: path in the params tree -> its GGUF tensors (one per
    layer, or per layer and expert in files that predate merged experts), when all of
    them are packable (a layer weight in every layer stack holding it, or in none)."""
    specs = param_specs(cfg)
    ok = lambda names: all(n in f.tensors and f.type_name(n) in PACKED_TYPES for n in names)
    out = {}
    for key in ("embed", "lm_head"):
        names = [gguf_name(TOP_NAMES[key][0])[0]]
        if key in specs and ok(names):
            out[(key,)] = names
    for key in LINEAR_WEIGHTS:
        paths = {}
        for stack, first in layer_stacks(cfg).items():
            if key not in specs[stack]:
                continue
            spec, names = specs[stack][key], []
            for layer in range(first, first + spec.shape[0]):
                name, _ = gguf_name(hf_layer_name(cfg, key, layer), gemma)
                if spec.axes[1] == "expert" and name not in f.tensors:  # blk.N.ffn_gate.E
                    names += [name.replace("_exps.weight", f".{e}.weight")
                              for e in range(cfg.num_experts)]
                else:
                    names.append(name)
            paths[(stack, key)] = names
        if paths and all(ok(names) for names in paths.values()):
            out |= paths
    return out


def _packed_weight(f: GGUFFile, names: list[str], want: tuple[int, ...], rotary_heads):
    """One stacked weight [..., in, out] from its GGUF tensors (`_packable`), in one
    layout (`gguf_packed.common_layout` when their types differ).

    Raises:
      WeightsError: a tensor's shape disagrees with the config.
    """
    types = [f.type_name(n) for n in names]
    layout = common_layout(types)
    fmt = "+".join(sorted(set(types))).lower()
    parts = []
    for name in names:
        codes = f.read_codes(name)
        if layout is not None:
            codes = to_common(codes, layout)
        shape = f.tensors[name].shape[::-1]  # [(E,) rows, ne0]
        heads = rotary_heads(name)
        if heads:
            codes = permute_rows(codes, shape[-1], functools.partial(unpermute_rotary,
                                                                     n_heads=heads))
        parts.append(packed_tensor(codes, shape, fmt))
    lead = want[:-2]
    stacked = stack_packed(parts, lead[:len(lead) - (len(parts[0].shape) - 2)])
    if stacked is None or tuple(stacked.shape) != tuple(want):
        got = stacked.shape if stacked is not None else parts[0].shape
        raise WeightsError(f.path, f"tensor {names[0]} gives a weight of shape "
                                   f"{tuple(got)[::-1]}, the config implies {tuple(want)[::-1]}")
    return stacked


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, Params]:
    """Loads a GGUF file into (config, params on the default device); see `gguf_host`."""
    host = gguf_host(GGUFFile(path), dtype)
    return host.cfg, jax.tree.map(jnp.asarray, host.params)
