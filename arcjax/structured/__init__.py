"""Structured outputs and tool calls: grammar matchers (llguidance) that constrain what a
request may generate, the host side of the token bitmask the jitted step applies, and the
OpenAI tool-calling glue (tool_choice -> a constraint, parsers of a model's tool calls).

Dependencies: the engine and the server use this package; it uses `arcjax.runtime`'s
params classes and nothing above them.
"""

from arcjax.structured.grammar import (GrammarCompiler, MaskFiller, RequestGrammar,
                                       StructuredOutputManager)

__all__ = ["GrammarCompiler", "MaskFiller", "RequestGrammar", "StructuredOutputManager"]
