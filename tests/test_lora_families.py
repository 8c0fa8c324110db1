"""LoRA adapters on the other test architectures (tests/test_lora_engine.py and
tests/test_lora_matrix.py run Llama): q/k/v biases and tied
embeddings (Qwen2), q/k norms and a wider head (Qwen3), soft-caps, sliding windows and
scaled embeddings (Gemma 2), and a mixture of experts (Qwen3-MoE: adapters on its attention;
experts are refused, tests/test_lora_units.py). A random PEFT adapter and the base model in
one `generate` call: each row's greedy tokens equal transformers + PEFT's."""

from __future__ import annotations

import numpy as np
import pytest

from arcjax import LLM, LoRARequest, SamplingParams
from support.engines import GEOMETRY
from support.hf_models import tiny_model_dir
from support.lora_adapters import (ALL_TARGETS, ATTENTION_TARGETS, LORA_OPTIONS,
                                   peft_adapter_dir, peft_greedy)

MAX_TOKENS = 5
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
# architecture -> the projections its adapter targets
FAMILIES = {"Qwen2ForCausalLM": ALL_TARGETS, "Qwen3ForCausalLM": ALL_TARGETS,
            "Gemma2ForCausalLM": ALL_TARGETS, "Qwen3MoeForCausalLM": ATTENTION_TARGETS}


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_adapter_and_base_rows_equal_peft(arch):
    model = tiny_model_dir(arch)
    adapter = peft_adapter_dir(arch, rank=8, seed=90, targets=FAMILIES[arch])
    rs = np.random.RandomState(31)
    prompts = [rs.randint(3, 384, n).tolist() for n in (11, 19)]
    want = [peft_greedy(model, None, prompts[0], MAX_TOKENS),
            peft_greedy(model, adapter, prompts[1], MAX_TOKENS)]
    assert want[1] != peft_greedy(model, None, prompts[1], MAX_TOKENS), \
        "the adapter changes nothing: the comparison would prove nothing"
    llm = LLM(model, **{**GEOMETRY, **LORA_OPTIONS})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False,
                        lora_request=[None, LoRARequest("a", 1, adapter)])
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    assert llm.engine.adapters.pinned() == 0
