"""Which of the step's operations compute a row differently depending on the rest of the
batch: each compiled alone, with the probe row beside random others, its output row
compared bitwise with the row computed alone.

1. `row_ops(cfg)` lists a model's row-wise operations at its shapes (the projections, the
   norms, the vocabulary projection, the log-softmax), each a jitted function of a
   [T, ...] batch.
2. `row_variance(op, dtype)` runs it at every row count of `ROW_COUNTS`, the probe at row 0,
   and returns the counts whose row 0 differs from the one-row run.
3. `attention_variance(cfg, dtype)` does the same for the attention of one query at a fixed
   position (`pallas_kernels.ragged_paged_attention`, impl "xla"): alone as a decode, as a
   decode beside 7 other sequences, as the last row of its prompt in one chunk, of a
   16-token chunk, and of a 4-row verification chunk.

NOTE: each operation is compiled on its own here; inside the step XLA fuses it with its
neighbours, which may change (never remove) the dependence on the row count. The engine
table of `scripts/invariance_report.py` is the end-to-end truth; this one says which
operations are candidates.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

import pallas_kernels
from arcjax.model.decoder import rms_norm
from arcjax.model.model_config import ModelConfig

ROW_COUNTS = (1, 2, 4, 8, 16, 64, 256, 512)


@dataclasses.dataclass(frozen=True)
class RowOp:
    name: str
    width: int  # the input row's width
    fn: Callable  # (x [T, width], weight) -> [T, ...]
    weight_shape: tuple[int, ...]


def row_ops(cfg: ModelConfig) -> list[RowOp]:
    """The row-wise operations of `cfg`'s decoder at its shapes."""
    h, q = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    inter = cfg.intermediate_size if not cfg.is_moe else cfg.moe_intermediate_size
    matmul = lambda x, w: x @ w  # noqa: E731
    return [
        RowOp(f"rms_norm [{h}]", h, lambda x, w: rms_norm(x, w, 1e-5), (h,)),
        RowOp(f"q/o projection [{h}x{q}]", h, matmul, (h, q)),
        RowOp(f"k/v projection [{h}x{kv}]", h, matmul, (h, kv)),
        RowOp(f"gate/up [{h}x{inter}]", h, matmul, (h, inter)),
        RowOp(f"down [{inter}x{h}]", inter, matmul, (inter, h)),
        RowOp(f"vocabulary [{h}x{cfg.vocab_size}]", h, matmul, (h, cfg.vocab_size)),
        RowOp(f"log_softmax [{cfg.vocab_size}]", cfg.vocab_size,
              lambda x, w: jax.nn.log_softmax(x.astype(jnp.float32), -1), (1,)),
    ]


def _differs(a: np.ndarray, b: np.ndarray) -> bool:
    return bool((np.asarray(a, np.float32).view(np.int32)
                 != np.asarray(b, np.float32).view(np.int32)).any())


def row_variance(op: RowOp, dtype: str, seed: int = 0) -> list[int]:
    """The row counts of ROW_COUNTS at which the probe's output row differs from its
    one-row output."""
    rs = np.random.RandomState(seed)
    x = jnp.asarray(rs.randn(ROW_COUNTS[-1], op.width), dtype)  # [T_max, width]
    w = jnp.asarray(rs.randn(*op.weight_shape) / np.sqrt(op.width), dtype)
    fn = jax.jit(op.fn)
    alone = np.asarray(fn(x[:1], w).astype(jnp.float32))[0]
    return [t for t in ROW_COUNTS[1:]
            if _differs(np.asarray(fn(x[:t], w).astype(jnp.float32))[0], alone)]


def attention_variance(cfg: ModelConfig, dtype: str, position: int = 299,
                       seed: int = 0) -> dict[str, bool]:
    """Whether the attention output of one query at `position` differs from its lone
    decode computation, per arrangement (see the module docstring)."""
    rs = np.random.RandomState(seed)
    bs, blocks = 8, 64
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    k_pages = jnp.asarray(rs.randn(8 * blocks, bs, hkv, d), dtype)
    v_pages = jnp.asarray(rs.randn(8 * blocks, bs, hkv, d), dtype)
    probe_q = rs.randn(position + 1, hq, d)  # the probe's query at every position
    others = rs.randn(8, hq, d)

    def run(q_rows, q_lens, kv_lens, max_q_len):
        s = len(q_lens)
        s_pad = max(8, s)
        # sequence i owns pages i * blocks ..: the probe's (row 0) are the same in every call
        tables = np.arange(s_pad * blocks, dtype=np.int32).reshape(s_pad, blocks)
        cu = np.zeros(s_pad + 1, np.int32)
        cu[1:s + 1] = np.cumsum(q_lens)
        cu[s + 1:] = cu[s]
        kv = np.zeros(s_pad, np.int32)
        kv[:s] = kv_lens
        q = np.zeros((max(len(q_rows), 8), hq, d))
        q[:len(q_rows)] = q_rows
        fn = jax.jit(pallas_kernels.ragged_paged_attention,
                     static_argnames=("impl", "max_q_len"))
        out = fn(jnp.asarray(q, dtype), k_pages, v_pages, jnp.asarray(tables), jnp.asarray(kv),
                 jnp.asarray(cu), s, impl="xla", max_q_len=max_q_len)
        return np.asarray(out.astype(jnp.float32))

    n = position + 1
    alone = run(probe_q[-1:], [1], [n], 1)[0]
    cases = {
        "decode beside 7 others": lambda: run(
            np.concatenate([probe_q[-1:], others[:7]]), [1] * 8,
            [n] + [int(k) for k in rs.randint(1, 8 * bs * blocks // 8, 7)], 1)[0],
        "last row of one prompt chunk": lambda: run(probe_q, [n], [n], n)[n - 1],
        "last row of a 16-token chunk": lambda: run(probe_q[-16:], [16], [n], 16)[15],
        "last row of a 4-row verification": lambda: run(probe_q[-4:], [4], [n], 4)[3],
    }
    return {name: _differs(case(), alone) for name, case in cases.items()}
