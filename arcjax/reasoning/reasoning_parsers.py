"""The reasoning formats models write, one class each (vLLM's `--reasoning-parser` names).

  deepseek_r1    `<think>`...`</think>` then the answer; the output starts inside the block
                 (DeepSeek-R1's template opens it) unless the prompt closed one.
  qwen3          the same markers; the output may open the block itself (Qwen3), or
                 continue one the template opened; a prompt that closed it (Qwen3's
                 `enable_thinking: false`) leaves everything content.
  openai_gptoss  harmony (`harmony.py`): the analysis channel is reasoning, the final
                 channel (and commentary without a recipient) content; tool calls are
                 neither (the `openai` tool parser reads them). Needs the special tokens.
"""

from __future__ import annotations

from arcjax.reasoning import harmony
from arcjax.reasoning.abstract_reasoning_parser import ReasoningParser, Split, ThinkBlockParser


class DeepSeekR1ReasoningParser(ThinkBlockParser):
    """DeepSeek-R1 (and its distills): reasoning from the first token."""

    name = "deepseek_r1"


class Qwen3ReasoningParser(ThinkBlockParser):
    """Qwen3 / QwQ: a block the output opens, or the one the template opened."""

    name = "qwen3"

    def starts_in_reasoning(self, opening: str) -> bool | None:
        return {"open": True, "closed": False}.get(opening)


class GptOssReasoningParser(ReasoningParser):
    """gpt-oss's harmony channels (see `harmony.py`)."""

    name = "openai_gptoss"
    start = harmony.CHANNEL + "analysis" + harmony.MESSAGE
    end = harmony.FINAL_MARKER
    needs_special_tokens = True

    def opening(self, prompt_tail: str) -> str:
        """A harmony prompt ends with `<|start|>assistant`: the reply may think first."""
        return "open"

    def split(self, text: str, opening: str, final: bool) -> Split:
        messages, decided, tail = harmony.parse_messages(text, final)
        segments = [(m.body_start, min(m.body_end, decided), m.is_reasoning)
                    for m in messages if m.is_reasoning or m.is_content]
        if final and tail < len(text):  # text outside any message: shown as written
            segments.append((tail, len(text), False))
        return Split(tuple(segments), decided)
