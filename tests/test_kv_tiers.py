"""The device side of KV cache groups and the host tier: which group and slot each layer uses
(arcjax/model/kv_layout.py), and the host pool's copies (arcjax/runtime/kv_tiers.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import jax.numpy as jnp

from arcjax.model.kv_layout import kv_layout
from arcjax.model.model_config import ModelConfig
from arcjax.runtime.kv_tiers import HostKVPool


def _model(sliding: tuple[bool, ...], window: int | None = 8) -> ModelConfig:
    return ModelConfig(architecture="Gemma3ForCausalLM", vocab_size=8, hidden_size=8,
                       intermediate_size=8, num_layers=len(sliding), num_heads=1,
                       num_kv_heads=1, head_dim=8,
                       sliding_window=window if any(sliding) else None,
                       sliding_layers=sliding if any(sliding) else ())


def test_gemma3_layers_form_equal_groups_over_shared_slots():
    """26 layers, every 6th global (Gemma 3 1B): 4 global layers, so 4 slots; the 22 sliding
    layers form 6 groups (the last uses 2 of its 4 slots)."""
    sliding = tuple((i + 1) % 6 != 0 for i in range(26))
    layout = kv_layout(_model(sliding))
    assert layout.num_slots == 4 and layout.group_windows == (8,) * 6 + (None,)
    assert layout.scheduler_groups == layout.group_windows and layout.sliding_window is None
    pairs = list(zip(layout.layer_group, layout.layer_slot))
    assert len(set(pairs)) == 26, "two layers share a (group, slot)"
    for g in range(layout.num_groups):
        slots = [s for gg, s in pairs if gg == g]
        assert len(slots) == len(set(slots)) and len(slots) <= 4
        assert all((layout.group_windows[g] is None) == (not sliding[i])
                   for i, (gg, _) in enumerate(pairs) if gg == g)
    assert [layout.layer_group[i] for i in (5, 11, 17, 23)] == [6] * 4


def test_alternating_layers_and_single_table_layouts():
    gemma2 = kv_layout(_model((True, False) * 3))
    assert gemma2.num_slots == 3 and gemma2.group_windows == (8, None)
    assert gemma2.layer_group == (0, 1) * 3 and gemma2.layer_slot == (0, 0, 1, 1, 2, 2)
    for layout in (kv_layout(_model((True,) * 4)), kv_layout(_model((False,) * 4)),
                   kv_layout(_model((True, False) * 2), hybrid=False)):
        assert layout.num_slots == 4 and layout.layer_slot == (0, 1, 2, 3)
        assert layout.layer_group == (0,) * 4 and layout.scheduler_groups == ()
    assert kv_layout(_model((True,) * 4)).sliding_window == 8
    assert kv_layout(_model((True, False) * 2), hybrid=False).sliding_window is None


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float8_e4m3fn])
def test_host_pool_stores_and_loads_every_slot_of_a_block(dtype):
    """Blocks 1 and 3 (both slots of each) go to host slots 5 and 0, then come back into
    blocks 2 and 0 of a cache the step changed meanwhile; padding moves nothing."""
    slots, blocks, page = 2, 4, (2, 1, 3)
    values = np.arange(slots * blocks * 6, dtype=np.float32).reshape(slots * blocks, *page) % 7
    cache = {"k": jnp.asarray(values, dtype), "v": jnp.asarray(-values, dtype)}
    pool = HostKVPool(8, num_slots=slots, num_blocks=blocks, page_shape=page, dtype=dtype)
    pool.store(cache, [(1, 5), (3, 0)])
    pool.flush()
    k = np.asarray(cache["k"]).astype(np.float32)
    np.testing.assert_array_equal(pool.k[5].astype(np.float32), k[[1, 5]])
    np.testing.assert_array_equal(pool.k[0].astype(np.float32), k[[3, 7]])
    step = {"k": cache["k"] * 0, "v": cache["v"] * 0}  # what the step left
    out = pool.load(step, [(5, 2), (0, 0), (5, 1)])  # three loads: padded to four
    got = np.asarray(out["k"]).astype(np.float32)
    np.testing.assert_array_equal(got[[2, 6]], k[[1, 5]])
    np.testing.assert_array_equal(got[[1, 5]], k[[1, 5]])
    np.testing.assert_array_equal(got[[0, 4]], k[[3, 7]])
    np.testing.assert_array_equal(got[[3, 7]], 0)  # untouched
    np.testing.assert_array_equal(np.asarray(out["v"]).astype(np.float32)[[2, 6]],
                                  -k[[1, 5]])
    stats = pool.stats
    assert (stats.blocks_stored, stats.blocks_loaded) == (2, 3)
    assert stats.bytes_to_host == 2 * pool.block_bytes == 2 * 2 * slots * 6 * jnp.dtype(dtype).itemsize
    pool.poll()
    assert stats.loads_timed == 1 and stats.load_seconds >= 0


def test_a_load_waits_for_a_store_of_its_slot_in_flight():
    cache = {"k": jnp.arange(8.0).reshape(4, 2, 1, 1), "v": jnp.zeros((4, 2, 1, 1))}
    pool = HostKVPool(2, num_slots=1, num_blocks=4, page_shape=(2, 1, 1), dtype=np.float32)
    pool.store(cache, [(3, 1)])  # not flushed
    out = pool.load(cache, [(1, 0)])
    np.testing.assert_array_equal(np.asarray(out["k"])[0, :, 0, 0], [6.0, 7.0])
    assert HostKVPool.slots_for(1 << 20, num_slots=4, page_shape=(16, 2, 64),
                                dtype=np.float32) == (1 << 20) // (2 * 4 * 16 * 2 * 64 * 4)


def _sharded_round_trip() -> dict:
    """Blocks of a cache split by KV head over two devices, out to the host and back into
    other blocks: each device's shard comes back to it."""
    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    assert jax.device_count() == 2
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("tp",)),
                             PartitionSpec(None, None, "tp", None))
    values = np.arange(8 * 2 * 2 * 3, dtype=np.float32).reshape(8, 2, 2, 3)  # 2 slots x 4
    cache = {"k": jax.device_put(values, sharding), "v": jax.device_put(-values, sharding)}
    pool = HostKVPool(4, num_slots=2, num_blocks=4, page_shape=(2, 2, 3), dtype=np.float32,
                      cache_sharding=sharding)
    pool.store(cache, [(1, 3)])
    blank = {"k": jax.device_put(values * 0, sharding), "v": jax.device_put(values * 0, sharding)}
    out = pool.load(blank, [(3, 2)])
    k = np.asarray(out["k"])
    return {"moved": k[[2, 6]].tolist(), "want": values[[1, 5]].tolist(),
            "rest": float(np.abs(np.delete(k, [2, 6], axis=0)).sum()),
            "spec": str(out["k"].sharding.spec),
            "shards": [s.data.shape[2] for s in out["k"].addressable_shards]}


def test_host_pool_under_tensor_parallelism_moves_each_devices_shard():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS="--xla_force_host_platform_device_count=2",
               PYTHONPATH=os.pathsep.join([str(here.parent), str(here),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["moved"] == got["want"] and got["rest"] == 0
    assert "tp" in got["spec"] and got["shards"] == [1, 1]


if __name__ == "__main__":
    print(json.dumps(_sharded_round_trip()))
