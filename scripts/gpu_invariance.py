"""The batch-invariance task of `scripts/gpu_check.py` (`kernel_table.invariance`): each GPU
kernel's batch-invariant plan (`gpu_plan.make_gpu_plan(batch_invariant=True)`, what
`AttentionInputs.batch_invariant` launches) on the device.

A probe sequence of `CONTEXT` keys has its last `chunk` query rows (16, 64 and 256 tokens)
computed inside a mixed bucket of random other sequences; three of those rows (the chunk's
first, middle and last) are computed again alone (a decode bucket holding only the probe
at that position) and beside other sequences' decodes. One row per (implementation, dtype,
chunk): whether every compared row is bitwise its lone decode, how many differ, and the
chunk's largest error against the oracle (`gpu_kernels.TOLERANCES`). Llama-8B heads (32:8,
D=128, 16-token pages); `--cpu_smoke`: 4:2 heads, D=64, kernels interpreted, chunks 16 and
32 of a 64-key context.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING

from gpu_kernels import LLAMA8B_HEADS, SMOKE_HEADS, TOLERANCES, unavailable

if TYPE_CHECKING:
    from gpu_child import Emitter, Task

IMPLS = ("pallas_gpu", "triton")
BLOCK_SIZE, SEQS, OTHERS = 16, 8, 5  # pages of 16 keys; sequence rows; other sequences


def _setup(smoke: bool):
    import numpy as np

    hq, hkv, d = SMOKE_HEADS if smoke else LLAMA8B_HEADS
    context, chunks, tokens = (64, (16, 32), 96) if smoke else (1024, (16, 64, 256), 512)
    blocks = context // BLOCK_SIZE
    longest = min(40, (tokens - max(chunks)) // OTHERS)  # another sequence's chunk bound
    rs = np.random.RandomState(int(time.time()) % 2**16)
    data = dict(k=rs.randn(SEQS * blocks, BLOCK_SIZE, hkv, d),
                v=rs.randn(SEQS * blocks, BLOCK_SIZE, hkv, d),
                probe_q=rs.randn(context, hq, d), other_q=rs.randn(tokens, hq, d),
                others=[(int(rs.randint(1, longest)), int(rs.randint(0, context - longest)))
                        for _ in range(OTHERS)])
    return data, context, chunks, tokens, blocks


def _inputs(data, seqs, t, max_q_len, blocks, dtype):
    """seqs: [(queries [n, Hq, D], kv_len, pages row)]; the probe's pages are row 0."""
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels import AttentionInputs

    q = np.zeros((t,) + data["probe_q"].shape[1:])
    cu, kv, tables = [0], [], np.zeros((SEQS, blocks), np.int32)
    for i, (rows, kv_len, pages) in enumerate(seqs):
        q[cu[-1]:cu[-1] + len(rows)] = rows
        cu.append(cu[-1] + len(rows))
        kv.append(kv_len)
        tables[i] = pages * blocks + np.arange(blocks)
    cu += [cu[-1]] * (SEQS + 1 - len(cu))
    kv += [0] * (SEQS - len(kv))
    return AttentionInputs.create(
        q=jnp.asarray(q, dtype), k_pages=jnp.asarray(data["k"], dtype),
        v_pages=jnp.asarray(data["v"], dtype), block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv), cu_seqlens_q=jnp.asarray(cu), num_seqs=len(seqs),
        max_q_len=max_q_len, batch_invariant=True)


@functools.lru_cache(maxsize=None)
def _call(impl: str, smoke: bool):
    """The jitted dispatch, one per implementation (each bucket shape compiles once)."""
    import jax

    from pallas_kernels import paged_attention

    return jax.jit(functools.partial(paged_attention, impl=impl, interpret=smoke))


def _one(impl: str, dtype: str, chunk: int, smoke: bool, setup) -> dict:
    import numpy as np

    from pallas_kernels.reference import ragged_paged_attention_reference

    data, context, _, tokens, blocks = setup
    call = _call(impl, smoke)
    bits = lambda x: np.asarray(x, np.float32).view(np.int32)  # noqa: E731
    others = [(data["other_q"][:n], n + extra, 1 + i)
              for i, (n, extra) in enumerate(data["others"])]
    start = context - chunk
    mixed = _inputs(data, others + [(data["probe_q"][start:], context, 0)], tokens, tokens,
                    blocks, dtype)
    out = np.asarray(call(mixed))
    first = sum(len(rows) for rows, _, _ in others)
    ref = np.asarray(ragged_paged_attention_reference(mixed), np.float32)
    err = np.abs(out[first:first + chunk] - ref[first:first + chunk]) / (
        1 + np.abs(ref[first:first + chunk]))
    differing = 0
    for pos in (start, start + chunk // 2, context - 1):
        one = [(data["probe_q"][pos:pos + 1], pos + 1, 0)]
        alone = call(_inputs(data, one, SEQS, 1, blocks, dtype))[0]
        decodes = [(rows[:1], kv_len, pages) for rows, kv_len, pages in others] + one
        beside = call(_inputs(data, decodes, SEQS, 1, blocks, dtype))[len(others)]
        differing += int((bits(out[first + pos - start]) != bits(alone)).any())
        differing += int((bits(beside) != bits(alone)).any())
    max_err = float(err.max())
    row = dict(bitwise=differing == 0, differing_of_6=differing, max_rel_err=max_err,
               tolerance=TOLERANCES[dtype], ok=differing == 0 and max_err <= TOLERANCES[dtype])
    if not row["ok"]:  # a failed check fails the task (gpu_summary.task_ok)
        row["error"] = (f"{differing} of 6 comparisons differ from the lone decode; "
                        f"max_rel_err {max_err:.3g} (tolerance {TOLERANCES[dtype]})")
    return row


def invariance(task: Task, emit: Emitter) -> dict:
    import jax

    setup = _setup(task.smoke)
    for impl in IMPLS:
        why_not = unavailable(impl, task.smoke)
        for dtype in ("bfloat16", "float32"):
            for chunk in setup[2]:
                row = dict(impl=impl, case=f"invariance_{dtype}_c{chunk}", dtype=dtype,
                           chunk=chunk)
                if why_not is not None or task.seconds_left() < 5:
                    emit.row(row | dict(skipped=why_not or "time budget spent"))
                    continue
                emit.start(row["case"])
                start = time.perf_counter()
                try:
                    row.update(_one(impl, dtype, chunk, task.smoke, setup))
                except Exception as e:  # noqa: BLE001 - a kernel that fails is a result
                    row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:400]}")
                emit.row(row | dict(seconds=round(time.perf_counter() - start, 2)))
    return dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend())
