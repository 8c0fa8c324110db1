"""Chat templates: a model's `chat_template`, rendered as transformers' `apply_chat_template` does.

`ChatTemplate.from_dir(model_dir)` reads `chat_template.jinja` or the `chat_template` entry of
`tokenizer_config.json` (a string, or a list of {"name", "template"} with a "default"), plus
the special tokens (`bos_token`, `eos_token`, ...) the template may print;
`ChatTemplate.from_source(text_or_path, specials)` is a template given on its own (a server's
`--chat-template`, a request's `chat_template`). `render(messages,
add_generation_prompt=True, continue_final_message=False, **kwargs)` returns the prompt
text; tokenize it without adding special tokens (the template prints them), as
transformers does. `continue_final_message` leaves the last message open (the text ends
with its content, as transformers cuts it) so the model continues it.

NOTE: templates come from model files, i.e. untrusted code: they run in jinja2's
`ImmutableSandboxedEnvironment` with transformers' environment (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, a non-escaping `tojson`, `strftime_now`, and the
`{% generation %}` block as a no-op). Used by the OpenAI server; `LLM.chat` can reuse it.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence

from arcjax.errors import RequestError

# transformers' marker of where a continued final message ends in the rendered text
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token",
                      "cls_token", "mask_token")


class ChatTemplateError(RequestError):
    """A chat request the template cannot render (field "messages"): the model has no
    template, or the template refused the conversation (`raise_exception`)."""


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


@functools.lru_cache(maxsize=16)
def _compile(source: str):
    """The compiled template (cached by source text: compiling is the slow part)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` renders its body (transformers marks
        assistant tokens with it; we need no mask)."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _token_text(value) -> str | None:
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """One model's chat template plus the special tokens it may print."""

    def __init__(self, source: str | None, special_tokens: Mapping[str, str] | None = None):
        self.source = source
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> "ChatTemplate":
        """Reads the template of a Hugging Face-format directory, or of a GGUF file (its
        `tokenizer.chat_template` metadata); None if it has none."""
        model_dir = os.fspath(model_dir)
        if model_dir.lower().endswith(".gguf") and os.path.isfile(model_dir):
            from arcjax.model.formats.gguf_file import GGUFFile
            from arcjax.model.formats.gguf_tokenizer import chat_template

            return cls(*chat_template(GGUFFile(model_dir)))
        cfg = {}
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
        source = cfg.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        jinja_path = os.path.join(model_dir, "chat_template.jinja")
        if os.path.isfile(jinja_path):
            with open(jinja_path, encoding="utf-8") as f:
                source = f.read()
        specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(cfg.get(k)))}
        return cls(source if isinstance(source, str) else None, specials)

    @classmethod
    def from_source(cls, source: str, special_tokens: Mapping[str, str] | None = None
                    ) -> "ChatTemplate":
        """A template from `source`: a file's path (`.jinja` or any readable file), or the
        template text itself (vLLM's `--chat-template` takes either)."""
        if "{" not in source and os.path.isfile(source):
            with open(source, encoding="utf-8") as f:
                source = f.read()
        return cls(source, special_tokens)

    def render(self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True,
               continue_final_message: bool = False, **kwargs) -> str:
        """The prompt text of a conversation (`messages`: dicts with "role" and "content").

        Raises:
          ChatTemplateError: the model has no chat template, or the template rejected the
            conversation or failed, or (continue_final_message) the final message does not
            appear in the rendered text.
        """
        if not continue_final_message:
            return self._render(messages, add_generation_prompt, kwargs)
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ChatTemplateError("messages", "continue_final_message: the final message "
                                                "has no text content to continue")
        marked = [*messages[:-1], {**messages[-1], "content": final + _CONTINUE_TAG}]
        text = self._render(marked, add_generation_prompt, kwargs)
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise ChatTemplateError("messages", "continue_final_message: the final message "
                                                "does not appear in the rendered chat")
        at = text.rindex(_CONTINUE_TAG.strip())  # transformers' cut
        return text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else (
            text[:at].rstrip())

    def _render(self, messages: Sequence[Mapping], add_generation_prompt: bool,
                kwargs: Mapping) -> str:
        import jinja2

        if self.source is None:
            raise ChatTemplateError("messages", "this model has no chat template "
                                                "(tokenizer_config.json has no chat_template)")
        try:
            template = _compile(self.source)
        except jinja2.TemplateError as e:
            raise ChatTemplateError("messages", f"the model's chat template does not compile "
                                                f"({e})") from None
        try:
            return template.render(messages=list(messages),
                                   add_generation_prompt=add_generation_prompt,
                                   **{**self.special_tokens, **kwargs})
        except jinja2.TemplateError as e:
            raise ChatTemplateError("messages", f"chat template: {e}") from None
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise ChatTemplateError("messages", f"chat template failed: {e!r}") from None
