"""Tokenizer: a Hugging Face `tokenizer.json` plus the model's special-token ids.

`Tokenizer.from_dir(model_dir)` reads:
  - `tokenizer.json` (required) with the `tokenizers` library;
  - `generation_config.json` (optional): `eos_token_id` (int or list), `bos_token_id`;
  - `tokenizer_config.json` (optional): `eos_token` / `bos_token` (a string or a dict with
    "content") and `add_bos_token`;
  - `config.json` (optional): `eos_token_id` / `bos_token_id`, used only when neither file above
    names them.

`make_detokenizer(...)` turns a stream of token ids into text deltas for streaming output:
a `StreamingDetokenizer` (the `tokenizers` library's `decoders.DecodeStream`) wherever its
options allow, else an `IncrementalDetokenizer` (a decoded window of recent tokens, for
`spaces_between_special_tokens` with special tokens kept, which DecodeStream cannot do).
Both give the same text and the same guarantees (decision records 0004 and 0014 in
docs/decisions/).
"""

from __future__ import annotations

import copy
import functools
import json
import os
from collections.abc import Iterable, Sequence
from typing import Any

import tokenizers
from tokenizers.decoders import DecodeStream

from arcjax.errors import ModelFileError

REPLACEMENT_CHAR = "\ufffd"
# Tokens of left context decoded with each new token, so decoders whose output depends on the
# previous token (Metaspace's leading space, WordPiece's "##") render the new text correctly.
_CONTEXT_TOKENS = 5
_LONG_TEXT = 4096  # characters: longer texts are encoded with the GIL released


class TokenizerFileError(ModelFileError):
    """A tokenizer file is missing, unreadable or malformed. `path` names the file."""


class TokenizerFileNotFoundError(TokenizerFileError, FileNotFoundError):
    """A required tokenizer file does not exist."""


