"""The OpenAI shapes of `n` choices and their log-probabilities, from the engine's outputs.

A request's `RequestOutput.outputs` holds one `CompletionOutput` per sample; with a list of
prompts the choice index is `prompt_index * n + sample_index` (OpenAI's convention).
Log-probabilities come from `CompletionOutput.logprobs` (RAW: see `arcjax/outputs.py`):
one dict {token id: Logprob} per generated token, holding the sampled token and the top k.

- /v1/completions (`logprobs: k`): {"tokens", "token_logprobs", "top_logprobs",
  "text_offset"}; a position's `top_logprobs` is the engine's whole entry in rank order
  (the top k, plus the sampled token when it is not among them: k or k + 1 items, as
  OpenAI's "up to logprobs + 1"; token texts are the keys, so a text shared by two tokens,
  such as a partial UTF-8 character's U+FFFD, keeps the better-ranked one). `text_offset`
  is the running length of the token texts.
- /v1/chat/completions (`logprobs: true, top_logprobs: k`): {"content": [{"token",
  "logprob", "bytes", "top_logprobs": [k items in rank order]}]}; `bytes` is the UTF-8 of
  the token's text (a token that is part of a multi-byte character decodes to U+FFFD).

`ChoiceStream` turns a stream of DELTA outputs into per-choice chunks: the new text, the
tokens (and entries) new since the choice's last chunk, and the finish reason once.
"""

from __future__ import annotations

from collections.abc import Sequence

from arcjax.outputs import (
    CompletionOutput,
    Logprob,
    PositionLogprobs,
    RequestOutput,
)


def completions_of(out: RequestOutput) -> tuple[CompletionOutput, ...]:
    """The output's samples (an output built without `outputs` counts as one sample)."""
    return out.outputs or (CompletionOutput(0, out.text, out.token_ids, None, None,
                                            out.finish_reason),)


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


LOGPROB_FLOOR = -9999.0  # JSON has no -inf: a token a grammar forbids reports this (vLLM's)


def _value(lp: Logprob) -> float:
    return max(lp.logprob, LOGPROB_FLOOR)


def _ranked(entry: PositionLogprobs) -> list[Logprob]:
    return sorted(entry.values(), key=lambda lp: lp.rank)


def completion_logprobs(entries: Sequence[PositionLogprobs], token_ids: Sequence[int],
                        offset: int = 0) -> dict:
    """The completions API's `logprobs` object for these tokens; `offset`: the text length
    before the first of them (for `text_offset`)."""
    tokens, lps, tops, offsets = [], [], [], []
    for tid, entry in zip(token_ids, entries):
        chosen = entry[tid]
        text = _text(chosen)
        tokens.append(text)
        lps.append(_value(chosen))
        top: dict[str, float] = {}
        for lp in _ranked(entry):
            top.setdefault(_text(lp), _value(lp))
        tops.append(top)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops,
            "text_offset": offsets}


def _chat_token(lp: Logprob) -> dict:
    text = _text(lp)
    return {"token": text, "logprob": _value(lp), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(entries: Sequence[PositionLogprobs], token_ids: Sequence[int],
                  k: int) -> dict:
    """The chat API's `logprobs` object for these tokens (`k`: top_logprobs)."""
    content = []
    for tid, entry in zip(token_ids, entries):
        item = _chat_token(entry[tid])
        item["top_logprobs"] = [_chat_token(lp) for lp in _ranked(entry)[:k]]
        content.append(item)
    return {"content": content}


def choice_logprobs(c: CompletionOutput, k: int | None, chat: bool) -> dict | None:
    """A whole choice's `logprobs` (None when not asked)."""
    if k is None or c.logprobs is None:
        return None
    if chat:
        return chat_logprobs(c.logprobs, c.token_ids, k)
    return completion_logprobs(c.logprobs, c.token_ids)


class ChoiceStream:
    """Per-choice progress of a streamed request whose outputs are DELTA:
    `delta(index, completion)` returns (text, logprobs or None, finish reason or None) to
    send for that choice, or None when there is nothing to send yet (tokens whose text is
    held back ride, with their logprobs, in the next chunk). `tokens[index]` counts the
    choice's tokens so far (for `usage`)."""

    def __init__(self, k: int | None, chat: bool):
        self.k, self.chat = k, chat
        self.tokens: dict[int, int] = {}
        self.offset: dict[int, int] = {}
        self.held: dict[int, tuple[list, list]] = {}  # token ids, entries not sent yet
        self.done: set[int] = set()

    def delta(self, index: int, c: CompletionOutput):
        if index in self.done:
            return None
        self.tokens[index] = self.tokens.get(index, 0) + len(c.token_ids)
        want = self.k is not None and c.logprobs is not None
        if want:
            ids, entries = self.held.setdefault(index, ([], []))
            ids.extend(c.token_ids)
            entries.extend(c.logprobs)
        reason = c.finish_reason
        if not c.text and reason is None:
            return None
        if reason is not None:
            self.done.add(index)
        logprobs = None
        if want:
            ids, entries = self.held.pop(index)
            if self.chat:
                logprobs = chat_logprobs(entries, ids, self.k)
            else:
                logprobs = completion_logprobs(entries, ids, self.offset.get(index, 0))
                self.offset[index] = self.offset.get(index, 0) + sum(
                    len(t) for t in logprobs["tokens"])
        return c.text, logprobs, reason
