"""arcjax/bench/step_profile.py: a real engine step's ops are assigned to the decoder's parts
and their trace events summed per part."""

from __future__ import annotations

from arcjax.bench.step_profile import PARTS, op_parts, profile_call
from arcjax.runtime.batching import warmup_step
from arcjax.runtime.buckets import Bucket
from support.engines import tiny_llm


def _decode_step():
    """(runner, an all-padding decode step of 2 rows, its executable): the matmuls, head and
    sampling run over both rows, attention and the KV write over none."""
    runner = tiny_llm(async_scheduling=False).engine.runner
    bucket = Bucket(2, 2, 1)
    runner.warm([bucket])
    step = warmup_step(bucket, max_blocks=runner.max_blocks, block_size=runner.block_size,
                       num_blocks=runner.num_blocks, spare_slot=runner.counts.spare)
    return runner, step, runner._compiled[(bucket, "step", step.every_row)]


def test_parts_of_a_real_step_are_named_and_timed():
    runner, step, exe = _decode_step()
    text = exe.as_text()
    parts = op_parts(text)
    named = {p for p in parts.values() if p is not None}
    assert named <= set(PARTS)
    # every matmul part of the decoder, the attention and its KV write, the head, sampling
    for part in ("qkv", "attention", "kv_scatter", "o_proj", "mlp", "lm_head", "sampling"):
        assert part in named, part
    assert any(p is None for p in parts.values())  # the layer loop's while op is a container
    prof = profile_call(lambda: runner.run(step).tokens, text, iters=3)
    assert prof.ops > 10 and prof.wall_ms > 0
    assert set(prof.part_ms) == set(PARTS)
    assert prof.part_ms["mlp"] > 0 and prof.part_ms["lm_head"] > 0
    assert abs(sum(prof.shares.values()) - 1) < 1e-6
    assert all(part in PARTS for _, part, _ in prof.top_ops)
