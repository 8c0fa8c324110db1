"""Reasoning models: which part of an output is thinking and which is the answer.

`reasoning_parsers.py` holds the formats (vLLM's `--reasoning-parser` names: deepseek_r1,
qwen3, openai_gptoss), each a `ReasoningParser` whose `split(text, opening, final)` is
monotone in the text (`abstract_reasoning_parser.py`); `harmony.py` reads gpt-oss's
messages; `model_reasoning.py` binds a parser to a model's tokenizer (the markers' token
ids, the per-request `RequestReasoning`); `reasoning_gate.py` starts a request's grammar
after its reasoning (structured outputs and tool calls apply to the answer).

Used by the engine (the split of every `CompletionOutput`, the gate) and by the server
(`message.reasoning`, `delta.reasoning`); it sits at the structured layer.
"""

from __future__ import annotations

from arcjax.reasoning.abstract_reasoning_parser import ReasoningParser
from arcjax.reasoning.reasoning_parsers import (DeepSeekR1ReasoningParser, GptOssReasoningParser,
                                                Qwen3ReasoningParser)

PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)}
# `reasoning_parser` values besides PARSERS: "none" splits nothing; None (the default)
# splits requests whose prompt shows a think block (`model_reasoning.ModelReasoning`).
NO_PARSER = "none"
