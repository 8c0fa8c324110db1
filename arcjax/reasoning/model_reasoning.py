"""A reasoning parser bound to one model's tokenizer, and its state per request.

`ModelReasoning.create(name, tokenizer)` (the engine's `reasoning_parser` option):
  a `PARSERS` name   that format for every request; its markers must be tokens of the
                     vocabulary (as vLLM requires);
  "none"             no request is split;
  None (default)     implied by the prompt: when the vocabulary has `<think>` and
                     `</think>` tokens, a request whose prompt shows a think block (the
                     chat template opened one, or closed it) is split as deepseek_r1
                     splits; other requests are not.
`gate=False` (the engine's `structured_outputs_in_reasoning`): a request's grammar
constrains its whole output, the reasoning included.
`ModelReasoning.request(prompt_tail, skip_special_tokens)` gives a request's
`RequestReasoning` (its parser and the prompt's opening), or None when the request is not
split; `RequestReasoning.gate(grammar)` puts the request's grammar behind its reasoning.
"""

from __future__ import annotations

import dataclasses

from arcjax.errors import EngineConfigError
from arcjax.reasoning import NO_PARSER, PARSERS
from arcjax.reasoning.abstract_reasoning_parser import ReasoningParser, Split
from arcjax.reasoning.reasoning_gate import ReasoningGate
from arcjax.reasoning.reasoning_parsers import DeepSeekR1ReasoningParser
from arcjax.structured.mask_source import MaskSource


def _single_token(tokenizer, text: str) -> int | None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


@dataclasses.dataclass(frozen=True)
class RequestReasoning:
    """One request's reasoning: the model's parser and how its prompt left the block."""

    model: "ModelReasoning"
    opening: str

    def split(self, text: str, final: bool) -> Split:
        return self.model.parser.split(text, self.opening, final)

    def gate(self, grammar: MaskSource) -> MaskSource:
        """`grammar` starting after the reasoning (as it is when the output starts in the
        answer, or may open a block whose start marker is not one token); unchanged when
        the model's grammars constrain the reasoning too."""
        if not self.model.gated:
            return grammar
        inside = self.model.parser.starts_in_reasoning(self.opening)
        if inside is False or (inside is None and self.model.start_id is None):
            return grammar
        return ReasoningGate(grammar, self.model.end_ids, self.model.start_id, bool(inside))


class ModelReasoning:
    """A parser and the token ids of its markers (see the module docstring)."""

    def __init__(self, parser: ReasoningParser, tokenizer, implied: bool = False,
                 gate: bool = True):
        self.parser, self.implied, self.gated = parser, implied, gate
        self.end_ids = tuple(tokenizer.encode(parser.end, add_special_tokens=False))
        self.start_id = _single_token(tokenizer, parser.start)

    @classmethod
    def create(cls, name: str | None, tokenizer, gate: bool = True) -> "ModelReasoning | None":
        """The engine's reasoning for option `name` (see the module docstring); `gate`:
        grammars start after the reasoning.

        Raises:
          EngineConfigError (field "reasoning_parser"): an unknown name, no tokenizer, or
            a vocabulary without the format's marker tokens.
        """
        if name == NO_PARSER:
            return None
        if name is None:
            parser = DeepSeekR1ReasoningParser()
            if tokenizer is None or any(tokenizer.token_to_id(m) is None
                                        for m in (parser.start, parser.end)):
                return None
            return cls(parser, tokenizer, implied=True, gate=gate)
        if name not in PARSERS:
            raise EngineConfigError("reasoning_parser", f"must be one of {sorted(PARSERS)}, "
                                    f"{NO_PARSER!r} or None, got {name!r}")
        if tokenizer is None:
            raise EngineConfigError("reasoning_parser", "needs the model's tokenizer")
        parser = PARSERS[name]()
        if not parser.needs_special_tokens:
            missing = [m for m in (parser.start, parser.end) if tokenizer.token_to_id(m) is None]
            if missing:
                raise EngineConfigError("reasoning_parser", f"{name}: the vocabulary has no "
                                        f"{missing[0]!r} token")
        return cls(parser, tokenizer, gate=gate)

    def request(self, prompt_tail: str, skip_special_tokens: bool) -> RequestReasoning | None:
        """A request's reasoning, from its prompt's last tokens (decoded with special
        tokens); None: the request is not split (implied and no block in the prompt, or
        a format whose markers are special tokens, which the text then lacks)."""
        opening = self.parser.opening(prompt_tail)
        if (self.implied and opening == "none") or (self.parser.needs_special_tokens
                                                    and skip_special_tokens):
            return None
        return RequestReasoning(self, opening)
