"""Tensor parallelism (arcjax.parallel) on 8 forced CPU devices (LoRA adapters included), and
two processes joined by jax.distributed on 127.0.0.1.

The multi-device runs happen in subprocesses (this file run as a script): the test process
keeps its single CPU device. Every subprocess is bounded by a timeout.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=4,
                attention_impl="auto", chunk_tile=16, max_num_batched_tokens=32,
                dtype="float32")
PROMPT_LENS = (40, 9)  # the 40-token prompt is chunked (32-token budget, 16-token tiles)
MAX_TOKENS = 6
# (architecture, tensor-parallel sizes compared with one device). Llama: 4 heads, 2 KV
# heads (tp=4 repeats each KV head twice); Qwen2: q/k/v biases and tied embeddings;
# Llama8Heads: 8 query heads, 2 KV heads (tp=8 repeats each KV head 4 times).
CASES = (("LlamaForCausalLM", (2, 4)), ("Qwen2ForCausalLM", (2,)), ("Llama8Heads", (8,)))
SUBPROCESS_TIMEOUT_S = 420
STRUCTURED_REGEX = r"[a-z]{2,4}-[0-9]{2}"


def _prompts():
    import numpy as np

    rng = np.random.default_rng(0)
    return [rng.integers(3, 380, size=n).tolist() for n in PROMPT_LENS]


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(HERE), env.get("PYTHONPATH", "")])
    return env


def _greedy(llm, prompts=None):
    from arcjax import SamplingParams

    outs = llm.generate(_prompts() if prompts is None else prompts,
                        SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), use_tqdm=False)
    return [list(o.token_ids) for o in outs]


# --- subprocess bodies -------------------------------------------------------------------
def _run_tensor_parallel(model_dirs: dict) -> dict:
    """8 host devices: greedy tokens per (arch, tp), shardings and per-device bytes."""
    import jax

    import arcjax
    from arcjax.errors import EngineConfigError
    from arcjax.parallel import per_device_bytes

    assert jax.device_count() == 8
    out = {"tokens": {}, "checks": {}}
    for arch, sizes in CASES:
        for tp in (1,) + sizes:
            llm = arcjax.LLM(model_dirs[arch], tensor_parallel_size=tp, **GEOMETRY)
            out["tokens"][f"{arch}/{tp}"] = _greedy(llm)
            runner = llm.engine.runner
            wq, k = runner.params["layers"]["wq"], runner.cache["k"]
            if tp == 1:  # one CPU device holds the layers one array each (layer_arrays)
                wq = jax.numpy.stack(wq.layers)
            out["checks"][f"{arch}/{tp}"] = {
                "wq_spec": list(getattr(wq.sharding, "spec", ())),
                "wq_shard_shape": list(wq.addressable_shards[0].data.shape),
                "wq_devices": len(wq.sharding.device_set),
                "cache_spec": list(getattr(k.sharding, "spec", ())),
                "cache_shape": list(k.shape),
                "cache_shard_shape": list(k.addressable_shards[0].data.shape),
                "param_bytes": sorted(set(per_device_bytes(runner.params).values())),
                "cache_bytes": sorted(set(per_device_bytes(runner.cache).values())),
                "num_kv_heads": runner.cfg.num_kv_heads,
            }
            del llm
    # structured outputs: the bitmask is replicated like the other step inputs
    out["structured"] = {}
    regex = arcjax.SamplingParams(max_tokens=24, temperature=0.0,
                                  structured_outputs={"regex": STRUCTURED_REGEX})
    for tp in (1, 2):  # serial: the executables of the greedy runs above
        llm = arcjax.LLM(model_dirs["LlamaWithTokenizer"], tensor_parallel_size=tp,
                         async_scheduling=False, **GEOMETRY)
        outs = llm.generate(_prompts(), regex, use_tqdm=False)
        out["structured"][str(tp)] = [[o.text, o.finish_reason] for o in outs]
        del llm
    errors = {}
    for tp in (3, 8):  # 3 does not divide 4 heads; 8 exceeds them
        try:
            arcjax.LLM(model_dirs["LlamaForCausalLM"], tensor_parallel_size=tp, **GEOMETRY)
            errors[tp] = None
        except EngineConfigError as e:
            errors[tp] = e.field
    out["errors"] = errors
    out["spec"] = _run_speculative(model_dirs["LlamaForCausalLM"])
    out["invariant"] = _run_batch_invariant(model_dirs["LlamaForCausalLM"])
    return out


def _run_batch_invariant(model_dir: str) -> list:
    """tp=2 with batch_invariant: a probe's greedy tokens and logprob bits alone, then last
    in two batch mixes of random other requests (the second with prompts chunked at 16)."""
    import numpy as np

    import arcjax

    probe = (np.random.default_rng(5).integers(3, 380, 7).tolist() * 6)[:40]
    params = arcjax.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True,
                                   logprobs=0)
    rng, runs = np.random.default_rng(1), []
    for chunk, others in ((None, 0), (None, 3), (16, 4)):
        options = dict(GEOMETRY, tensor_parallel_size=2, batch_invariant=True)
        if chunk is not None:
            options["long_prefill_token_threshold"] = chunk
        llm = arcjax.LLM(model_dir, **options)
        prompts = [rng.integers(3, 380, size=int(n)).tolist()
                   for n in rng.integers(1, 60, others)]
        done = llm.generate([*prompts, probe], params, use_tqdm=False)[-1].outputs[0]
        bits = np.asarray([e[t].logprob for e, t in zip(done.logprobs, done.token_ids)],
                          np.float32).view(np.int32)
        runs.append([list(done.token_ids), bits.tolist()])
        del llm
    return runs


def _run_speculative(model_dir: str) -> dict:
    """Speculative decoding under tp=2, both proposers (the draft model runs unsharded), on
    prompts that repeat themselves (n-gram matches), against one device without it."""
    import arcjax

    prompts = [p * 2 for p in _prompts()]
    runs = {"reference": _greedy(arcjax.LLM(model_dir, **GEOMETRY), prompts)}
    for name, spec in (("ngram", {"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_min": 1, "prompt_lookup_max": 2}),
                       ("draft_model", {"method": "draft_model", "model": model_dir,
                                        "num_speculative_tokens": 3})):
        llm = arcjax.LLM(model_dir, tensor_parallel_size=2, speculative_config=spec, **GEOMETRY)
        runs[name] = {"tokens": _greedy(llm, prompts),
                      "drafts": sum(r.spec_draft_tokens for r in llm.engine.trace),
                      "accepted": sum(r.spec_accepted_tokens for r in llm.engine.trace)}
        del llm
    return runs


def _lora_cases(adapters: dict) -> tuple[list[list[int]], list]:
    """Prompts of the base model (None) and of every adapter, mixed."""
    import numpy as np

    rng = np.random.default_rng(3)
    names = [None, *adapters]
    return [rng.integers(3, 380, size=n).tolist() for n in (23, 9, 40, 5)], names


def _run_lora(model_dir: str, adapters: dict) -> dict:
    """Three LoRA adapters and the base model mixed in one call under tp=2, in two slots
    (slots written under the mesh), and how the slot buffers are split."""
    import arcjax

    prompts, names = _lora_cases(adapters)
    requests = [None if n is None else arcjax.LoRARequest(n, i + 1, adapters[n])
                for i, n in enumerate(names)]
    llm = arcjax.LLM(model_dir, tensor_parallel_size=2, enable_lora=True, max_loras=2,
                     max_lora_rank=16, **GEOMETRY)
    outs = llm.generate(prompts, arcjax.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       ignore_eos=True),
                        use_tqdm=False, lora_request=requests)
    table = llm.engine.runner.lora
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs], "swaps": table.swaps,
            "specs": {key: {part: [str(a) for a in getattr(buf.sharding, "spec", ())]
                            for part, buf in pair.items()}
                      for key, pair in table.buffers.items()}}


def _run_host(model_dir: str, process_id: int, port: int) -> dict:
    """One of two processes (one CPU device each), tensor parallel across both."""
    import jax

    import arcjax
    from arcjax.parallel import follow, initialize, stop_followers

    initialize(f"127.0.0.1:{port}", num_processes=2, process_id=process_id,
               initialization_timeout=120)
    assert jax.device_count() == 2 and jax.local_device_count() == 1
    llm = arcjax.LLM(model_dir, tensor_parallel_size=2, **GEOMETRY)
    wq = llm.engine.runner.params["layers"]["wq"]
    info = {"process": process_id, "devices": jax.device_count(),
            "wq_local_shards": len(wq.addressable_shards),
            "wq_shard_shape": list(wq.addressable_shards[0].data.shape)}
    if process_id == 0:
        info["tokens"] = _greedy(llm)
        stop_followers(llm.engine)
    else:
        info["steps"] = follow(llm.engine)
    info["sync_steps"] = llm.engine.sync.step
    jax.distributed.shutdown()
    return info


# --- the tests ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dirs():
    from support.hf_models import tiny_llama_8_heads_dir, tiny_model_dir, tiny_model_with_tokenizer

    from support.lora_adapters import ATTENTION_TARGETS, peft_adapter_dir

    dirs = {arch: tiny_model_dir(arch) for arch, _ in CASES if arch.endswith("CausalLM")}
    lora = {"r4": peft_adapter_dir(rank=4, seed=41), "r16": peft_adapter_dir(rank=16, seed=42),
            "attn8": peft_adapter_dir(rank=8, seed=43, targets=ATTENTION_TARGETS)}
    return dirs | {"Llama8Heads": tiny_llama_8_heads_dir(), "lora": lora,
                   "LlamaWithTokenizer": tiny_model_with_tokenizer("LlamaForCausalLM")}


@pytest.fixture(scope="module")
def lora_results(model_dirs):
    """The LoRA run: its own subprocess (the tp one is long already)."""
    proc = subprocess.run([sys.executable, __file__, "lora", json.dumps(model_dirs)],
                          env=_env(2), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def tp_results(model_dirs):
    proc = subprocess.run([sys.executable, __file__, "tp", json.dumps(model_dirs)],
                          env=_env(8), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("arch,tp", [(a, t) for a, sizes in CASES for t in sizes])
def test_greedy_tokens_equal_single_device(tp_results, arch, tp):
    single = tp_results["tokens"][f"{arch}/1"]
    assert all(len(t) == MAX_TOKENS for t in single)
    assert tp_results["tokens"][f"{arch}/{tp}"] == single


@pytest.mark.slow
def test_weights_and_cache_really_sharded(tp_results):
    checks = tp_results["checks"]
    one, two, four = (checks[f"LlamaForCausalLM/{t}"] for t in (1, 2, 4))
    # wq [L, H, Hq * D] = [2, 64, 64]: split on the heads axis.
    assert two["wq_spec"] == [None, None, "tp"] and two["wq_devices"] == 2
    assert two["wq_shard_shape"] == [2, 64, 32] and four["wq_shard_shape"] == [2, 64, 16]
    # cache [pages, block, Hkv, D]: split by KV head; tp=4 > 2 KV heads: repeated to 4.
    assert two["cache_spec"] == [None, None, "tp"]
    assert two["cache_shard_shape"][2] == 1 and four["num_kv_heads"] == 4
    assert four["cache_shape"][2] == 4 and four["cache_shard_shape"][2] == 1
    # Every device holds the same share; tp=2 holds about half the params of one device.
    for c in (two, four):
        assert len(c["param_bytes"]) == 1 and len(c["cache_bytes"]) == 1
    assert two["cache_bytes"][0] * 2 == one["cache_bytes"][0]
    assert one["param_bytes"][0] / 2 < two["param_bytes"][0] < one["param_bytes"][0] * 0.6
    qwen = checks["Qwen2ForCausalLM/2"]
    assert qwen["wq_shard_shape"] == [2, 64, 32]
    eight = checks["Llama8Heads/8"]
    assert eight["wq_devices"] == 8 and eight["wq_shard_shape"] == [2, 64, 8]
    assert eight["num_kv_heads"] == 8 and eight["cache_shard_shape"][2] == 1


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft_model"])
def test_speculative_decoding_under_tensor_parallelism(tp_results, proposer):
    run = tp_results["spec"][proposer]
    assert run["tokens"] == tp_results["spec"]["reference"]
    assert run["drafts"] > 0
    if proposer == "draft_model":  # the target's own weights: every draft is accepted
        assert run["accepted"] == run["drafts"]


def test_structured_outputs_under_tensor_parallelism(tp_results):
    import re

    one, two = tp_results["structured"]["1"], tp_results["structured"]["2"]
    assert one == two
    assert all(reason == "stop" and re.fullmatch(STRUCTURED_REGEX, text) for text, reason in one)


@pytest.mark.slow
def test_batch_invariant_under_tensor_parallelism(tp_results):
    # the probe's tokens and logprob bits under tp=2 do not follow its batch or chunking
    alone, *mixed = tp_results["invariant"]
    assert len(alone[0]) == MAX_TOKENS and mixed == [alone] * len(mixed)


@pytest.mark.slow
def test_bad_tensor_parallel_size_names_the_field(tp_results):
    assert tp_results["errors"] == {"3": "tensor_parallel_size", "8": "tensor_parallel_size"}


@pytest.mark.slow
def test_lora_adapters_under_tensor_parallelism_equal_peft(lora_results, model_dirs):
    """Slot buffers split like their base weights (column-parallel q/k/v/gate/up: B's out;
    row-parallel o/down: A's in), and each row's greedy tokens are transformers + PEFT's."""
    from support.lora_adapters import peft_greedy

    adapters = model_dirs["lora"]
    prompts, names = _lora_cases(adapters)
    base = model_dirs["LlamaForCausalLM"]
    want = [peft_greedy(base, None if n is None else adapters[n], p, MAX_TOKENS)
            for p, n in zip(prompts, names)]
    assert any(w != peft_greedy(base, None, p, MAX_TOKENS)
               for p, w, n in zip(prompts, want, names) if n), "the adapters change nothing"
    run = lora_results
    assert run["tokens"] == want
    assert run["swaps"] > 2, "three adapters in two slots must swap"
    column, row = [None, None, None, "tp"], [None, None, "tp", None]
    for key, pair in run["specs"].items():
        split = "a" if key in ("wo", "w_down") else "b"
        whole = "b" if split == "a" else "a"
        assert pair[split] == [str(a) for a in (row if split == "a" else column)], key
        assert pair[whole] in ([], ["None"] * 4), key


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tp_results, model_dirs):
    model = model_dirs["LlamaForCausalLM"]
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, __file__, "host", model, str(pid), str(port)],
                              env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for pid in (0, 1)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=SUBPROCESS_TIMEOUT_S)
            assert p.returncode == 0, err[-4000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    leader, follower = results
    assert leader["devices"] == 2 and leader["wq_local_shards"] == 1
    assert leader["wq_shard_shape"] == [2, 64, 32]
    assert leader["tokens"] == tp_results["tokens"]["LlamaForCausalLM/1"]
    assert follower["steps"] == leader["sync_steps"] == follower["sync_steps"]


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "tp":
        result = _run_tensor_parallel(json.loads(sys.argv[2]))
    elif mode == "lora":
        dirs = json.loads(sys.argv[2])
        result = _run_lora(dirs["LlamaForCausalLM"], dirs["lora"])
    else:
        result = _run_host(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
    print(json.dumps(result))
