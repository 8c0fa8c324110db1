"""LoRA adapters through the engine: greedy tokens equal transformers + PEFT for every
adapter, prompts for several adapters and the base model mixed in one `generate` call,
more adapters than device slots, prefix caching with prefixes shared across adapters,
serial and overlapped; bad adapters refused at submission with nothing else disturbed."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from arcjax import LoRARequest, SamplingParams
from arcjax.errors import EngineConfigError, LoRAAdapterError
from support.engines import tiny_llm
from support.hf_models import tiny_model_dir
from support.lora_adapters import (ATTENTION_TARGETS, LORA_OPTIONS, peft_adapter_dir,
                                   peft_greedy)

ARCH = "LlamaForCausalLM"
MAX_TOKENS = 6
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# (name, rank, targets): rank 4 and 16 on all seven projections, rank 8 on attention only
ADAPTERS = (("r4", 4, None), ("r16", 16, None), ("attn8", 8, ATTENTION_TARGETS))


@functools.lru_cache(maxsize=None)
def _adapters() -> dict[str, str]:
    out = {}
    for seed, (name, rank, targets) in enumerate(ADAPTERS):
        kw = {} if targets is None else {"targets": targets}
        out[name] = peft_adapter_dir(ARCH, rank=rank, seed=10 + seed, **kw)
    return out


def _requests() -> dict[str, LoRARequest]:
    return {name: LoRARequest(name, i + 1, path)
            for i, (name, path) in enumerate(_adapters().items())}


def _cases() -> tuple[list[list[int]], list[str | None]]:
    """12 prompts, each adapter and the base model three times; every prompt starts with
    one shared 24-token prefix (three full blocks), so adapters meet the same prefix."""
    rs = np.random.RandomState(5)
    shared = rs.randint(3, 384, 24).tolist()
    names = [None, *(name for name, _, _ in ADAPTERS)] * 3
    prompts = [shared + rs.randint(3, 384, n).tolist() for n in (1, 9, 17, 3) * 3]
    return prompts, names


@functools.lru_cache(maxsize=None)
def _expected() -> list[list[int]]:
    prompts, names = _cases()
    dirs = _adapters()
    return [peft_greedy(tiny_model_dir(ARCH), dirs[n] if n else None, p, MAX_TOKENS)
            for p, n in zip(prompts, names)]


# LORA_OPTIONS: two slots for three adapters (slots swap; two of them on the host, so one
# is read again), prefix caching on. Both engines share their compiled steps.


@pytest.fixture(scope="module")
def lora_llm():
    return tiny_llm(ARCH, async_scheduling=False, **LORA_OPTIONS)


def _generate(llm) -> list[list[int]]:
    prompts, names = _cases()
    reqs = _requests()
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[reqs[n] if n else None for n in names])
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mixed_adapters_equal_peft_token_for_token(lora_llm):
    want = _expected()
    prompts, names = _cases()
    base = {tuple(p): w for p, w, n in zip(prompts, want, names) if n is None}
    assert any(w != base.get(tuple(p)) for p, w in zip(prompts, want)), \
        "the adapters change nothing: the comparison would prove nothing"
    assert _generate(lora_llm) == want
    table = lora_llm.engine.runner.lora
    assert table.swaps > 2, "three adapters in two slots must swap"
    assert lora_llm.engine.adapters.pinned() == 0, "a finished request kept its adapter"


def test_overlapped_scheduling_gives_the_same_tokens():
    llm = tiny_llm(ARCH, async_scheduling=True, **LORA_OPTIONS)
    assert _generate(llm) == _expected()
    assert llm.engine.adapters.pinned() == 0


def test_bad_adapters_are_refused_at_submission_and_disturb_nothing(lora_llm):
    good = _adapters()["r4"]
    prompts, _ = _cases()
    wide = LoRARequest("wide", 9, peft_adapter_dir(ARCH, rank=32, seed=3))
    with pytest.raises(LoRAAdapterError) as e:
        lora_llm.generate(prompts[:2], GREEDY, use_tqdm=False, lora_request=[None, wide])
    assert (e.value.adapter, e.value.field, e.value.limit) == ("wide", "adapter_config.json:r", 16)
    assert not lora_llm.engine.has_unfinished(), "a refused call queued something"
    clash = LoRARequest("other", 1, _adapters()["r16"])  # id 1 is r4's
    with pytest.raises(LoRAAdapterError) as e:
        lora_llm.generate(prompts[0], GREEDY, use_tqdm=False, lora_request=clash)
    assert e.value.field == "lora_request.lora_int_id"
    with pytest.raises(LoRAAdapterError) as e:
        lora_llm.generate(prompts[0], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("gone", 7, good + "-missing"))
    assert e.value.field == "lora_request.lora_path"
    assert _generate(lora_llm) == _expected()


def test_lora_requests_need_enable_lora_and_bad_options_are_refused():
    llm = tiny_llm(ARCH)
    with pytest.raises(LoRAAdapterError) as e:
        llm.generate([5, 6, 7], GREEDY, use_tqdm=False,
                     lora_request=LoRARequest("a", 1, _adapters()["r4"]))
    assert e.value.field == "lora_request" and "enable_lora" in str(e.value)
    with pytest.raises(EngineConfigError) as e:
        tiny_llm(ARCH, enable_lora=True, max_lora_rank=0)
    assert e.value.field == "max_lora_rank"
