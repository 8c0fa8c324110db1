"""Compiles the GPU attention kernels for sm_90a offline and reports what ptxas made of them.

No GPU needed. Two kernels, side by side for every variant (`--kernels`):
- "pallas": the Pallas-Triton kernel (`pallas_gpu.py`) is lowered for CUDA on this host
  (`pallas_kernels.lowering`) and its Triton IR compiled with the standalone `triton`
  package (optional: `pip install triton`);
- "triton": the raw Triton kernel (`triton_kernel.py`) is compiled from its source with the
  constexprs `triton_gpu.launch_params` gives the launch, and every array pointer 16-byte
  aligned (what jax_triton tells Triton).
The PTX is assembled by the ptxas that triton bundles. Per variant it prints registers per
thread, shared memory, spill bytes, whether the dots became wgmma (Hopper) or mma.sync, the
`cp.async.wait_group` depths in the PTX, and blocks per SM (registers and shared memory).
Wait depths: 0 alone means every K/V load is waited for before its step computes; a
depth of N > 0 inside the loops means N more loads stay in flight (the 0 that remains
is the drain after each loop).

  1. Each variant is a kernel shape (mixed or decode-only plan, dtype, D, GQA group, page
     size; for the Triton kernel also a window, a soft-cap, float8 pages) and a tiling
     (block_m, block_k, warps, stages); `make_gpu_plan` fills the rest.
  2. Pallas: lower with `ShapeDtypeStruct` inputs (nothing is allocated), capture the
     Triton IR. Triton: the kernel's source with this variant's constexprs.
  3. `triton.compile` for `cuda:90` (sm_90a), then `ptxas -v` on the PTX. "global scratch"
     must be 0 for the Triton kernel: jax-triton 0.3 (the one that pairs with Triton 3.6)
     cannot allocate it.

  python scripts/gpu_compile_report.py                   # the default table
  python scripts/gpu_compile_report.py --only=prefill --out=/tmp/report.json
  python scripts/gpu_compile_report.py --kernels=triton --only=decode
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
from absl import app, flags

from pallas_kernels import api, gpu_plan, lowering, pallas_gpu, triton_gpu
from pallas_kernels.attention_inputs import AttentionInputs

_ONLY = flags.DEFINE_list("only", [], "only variants whose name starts with one of these")
_OUT = flags.DEFINE_string("out", None, "write the table as JSON here")
_ARCH = flags.DEFINE_integer("arch", 90, "CUDA compute capability to compile for")
_KERNELS = flags.DEFINE_list("kernels", ["pallas", "triton"], "pallas and/or triton")

SM_REGISTERS = 65536  # per SM on sm_90
SM_SMEM_BYTES = 228 * 1024  # per SM on sm_90 ...
BLOCK_SMEM_BYTES = 227 * 1024  # ... and the most one block may use


@dataclasses.dataclass(frozen=True, kw_only=True)
class Variant:
    name: str
    decode_only: bool  # max_q_len == 1 plan (split-K) vs a mixed prefill+decode plan
    dtype: str = "bfloat16"
    head_dim: int = 128
    group: int = 4  # query heads per KV head
    num_kv_heads: int = 8
    page_size: int = 16
    tuning: tuple[tuple[str, int | bool], ...] = ()  # make_gpu_plan overrides
    kv_dtype: str | None = None  # page dtype if not `dtype` (Triton kernel: float8 pages)
    window: bool = False  # Triton kernel: a sliding window
    softcap: bool = False  # Triton kernel: a logit soft-cap
    kernels: tuple[str, ...] = ("pallas", "triton")  # which kernels this variant exists for


def variants() -> list[Variant]:
    """Llama-8B heads (32:8, D=128) unless named otherwise; T=2048/S=64 mixed, 256x2k decode."""
    out = []
    for ps in (16, 32):
        out.append(Variant(name=f"prefill_default_bs{ps}", decode_only=False, page_size=ps))
    for bm, bk, warps in ((64, 64, 4), (128, 64, 8), (128, 32, 8), (128, 128, 8), (256, 64, 8)):
        out.append(Variant(name=f"prefill_m{bm}_k{bk}_w{warps}", decode_only=False,
                           tuning=(("block_m", bm), ("block_k", bk), ("num_warps", warps))))
    out.append(Variant(name="prefill_m64_stages2", decode_only=False,  # before issue 16
                       tuning=(("block_m", 64), ("num_stages", 2))))
    out.append(Variant(name="prefill_stages2", decode_only=False, tuning=(("num_stages", 2),)))
    out.append(Variant(name="prefill_nosplit", decode_only=False, tuning=(("num_splits", 1),)))
    out.append(Variant(name="prefill_f32", decode_only=False, dtype="float32"))
    out.append(Variant(name="prefill_d64_g8", decode_only=False, head_dim=64, group=8))
    for ps in (16, 32):
        out.append(Variant(name=f"decode_default_bs{ps}", decode_only=True, page_size=ps))
    out.append(Variant(name="decode_k128", decode_only=True, tuning=(("block_k", 128),)))
    out.append(Variant(name="decode_split4", decode_only=True, tuning=(("num_splits", 4),)))
    out.append(Variant(name="decode_stages2", decode_only=True, tuning=(("num_stages", 2),)))
    out.append(Variant(name="decode_f32", decode_only=True, dtype="float32"))
    out.append(Variant(name="decode_g1_d64", decode_only=True, head_dim=64, group=1))
    # The signature's options, on the Triton kernel (Gemma-2-like local layers, fp8 cache).
    out.append(Variant(name="prefill_window_softcap", decode_only=False, window=True,
                       softcap=True, kernels=("triton",)))
    out.append(Variant(name="prefill_fp8_pages", decode_only=False, kv_dtype="float8_e4m3fn",
                       kernels=("triton",)))
    out.append(Variant(name="decode_fp8_pages", decode_only=True, kv_dtype="float8_e4m3fn",
                       kernels=("triton",)))
    out.append(Variant(name="decode_window", decode_only=True, window=True,
                       kernels=("triton",)))
    # Batch-invariant plans (one plan for decode and prefill buckets, no split-K).
    for decode in (False, True):
        out.append(Variant(name=f"{'decode' if decode else 'prefill'}_invariant",
                           decode_only=decode, tuning=(("batch_invariant", True),)))
    return out


def plan_and_inputs(v: Variant) -> tuple[gpu_plan.GpuPlan, AttentionInputs]:
    """The GPU plan and abstract kernel inputs (`jax.ShapeDtypeStruct` fields) of a variant."""
    if v.decode_only:
        num_tokens, num_seqs, max_kv = 256, 256, 2048
    else:
        num_tokens, num_seqs, max_kv = 2048, 64, 8192
    hkv, hq, d = v.num_kv_heads, v.num_kv_heads * v.group, v.head_dim
    max_blocks = max_kv // v.page_size
    num_blocks = num_seqs * max_blocks // 4
    dtype = jnp.dtype(v.dtype)
    sds, i32, f32 = jax.ShapeDtypeStruct, jnp.int32, jnp.float32
    kv_dtype = jnp.dtype(v.kv_dtype or v.dtype)
    scale = sds((), f32) if v.kv_dtype else None  # quantized pages carry their scales
    pages = sds((num_blocks, v.page_size, hkv, d), kv_dtype)
    inputs = AttentionInputs.create(
        q=sds((num_tokens, hq, d), dtype), k_pages=pages, v_pages=pages,
        block_tables=sds((num_seqs, max_blocks), i32), kv_lens=sds((num_seqs,), i32),
        cu_seqlens_q=sds((num_seqs + 1,), i32), num_seqs=sds((), i32),
        sliding_window=sds((), i32) if v.window else None,
        logit_softcap=50.0 if v.softcap else None, k_scale=scale, v_scale=scale,
        max_q_len=1 if v.decode_only else num_tokens)
    return api.gpu_plan_for(inputs, **dict(v.tuning)), inputs


def triton_ir(v: Variant) -> tuple[gpu_plan.GpuPlan, str]:
    plan, inputs = plan_and_inputs(v)
    with lowering.capture_triton_ir() as modules:
        lowering.lower_for_cuda(pallas_gpu.ragged_paged_attention_pallas_gpu, inputs, plan=plan)
    if len(modules) != 1:
        raise RuntimeError(f"{v.name}: expected one Triton kernel, lowered {len(modules)}")
    return plan, modules[0].ir


# Triton's names of the dtypes the kernels take.
TRITON_TYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int32": "i32",
                "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def triton_source(v: Variant, triton):
    """The Triton kernel's source, specialized as `triton_gpu` launches it for `v`."""
    from triton.compiler import ASTSource

    from pallas_kernels import triton_kernel

    plan, inputs = plan_and_inputs(v)
    q, k_pages, v_pages = inputs.q, inputs.k_pages, inputs.v_pages
    params = triton_gpu.launch_params(inputs, plan, interpret=False)
    outs = triton_gpu.output_shapes(inputs, plan)
    arrays = dict(meta_ptr=jnp.int32, scalars_ptr=jnp.int32, scales_ptr=jnp.float32,
                  sinks_ptr=jnp.float32, tables_ptr=jnp.int32, q_ptr=q.dtype, k_ptr=k_pages.dtype, v_ptr=v_pages.dtype,
                  o_ptr=outs[0].dtype, op_ptr=outs[1].dtype, mp_ptr=outs[2].dtype,
                  lp_ptr=outs[3].dtype)
    fn = getattr(triton_kernel, triton_gpu.KERNEL_NAME)
    signature = {name: "*" + TRITON_TYPES[jnp.dtype(dt).name] for name, dt in arrays.items()}
    signature.update({name: "constexpr" for name in params})
    # jax_triton tells Triton every array is 16-byte aligned; so do we.
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in arrays}
    return plan, ASTSource(fn, signature, constexprs=params, attrs=attrs)