def _read_json(path: str) -> dict[str, Any] | None:
    """The parsed JSON object at `path`, or None if there is no such file."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerFileError(path, f"cannot parse JSON ({e})") from e
    if not isinstance(data, dict):
        raise TokenizerFileError(path, f"expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A tokenizer_config special token: "<s>" or {"content": "<s>", ...} or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_id_list(value: Any, path: str, field: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in items):
        raise TokenizerFileError(path, f"{field} must be a non-negative int or a list of them, got {value!r}")
    return list(items)


class Tokenizer:
    """Text <-> token ids for one model, with its EOS/BOS ids."""

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        *,
        eos_token_ids: Sequence[int] = (),
        bos_token_id: int | None = None,
        add_bos_token: bool = False,
    ):
        self._tok = tokenizer
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self.bos_token_id: int | None = bos_token_id
        # NOTE: some tokenizer.json files add BOS in their post-processor (Llama 3); prepend it
        # ourselves only when add_bos_token asks for it and the post-processor does not.
        post_adds_bos = bos_token_id is not None and tokenizer.encode("").ids[:1] == [bos_token_id]
        self._prepend_bos = add_bos_token and bos_token_id is not None and not post_adds_bos
        added = tokenizer.get_added_tokens_decoder()
        self.added_token_ids = frozenset(added)
        # the texts of special added tokens (skip_special_tokens drops them from outputs)
        self.special_texts = frozenset(t.content for t in added.values() if t.special)
        self._token_text: dict[int, str] = {}

    def to_json(self) -> str:
        """The tokenizer as `tokenizer.json` text (what a grammar engine reads)."""
        return self._tok.to_str()

    @classmethod
    def from_dir(cls, model_dir: str | os.PathLike) -> Tokenizer:
        """Loads the tokenizer of a Hugging Face-format model directory.

        Raises:
          TokenizerFileNotFoundError: tokenizer.json is missing.
          TokenizerFileError: a file is unreadable, malformed, or names an unknown special token.
        """
        model_dir = os.fspath(model_dir)
        tok_path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(tok_path):
            raise TokenizerFileNotFoundError(tok_path, "file not found")
        try:
            tok = tokenizers.Tokenizer.from_file(tok_path)
        except Exception as e:  # the Rust side raises a bare Exception for every parse error
            raise TokenizerFileError(tok_path, f"not a valid tokenizer.json ({e})") from e

        gen_path = os.path.join(model_dir, "generation_config.json")
        tcfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg_path = os.path.join(model_dir, "config.json")
        gen = _read_json(gen_path) or {}
        tcfg = _read_json(tcfg_path) or {}

        def token_id(name: str | None, field: str) -> list[int]:
            if name is None:
                return []
            tid = tok.token_to_id(name)
            if tid is None:
                raise TokenizerFileError(tcfg_path, f"{field} {name!r} is not in the vocabulary")
            return [tid]

        eos = _as_id_list(gen.get("eos_token_id"), gen_path, "eos_token_id")
        eos += token_id(_token_content(tcfg.get("eos_token")), "eos_token")
        bos = _as_id_list(gen.get("bos_token_id"), gen_path, "bos_token_id")
        bos += token_id(_token_content(tcfg.get("bos_token")), "bos_token")
        if not eos or not bos:
            cfg = _read_json(cfg_path) or {}
            eos = eos or _as_id_list(cfg.get("eos_token_id"), cfg_path, "eos_token_id")
            bos = bos or _as_id_list(cfg.get("bos_token_id"), cfg_path, "bos_token_id")
        return cls(
            tok,
            eos_token_ids=eos,
            bos_token_id=bos[0] if bos else None,
            add_bos_token=bool(tcfg.get("add_bos_token", False)),
        )

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters of the longest vocabulary entry (added tokens included): no token
        stands for more characters of text than this (byte-level entries count bytes)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    @classmethod
    def from_gguf(cls, gguf_file) -> Tokenizer:
        """The tokenizer a GGUF file carries (an `arcjax.model.formats.gguf_file.GGUFFile`; see
        `arcjax.model.formats.gguf_tokenizer`).

        Raises:
          ModelConfigError: the file has no tokenizer, or one of an unsupported kind.
        """
        from arcjax.model.formats.gguf_tokenizer import build_tokenizer

        t = build_tokenizer(gguf_file)
        return cls(t.tokenizer, eos_token_ids=t.eos_token_ids, bos_token_id=t.bos_token_id,
                   add_bos_token=t.add_bos_token)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, BOS is added where the model
        expects it. A long text is encoded with the GIL released (the library's batch
        call), so other threads (an event loop, the engine) run meanwhile."""
        if len(text) > _LONG_TEXT:
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self._prepend_bos:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               spaces_between_special_tokens: bool = False) -> str:
        """Text of `ids`; incomplete UTF-8 sequences decode to U+FFFD.

        With `skip_special_tokens=False`, added (special) tokens are kept; with
        `spaces_between_special_tokens` (vLLM's SamplingParams default; False here keeps the
        library's plain decode), each added token and each run of ordinary tokens is
        decoded on its own and the pieces are joined with " ".
        """
        ids = list(ids)
        if (skip_special_tokens or not spaces_between_special_tokens
                or not self.added_token_ids.intersection(ids)):
            return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        pieces, run = [], []
        for t in ids:
            if t in self.added_token_ids:
                if run:
                    pieces.append(self._tok.decode(run, skip_special_tokens=False))
                    run = []
                pieces.append(self._tok.id_to_token(t))
            else:
                run.append(t)
        if run:
            pieces.append(self._tok.decode(run, skip_special_tokens=False))
        return " ".join(pieces)

    def token_text(self, token_id: int) -> str:
        """One token's own text (specials kept), cached: for logprob entries."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self._tok.decode([token_id],
                                                                  skip_special_tokens=False)
        return text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Streams the text of generated tokens, one delta per `add`.

    A byte-level BPE token can hold part of a multi-byte UTF-8 character; the delta for it is ""
    until the character is complete, so no U+FFFD is emitted for a character still being spelled.
    Every `add` decodes a small window: tokens [prefix_offset, read_offset) are text already
    emitted (kept as left context), [read_offset, end) is text not yet emitted (vLLM's scheme).

    NOTE: "".join(deltas) + flush() == tokenizer.decode(ids) for byte-level tokenizers (the
    boundary at read_offset always falls between complete characters). With `prompt_ids` (context
    only, never emitted) the same holds for decode(prompt + ids) minus decode(prompt), provided the
    prompt ends on a complete character.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._ids: list[int] = list(prompt_ids)
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Appends one token id; returns the newly completed text (possibly "")."""
        self._ids.append(token_id)
        emitted, full = self._window_texts()
        if len(full) <= len(emitted) or full.endswith(REPLACEMENT_CHAR):
            return ""  # nothing new, or a character still incomplete: wait for more tokens
        delta = full[len(emitted):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Emits whatever is held back (an unfinished character decodes to U+FFFD); call at the end."""
        emitted, full = self._window_texts()
        delta = full[len(emitted):] if len(full) > len(emitted) else ""
        self._prefix_offset = self._read_offset = len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def snapshot(self) -> tuple:
        """The state `add`/`flush` change, in O(1) (they only append)."""
        return len(self._ids), self._read_offset, self._prefix_offset, len(self._pieces)

    def restore(self, snap: tuple) -> None:
        n_ids, self._read_offset, self._prefix_offset, n_pieces = snap
        del self._ids[n_ids:]
        del self._pieces[n_pieces:]

    def _window_texts(self) -> tuple[str, str]:
        decode = self._tok.decode
        emitted = decode(self._ids[self._prefix_offset : self._read_offset], self._skip,
                         self._spaces)
        full = decode(self._ids[self._prefix_offset :], self._skip, self._spaces)
        return emitted, full


class StreamingDetokenizer:
    """`IncrementalDetokenizer`'s interface on `tokenizers.decoders.DecodeStream`: one call
    into the library per token (it holds back a partial UTF-8 character itself), with the
    prompt's last tokens as context. `flush` decodes what the stream still holds (an
    unfinished character: U+FFFD); `snapshot` copies the stream's small state (O(1): it
    keeps only the tokens since its last complete text).

    NOTE: the same invariant as `IncrementalDetokenizer`: "".join(deltas) + flush() ==
    decode(ids) for byte-level tokenizers (tests/test_tokenizer.py runs both).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._stream, self._context_chars = self._primed(context)
        self._context = context  # tokens before `_pending` (for flush)
        self._pending: list[int] = []  # tokens whose text the stream still holds
        self._pieces: list[str] = []

    def _primed(self, context: list[int]) -> tuple[DecodeStream, int]:
        """A stream that has read `context`, and how many characters of the context's text
        it still holds back (a prompt ending in an unfinished character: that text belongs
        to the prompt, so the first deltas drop it, as `IncrementalDetokenizer` does)."""
        stream = DecodeStream(skip_special_tokens=self._skip)
        seen = sum(len(stream.step(self._tok._tok, t) or "") for t in context)
        return stream, max(0, len(self._tok.decode(context, self._skip)) - seen)

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._pieces)

    def add(self, token_id: int) -> str:
        """Appends one token id; returns the newly completed text (possibly "")."""
        delta = self._stream.step(self._tok._tok, int(token_id))
        self._pending.append(int(token_id))
        if not delta:
            return ""
        self._context = (self._context + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
        if self._context_chars:
            cut = min(self._context_chars, len(delta))
            delta, self._context_chars = delta[cut:], self._context_chars - cut
            if not delta:
                return ""
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """Emits whatever is held back (an unfinished character decodes to U+FFFD)."""
        if not self._pending:
            return ""
        decode = self._tok.decode
        before = decode(self._context, self._skip)
        full = decode(self._context + self._pending, self._skip)
        delta = full[len(before):] if full.startswith(before) else ""
        self._context = (self._context + self._pending)[-_CONTEXT_TOKENS:]
        self._pending = []
        self._stream, _ = self._primed(self._context)  # the flushed text was emitted
        if delta:
            self._pieces.append(delta)
        return delta

    def snapshot(self) -> tuple:
        """The state `add`/`flush` change, in O(1)."""
        return (copy.copy(self._stream), tuple(self._context), tuple(self._pending),
                len(self._pieces), self._context_chars)

    def restore(self, snap: tuple) -> None:
        stream, context, pending, n_pieces, self._context_chars = snap
        self._stream = copy.copy(stream)
        self._context, self._pending = list(context), list(pending)
        del self._pieces[n_pieces:]


def make_detokenizer(tokenizer: Tokenizer, prompt_ids: Sequence[int] = (), *,
                     skip_special_tokens: bool = True,
                     spaces_between_special_tokens: bool = True):
    """The detokenizer of one request: DecodeStream's, unless special tokens are kept and
    spaced (`spaces_between_special_tokens`, which only the window decoder does)."""
    if not skip_special_tokens and spaces_between_special_tokens and tokenizer.added_token_ids:
        return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=False,
                                      spaces_between_special_tokens=True)
    return StreamingDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)
