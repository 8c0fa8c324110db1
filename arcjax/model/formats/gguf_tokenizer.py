"""The tokenizer and chat template a GGUF file carries in its metadata.

`build_tokenizer(f)` makes a `tokenizers.Tokenizer` from `tokenizer.ggml.*`:

- `gpt2` (byte-level BPE: Llama 3, Qwen, SmolLM, ...): the vocabulary and merges as
  stored; the split before byte-level encoding follows `tokenizer.ggml.pre` (llama.cpp's
  name for it: llama-bpe, qwen2, smollm, ...; GPT-2's regex otherwise).
- `llama` (SentencePiece BPE: Llama 2, Mistral): BPE with byte fallback, merges rebuilt from
  the vocabulary ranked by the token scores (as transformers rebuilds them), a "▁" prefix
  unless `add_space_prefix` is false.

Tokens typed CONTROL (3) become special added tokens, USER_DEFINED (4) plain added tokens
(matched whole, as llama.cpp does). `chat_template(f)` is `tokenizer.chat_template` plus
the BOS/EOS strings a template may print.
"""

from __future__ import annotations

import dataclasses

from arcjax.errors import ModelConfigError

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> the regex splitting text before byte-level BPE (llama.cpp's list).
PRE_TOKENIZER_SPLITS = {
    "llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
    "gpt-2": _GPT2_SPLIT, "default": _GPT2_SPLIT,
}


@dataclasses.dataclass(frozen=True)
class GGUFTokenizer:
    """A GGUF file's tokenizer and its special ids."""

    tokenizer: object  # tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    add_bos_token: bool


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if pre == "smollm":  # every digit alone, then GPT-2's split
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    split = PRE_TOKENIZER_SPLITS.get(pre, _GPT2_SPLIT)
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                    byte_level])


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str):
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab, pairs, ignore_merges=pre in (
        "llama-bpe", "llama3", "llama-v3")))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
    tokens, best-scored token first (ties: shorter left piece, then shorter right)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in zip(tokens, scores):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_bpe(tokens: list[str], scores: list[float], unk: int | None,
                       add_space_prefix: bool):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, spm_merges(tokens, scores), fuse_unk=True,
                               byte_fallback=True,
                               unk_token=tokens[unk] if unk is not None else None))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme="first" if add_space_prefix else "never",
        split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def has_tokenizer(f) -> bool:
    """Whether GGUF file `f` carries a tokenizer (a model may ship without one)."""
    return f.get("tokenizer.ggml.model") is not None and bool(f.get("tokenizer.ggml.tokens"))


def build_tokenizer(f) -> GGUFTokenizer:
    """The tokenizer of GGUF file `f` (an `arcjax.model.formats.gguf_file.GGUFFile`).

    Raises:
      ModelConfigError: no tokenizer in the file, or a kind other than gpt2/llama.
    """
    from tokenizers import AddedToken

    kind = f.get("tokenizer.ggml.model")
    tokens = f.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        raise ModelConfigError(f.path, "the GGUF file has no tokenizer (tokenizer.ggml.*)")
    types = f.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if kind == "gpt2":
        tok = _byte_level_bpe(tokens, f.get("tokenizer.ggml.merges") or [],
                              str(f.get("tokenizer.ggml.pre", "default")))
        add_bos_default = False
    elif kind == "llama":
        scores = f.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        tok = _sentencepiece_bpe(tokens, scores, f.get("tokenizer.ggml.unknown_token_id"),
                                 bool(f.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos_default = True  # llama.cpp's default for SentencePiece vocabularies
    else:
        raise ModelConfigError(f.path, f"GGUF tokenizer {kind!r} is not supported (gpt2, "
                                       "llama)")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == _USER_DEFINED])
    eos = [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    bos = f.get("tokenizer.ggml.bos_token_id")
    return GGUFTokenizer(tok, tuple(dict.fromkeys(int(i) for i in eos if i is not None)),
                         None if bos is None else int(bos),
                         bool(f.get("tokenizer.ggml.add_bos_token", add_bos_default)))


def chat_template(f) -> tuple[str | None, dict[str, str]]:
    """`tokenizer.chat_template` of GGUF file `f` and the special-token strings it may
    print (bos_token, eos_token, unk_token, pad_token)."""
    tokens = f.get("tokenizer.ggml.tokens") or []
    specials = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"),
                      ("pad_token", "padding")):
        i = f.get(f"tokenizer.ggml.{key}_token_id")
        if i is not None and 0 <= int(i) < len(tokens):
            specials[name] = tokens[int(i)]
    source = f.get("tokenizer.chat_template")
    return (source if isinstance(source, str) else None), specials
