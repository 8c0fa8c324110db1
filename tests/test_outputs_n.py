"""n > 1 (vLLM's RequestOutput.outputs), priority, special-token detokenization, LLM.chat."""


import numpy as np
import pytest

from arcjax import LLM, SamplingParams
from arcjax.entrypoints.chat_template import ChatTemplateError
from support.hf_models import tiny_model_dir, tiny_model_with_chat_template

ARCH = "LlamaForCausalLM"
GEOMETRY = dict(block_size=8, num_kv_blocks=96, max_model_len=256, max_num_seqs=8,
                attention_impl="auto")
PROMPT = np.random.RandomState(2).randint(3, 384, 43).tolist()


def test_n_samples_share_the_prompt_and_are_reproducible_per_seed():
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY)
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=11, ignore_eos=True,
                            logprobs=2)
    out = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" and len(c.logprobs) == 6
               for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids and out.finished
    assert len({c.token_ids for c in out.outputs}) > 1  # own seed streams
    # the prompt is computed once: the other samples hit the prefix cache for its full
    # blocks and recompute only the tail block
    prefill = sum(r.prefill_tokens for r in llm.engine.trace)
    assert prefill <= len(PROMPT) + 3 * GEOMETRY["block_size"]
    assert sum(r.cached_tokens for r in llm.engine.trace) >= 3 * (len(PROMPT) - 8)
    again = llm.generate(PROMPT, params, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    # sample i equals a single request with seed + i: batch-independent streams
    single = llm.generate([PROMPT] * 2, [SamplingParams(
        max_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True) for i in (0, 2)],
        use_tqdm=False)
    assert single[0].token_ids == out.outputs[0].token_ids
    assert single[1].token_ids == out.outputs[2].token_ids
    assert llm.engine.blocks_in_use() == 0 and not llm.engine.has_unfinished()
    llm.engine.check_trace()


def test_n_abort_and_step_api():
    llm = LLM(tiny_model_dir(ARCH), **GEOMETRY)
    rid = llm.add_request(PROMPT, SamplingParams(n=3, max_tokens=50, temperature=0.7))
    outs = llm.step() + llm.step()
    assert all(o.request_id == rid and len(o.outputs) == 3 for o in outs)
    llm.abort(rid)
    final = llm.step()
    assert final[-1].finished and all(c.finish_reason == "abort" for c in final[-1].outputs)
    assert not llm.has_unfinished() and llm.engine.blocks_in_use() == 0


def test_priority_orders_admission():
    llm = LLM(tiny_model_dir(ARCH), **{**GEOMETRY, "max_num_seqs": 1})
    greedy = SamplingParams(max_tokens=2, temperature=0)
    llm.engine.add_request(PROMPT[:5], greedy, "late", priority=5)
    llm.engine.add_request(PROMPT[5:10], greedy, "urgent", priority=-1)
    finished = []
    while llm.has_unfinished():
        finished += [o.request_id for o in llm.step() if o.finished]
    assert finished == ["urgent", "late"]
    with pytest.raises(ValueError):
        llm.engine.add_request(PROMPT, greedy, priority="high")


def _chat_model(template):
    return tiny_model_with_chat_template(template)


CHATML = ("{{ bos_token }}{% for message in messages %}{{ '<|im_start|>' + message['role'] + "
          "'\n' + message['content'] + eos_token + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def test_chat_equals_transformers_apply_chat_template_and_special_tokens():
    import transformers

    path = _chat_model(CHATML)
    llm = LLM(path, **GEOMETRY)
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    convs = [[{"role": "system", "content": "Be brief."},
              {"role": "user", "content": "def fibonacci(n):"},
              {"role": "assistant", "content": "return n"},
              {"role": "user", "content": "The quick brown fox"}],
             [{"role": "user", "content": "Naïve café"}]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    outs = llm.chat(convs, params, use_tqdm=False)
    for conv, out in zip(convs, outs):
        want = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        want = want if isinstance(want, list) else want["input_ids"]
        assert list(out.prompt_token_ids) == list(want)
        assert out.prompt == hf_tok.apply_chat_template(conv, add_generation_prompt=True,
                                                        tokenize=False)
    one = llm.chat(convs[1], params, use_tqdm=False)
    assert len(one) == 1 and one[0].token_ids == outs[1].token_ids
    with pytest.raises(ChatTemplateError) as err:
        LLM(_chat_model(None), **GEOMETRY).chat(convs[1], params, use_tqdm=False)
    assert err.value.field == "messages" and "no chat template" in str(err.value)
    # special tokens: kept or skipped in the text, spaces between them or not
    tok = llm.tokenizer
    ids = [1] + tok.encode("fox", add_special_tokens=False) + [2]
    assert tok.decode(ids) == "fox"
    assert tok.decode(ids, skip_special_tokens=False,
                      spaces_between_special_tokens=True) == "<s> fox </s>"
    assert tok.decode(ids, skip_special_tokens=False,
                      spaces_between_special_tokens=False) == "<s>fox</s>"
