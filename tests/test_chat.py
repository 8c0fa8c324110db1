"""Chat templates render exactly as transformers' apply_chat_template does."""


import pytest

from arcjax.engine.build import default_model_path
from arcjax.entrypoints.chat_template import ChatTemplate, ChatTemplateError
from support.hf_models import tiny_model_with_tokenizer, tiny_model_with_chat_template

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Llama-2 style: system folded into the first user turn, bos/eos printed, raise_exception.
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
          "{% set messages = messages[1:] %}{% else %}{% set system = false %}{% endif %}"
          "{% for message in messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
          "{% if loop.index0 == 0 and system %}{% set content = '<<SYS>>\\n' + system + "
          "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}"
          "{% set content = message['content'] %}{% endif %}"
          "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + "
          "' [/INST]' }}{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
          "{% endfor %}")
# tojson, loop controls, namespace.
FANCY = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}"
         "{% continue %}{% endif %}{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}\n"
         "{% endfor %}{% if add_generation_prompt %}>{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! "}, {"role": "user", "content": "Naïve 東京 🙂?"}],
]


def _model_with_template(template: str) -> str:
    return tiny_model_with_chat_template(template)


@pytest.mark.parametrize("template", [CHATML, LLAMA2, FANCY], ids=["chatml", "llama2", "fancy"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_matches_transformers(template, conv, gen):
    import transformers

    path = _model_with_template(template)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    messages = CONVERSATIONS[conv]
    ours = ChatTemplate.from_dir(path)
    try:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    except Exception as e:  # noqa: BLE001  the template refused: ours must refuse too
        with pytest.raises(ChatTemplateError) as err:
            ours.render(messages, add_generation_prompt=gen)
        assert err.value.field == "messages" and "alternate" in str(e) + str(err.value)
        return
    assert ours.render(messages, add_generation_prompt=gen) == expected


def test_raise_exception_is_a_typed_error():
    ours = ChatTemplate.from_dir(_model_with_template(LLAMA2))
    with pytest.raises(ChatTemplateError, match="alternate") as err:
        ours.render([{"role": "assistant", "content": "x"}])
    assert err.value.field == "messages"


def test_no_template_is_a_typed_error():
    with pytest.raises(ChatTemplateError, match="no chat template") as err:
        ChatTemplate.from_dir(tiny_model_with_tokenizer("LlamaForCausalLM")).render(
            CONVERSATIONS[0])
    assert err.value.field == "messages"


def test_sandbox_blocks_unsafe_access():
    ours = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError):
        ours.render(CONVERSATIONS[0])


def test_packaged_model_has_a_simple_template():
    import transformers

    path = str(default_model_path())
    ours = ChatTemplate.from_dir(path).render(CONVERSATIONS[1])
    assert ours == transformers.AutoTokenizer.from_pretrained(path).apply_chat_template(
        CONVERSATIONS[1], tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<|endoftext|><|system|>\nBe brief.\n") and ours.endswith(
        "<|assistant|>\n")


def test_continue_final_message_matches_transformers():
    import transformers

    path = _model_with_template(CHATML)
    hf = transformers.AutoTokenizer.from_pretrained(path)
    messages = [*CONVERSATIONS[1][:3], {"role": "assistant", "content": "The answer is "}]
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                      continue_final_message=True)
    ours = ChatTemplate.from_dir(path).render(messages, add_generation_prompt=False,
                                              continue_final_message=True)
    assert ours == expected and ours.rstrip().endswith("The answer is")
    with pytest.raises(ChatTemplateError):  # a template that drops the final message
        ChatTemplate("{{ 'nothing' }}").render(messages, add_generation_prompt=False,
                                               continue_final_message=True)
