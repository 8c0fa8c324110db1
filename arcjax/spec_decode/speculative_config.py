"""`SpeculativeConfig`: speculative decoding's options (vLLM's `speculative_config` names),
validated before anything is loaded, and the proposer interface.

  {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
   "prompt_lookup_max": 4}                          prompt lookup on the host (ngram_proposer.py)
  {"method": "draft_model", "model": PATH, "num_speculative_tokens": k}
                                                    a smaller model (draft_model.py)

Both accept "disable_by_batch_size": speculation is off in any step that starts with more
running requests than that (verification then costs more than it saves). A missing "method"
with a "model" means "draft_model" (vLLM's inference). Every bad value raises
`EngineConfigError` whose `.field` is "speculative_config.<key>".
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from arcjax.errors import EngineConfigError, ModelFileError
from arcjax.model.formats.hub import ModelSource, resolve_model
from arcjax.model.formats.loader import model_config

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 32  # a verification row is 1 + k tokens; its bucket S * (1 + k)
# Above this many running requests speculation is off by default: on this project's CPU
# (RESULTS.md, scripts/bench_spec.py: n-gram, k = 4, on a repeat-the-prompt workload) it
# gains 1.2x with 4 concurrent requests and loses 0.78x with 8, as verifying 1 + k rows per
# request costs about in proportion to the rows there. Not measured on a GPU, where a
# memory-bound decode step leaves more room (vLLM's default is "never off": pass None).
DEFAULT_DISABLE_BY_BATCH_SIZE = 4
_FIELDS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
           "model", "disable_by_batch_size")


def _field(name: str) -> str:
    return f"speculative_config.{name}"


def _int(name: str, value, low: int, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise EngineConfigError(_field(name), f"must be an int, got {value!r}")
    if value < low or (high is not None and value > high):
        span = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise EngineConfigError(_field(name), f"must be {span}, got {value}",
                                limit=low if value < low else high)
    return value


@dataclasses.dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """Speculative decoding (see the module docstring).

    Attributes:
      method: "ngram" | "draft_model".
      num_speculative_tokens: k, draft tokens per decode row and step (1 .. 32).
      prompt_lookup_min / prompt_lookup_max: n-gram lengths matched (ngram; vLLM's defaults:
        one given sets the other, none sets both to 5).
      model: the draft model's directory (draft_model): same vocabulary as the target.
      disable_by_batch_size: no drafts in a step that starts with more running requests
        than this; None = never off.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE

    def __post_init__(self):
        if self.method not in METHODS:
            raise EngineConfigError(_field("method"),
                                    f"must be one of {METHODS}, got {self.method!r}")
        _int("num_speculative_tokens", self.num_speculative_tokens, 1, MAX_SPECULATIVE_TOKENS)
        if self.disable_by_batch_size is not None:
            _int("disable_by_batch_size", self.disable_by_batch_size, 1)
        if self.method == "ngram":
            if self.model is not None:
                raise EngineConfigError(_field("model"), "the ngram method takes no model")
            low, high = self.prompt_lookup_min, self.prompt_lookup_max
            if low is None and high is None:
                low = high = 5
            low = high if low is None else low
            high = low if high is None else high
            _int("prompt_lookup_min", low, 1)
            _int("prompt_lookup_max", high, 1)
            if low > high:
                raise EngineConfigError(_field("prompt_lookup_min"), f"must be <= "
                                        f"prompt_lookup_max ({high}), got {low}", limit=high)
            object.__setattr__(self, "prompt_lookup_min", low)
            object.__setattr__(self, "prompt_lookup_max", high)
            return
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise EngineConfigError(_field(name), "only the ngram method takes it")
        if not isinstance(self.model, str) or not self.model:
            raise EngineConfigError(_field("model"), "draft_model needs the draft model's "
                                    f"directory, got {self.model!r}")

    @classmethod
    def create(cls, value) -> "SpeculativeConfig | None":
        """A config from None, a SpeculativeConfig, a mapping of vLLM's keys, or its JSON text
        (what `arcjax serve --speculative-config` passes).

        Raises:
          EngineConfigError: not a mapping, an unknown key, a missing or bad value.
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise EngineConfigError("speculative_config", f"is not valid JSON ({e})") from None
        if not isinstance(value, Mapping):
            raise EngineConfigError("speculative_config", "must be a dict such as {'method': "
                                    f"'ngram', 'num_speculative_tokens': 4}}, got {value!r}")
        unknown = sorted(set(map(str, value)) - set(_FIELDS))
        if unknown:
            raise EngineConfigError(_field(unknown[0]), f"unknown key(s) {unknown}; keys are "
                                    f"{list(_FIELDS)}")
        options = dict(value)
        if "method" not in options:
            if options.get("model") is None:
                raise EngineConfigError(_field("method"), f"is required (one of {METHODS})")
            options["method"] = "draft_model"
        if "num_speculative_tokens" not in options:
            raise EngineConfigError(_field("num_speculative_tokens"), "is required")
        if isinstance(options.get("model"), os.PathLike):
            options["model"] = os.fspath(options["model"])
        return cls(**options)

    def check_draft_model(self, target: ModelSource, max_model_len: int) -> ModelSource:
        """Checks the draft model against the target from their configs (no weights read):
        same vocabulary size, same tokenizer vocabulary when both ship a tokenizer.json,
        and positions for max_model_len. Returns the draft's resolved source.

        Raises:
          EngineConfigError: the draft cannot serve this target (or cannot be found).
        """
        try:
            draft = resolve_model(self.model)
            draft_cfg = model_config(draft)
        except ModelFileError as e:
            raise EngineConfigError(_field("model"), f"the draft model cannot be read: "
                                    f"{e}") from e
        target_cfg = model_config(target)
        if draft_cfg.vocab_size != target_cfg.vocab_size:
            raise EngineConfigError(_field("model"), f"the draft's vocabulary "
                                    f"({draft_cfg.vocab_size} tokens) differs from the "
                                    f"target's ({target_cfg.vocab_size})",
                                    limit=target_cfg.vocab_size)
        if draft_cfg.max_position_embeddings < max_model_len:
            raise EngineConfigError(_field("model"), f"the draft model handles "
                                    f"{draft_cfg.max_position_embeddings} positions, less than "
                                    f"max_model_len {max_model_len}",
                                    limit=draft_cfg.max_position_embeddings)
        vocabs = [_tokenizer_vocab(s) for s in (target, draft)]
        if None not in vocabs and vocabs[0] != vocabs[1]:
            raise EngineConfigError(_field("model"), "the draft's tokenizer differs from the "
                                    "target's (same ids must mean the same tokens)")
        return draft


def _tokenizer_vocab(source: ModelSource) -> dict | None:
    """The token -> id map of a model directory's tokenizer.json, or None without one (a
    GGUF file keeps its tokenizer inside: not compared)."""
    path = source.path / "tokenizer.json"
    if source.is_gguf or not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
        model = data.get("model", {})
        vocab = model.get("vocab")
        added = {t.get("content"): t.get("id") for t in data.get("added_tokens", [])}
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise EngineConfigError(_field("model"), f"{path}: unreadable ({e})") from None
    if isinstance(vocab, list):  # unigram models: [[piece, score], ...]
        vocab = {piece[0]: i for i, piece in enumerate(vocab)}
    return {**(vocab or {}), **added}


class ProposalRow(NamedTuple):
    """One decode-ready row a proposer drafts for.

    Attributes:
      request_id: its request.
      tokens: its tokens known on the host (prompt, then outputs), oldest first.
      pending: tokens after those that the host does not know yet (0, or 1 with overlapped
        scheduling: the newest was sampled by the step still on the device). The drafts
        continue after them, so a proposer guesses them first.
    """

    request_id: str
    tokens: Sequence[int]
    pending: int


class Proposer(Protocol):
    """Proposes draft tokens for decode-ready rows (engine thread, before each plan)."""

    def propose(self, rows: Sequence[ProposalRow], k: int) -> list[tuple[int, ...]]:
        """Up to k draft tokens per row (possibly none), in row order."""

    def release(self, request_id: str) -> None:
        """Forgets a request (it finished or was aborted)."""

    def reset(self) -> None:
        """Forgets every request (after a failed step; a lost device cache is rebuilt)."""