def _triton():
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as e:
        sys.exit(f"gpu_compile_report needs the optional `triton` package (pip install triton): {e}")
    return triton, GPUTarget, get_ptxas


def ptx_facts(ptx: str) -> dict:
    """What the PTX says about the main loops: MMA kind and async-copy wait depths."""
    waits = sorted({int(n) for n in re.findall(r"cp\.async\.wait_group(?:\.\w+)?\s+(\d+)", ptx)})
    return dict(wgmma="wgmma.mma_async" in ptx, mma_sync="mma.sync" in ptx,
                cp_async="cp.async" in ptx, tma="cp.async.bulk.tensor" in ptx,
                wait_depths=waits)


def ptxas_facts(ptx: str, ptxas: str, arch: int) -> dict:
    """Registers, spills and shared memory from `ptxas -v`."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        res = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", "-o", os.devnull, path],
                             capture_output=True, text=True, check=False)
    text = res.stdout + res.stderr
    if res.returncode:
        raise RuntimeError(f"ptxas failed:\n{text}")
    regs = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return dict(registers=int(regs.group(1)) if regs else None,
                spill_store_bytes=int(spills.group(1)) if spills else None,
                spill_load_bytes=int(spills.group(2)) if spills else None)


def compile_variant(v: Variant, arch: int, kernel_name: str = "pallas") -> dict:
    triton, GPUTarget, get_ptxas = _triton()
    start = time.perf_counter()
    target = GPUTarget("cuda", arch, 32)
    if kernel_name == "triton":
        plan, source = triton_source(v, triton)
        kernel = triton.compile(source, target=target, options=dict(
            num_warps=plan.num_warps, num_stages=plan.num_stages))
    else:
        plan, ir = triton_ir(v)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ttir")
            with open(path, "w") as f:
                f.write(ir)
            kernel = triton.compile(path, target=target, options=dict(
                num_warps=plan.num_warps, num_stages=plan.num_stages))
    ptx = kernel.asm["ptx"]
    row = dict(kernel=kernel_name, variant=v.name, dtype=v.dtype, kv_dtype=v.kv_dtype or v.dtype,
               head_dim=v.head_dim, group=v.group,
               page_size=v.page_size, rows=plan.rows, block_q=plan.tiles.block_q,
               block_k=plan.tiles.block_k, num_splits=plan.num_splits,
               num_warps=plan.num_warps, num_stages=plan.num_stages,
               smem_bytes=int(kernel.metadata.shared),
               global_scratch=int(getattr(kernel.metadata, "global_scratch_size", 0) or 0))
    row.update(ptxas_facts(ptx, get_ptxas(arch).path, arch))
    row.update(ptx_facts(ptx))
    threads = 32 * plan.num_warps
    row["blocks_per_sm"] = min(SM_REGISTERS // (max(row["registers"] or 1, 1) * threads),
                               SM_SMEM_BYTES // max(row["smem_bytes"], 1))
    row["fits"] = row["smem_bytes"] <= BLOCK_SMEM_BYTES and row["blocks_per_sm"] >= 1
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def format_table(rows: list[dict]) -> str:
    """A markdown table of the compile report."""
    head = ("| kernel | variant | dtype | M | bk | splits | warps | stages | regs | smem KB "
            "| spills B | mma | wait depths | blocks/SM |")
    lines = [head, "|" + "---|" * 14]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['variant']} | error: {r['error']} |" + " |" * 11)
            continue
        mma = "wgmma" if r["wgmma"] else ("mma.sync" if r["mma_sync"] else "fma")
        spills = (r["spill_store_bytes"] or 0) + (r["spill_load_bytes"] or 0)
        dtype = r["dtype"] if r["kv_dtype"] == r["dtype"] else f"{r['dtype']}/{r['kv_dtype']}"
        lines.append(
            f"| {r['kernel']} | {r['variant']} | {dtype} | {r['rows']} | {r['block_k']} | "
            f"{r['num_splits']} | {r['num_warps']} | {r['num_stages']} | {r['registers']} | "
            f"{r['smem_bytes'] / 1024:.0f} | {spills} | {mma} | "
            f"{','.join(map(str, r['wait_depths'])) or '-'} | "
            f"{r['blocks_per_sm'] if r['fits'] else 'DOES NOT FIT'} |")
    return "\n".join(lines)


def main(argv):
    del argv
    _triton()  # fail before lowering anything
    chosen = [v for v in variants() if not _ONLY.value or any(v.name.startswith(p)
                                                                for p in _ONLY.value)]
    rows = []
    for v in chosen:
        for kernel_name in (k for k in _KERNELS.value if k in v.kernels):
            try:
                rows.append(compile_variant(v, _ARCH.value, kernel_name))
            except Exception as e:  # noqa: BLE001 - one broken variant must not hide the others
                rows.append(dict(kernel=kernel_name, variant=v.name,
                                 error=f"{type(e).__name__}: {str(e)[:200]}"))
            print(format_table(rows[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(rows))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(dict(jax=jax.__version__, arch=_ARCH.value, rows=rows), f, indent=2)
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    app.run(main)
