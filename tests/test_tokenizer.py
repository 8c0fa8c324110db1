"""Tokenizer loading, special ids, errors and incremental detokenization."""

import json
import random

import pytest
import tokenizers
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from arcjax.engine.tokenizer import (
    IncrementalDetokenizer,
    StreamingDetokenizer,
    Tokenizer,
    TokenizerFileError,
    TokenizerFileNotFoundError,
)

SPECIALS = ["<|endoftext|>", "<|bos|>"]
TEXT = (
    "def greet(name):\n    return f'héllo {name} 👋🏽 — 你好，世界 🌍'\n"
    "Ünïcödé: ñ ç ø å ß € ¥ → ≠ ∞ 😀😃😄 日本語のテキスト 한국어 텍스트 🚀✨\n"
    "plain ascii text with some words, repeated words, words words.\n"
) * 20


def _train(vocab_size: int = 300) -> tokenizers.Tokenizer:
    """A small byte-level BPE: few merges, so multi-byte characters span several tokens."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    return tok


@pytest.fixture(scope="module")
def backend() -> tokenizers.Tokenizer:
    return _train()


def _write_dir(path, backend, *, gen=None, tcfg=None):
    backend.save(str(path / "tokenizer.json"))
    if gen is not None:
        (path / "generation_config.json").write_text(json.dumps(gen))
    if tcfg is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tcfg))
    return path


@pytest.fixture(scope="module")
def tok(backend, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(_write_dir(tmp_path_factory.mktemp("tok"), backend,
                                         tcfg={"eos_token": "<|endoftext|>"}))


def test_multibyte_characters_span_tokens(tok):
    # The premise of the streaming tests: some token is not a whole character.
    pieces = [tok.decode([i]) for i in tok.encode("👋🏽 你好 😀")]
    assert any("\ufffd" in p for p in pieces)


def test_round_trip_and_vocab(tok, backend):
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.vocab_size == backend.get_vocab_size(with_added_tokens=True)


def test_eos_bos_from_generation_config(tmp_path, backend):
    d = _write_dir(tmp_path, backend, gen={"eos_token_id": [0, 1], "bos_token_id": 1})
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (0, 1)
    assert t.bos_token_id == 1
    assert t.encode("hi")[0] != 1  # no add_bos_token: nothing prepended


def test_eos_int_and_tokenizer_config_strings_and_dicts(tmp_path, backend):
    d = _write_dir(tmp_path, backend, gen={"eos_token_id": 0},
                   tcfg={"eos_token": {"content": "<|bos|>", "special": True},
                         "bos_token": "<|bos|>", "add_bos_token": True})
    t = Tokenizer.from_dir(d)
    assert t.eos_token_ids == (0, 1)  # generation_config first, then tokenizer_config, deduped
    assert t.bos_token_id == 1
    ids = t.encode("hi")
    assert ids[0] == 1 and ids[1] != 1
    assert t.encode("hi", add_special_tokens=False) == ids[1:]
    assert t.decode(ids) == "hi"
    assert t.decode(ids, skip_special_tokens=False) == "<|bos|>hi"


def test_bos_not_doubled_when_post_processor_adds_it(tmp_path):
    backend = _train()
    backend.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    d = _write_dir(tmp_path, backend, tcfg={"bos_token": "<|bos|>", "add_bos_token": True})
    ids = Tokenizer.from_dir(d).encode("hi")
    assert ids[0] == 1 and ids[1] != 1


def test_no_config_files_means_no_special_ids(tmp_path, backend):
    t = Tokenizer.from_dir(_write_dir(tmp_path, backend))
    assert t.eos_token_ids == () and t.bos_token_id is None


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerFileNotFoundError, match="tokenizer.json") as e:
        Tokenizer.from_dir(tmp_path)
    assert isinstance(e.value, FileNotFoundError) and isinstance(e.value, ValueError)


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"model": {"type": "Nope"}}'])
def test_corrupt_tokenizer_json(tmp_path, content):
    (tmp_path / "tokenizer.json").write_text(content)
    with pytest.raises(TokenizerFileError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_generation_config_and_unknown_token(tmp_path, backend):
    d = _write_dir(tmp_path, backend, gen={"eos_token_id": "x"})
    with pytest.raises(TokenizerFileError, match="generation_config.json"):
        Tokenizer.from_dir(d)
    (tmp_path / "generation_config.json").unlink()
    for bad in (json.dumps({"eos_token": "<nope>"}), "{oops"):
        (tmp_path / "tokenizer_config.json").write_text(bad)
        with pytest.raises(TokenizerFileError, match="tokenizer_config.json"):
            Tokenizer.from_dir(d)


@pytest.fixture(scope="module", params=[IncrementalDetokenizer, StreamingDetokenizer],
                ids=["window", "decode_stream"])
def detok_cls(request):
    """Both detokenizers keep the same guarantees (every streaming test runs both)."""
    return request.param


def _stream(cls, tok, ids, prompt_ids=()):
    detok = cls(tok, prompt_ids)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert detok.text == "".join(deltas) + tail
    return deltas, tail


def test_stream_of_encoded_text_never_emits_partial_characters(detok_cls, tok):
    ids = tok.encode(TEXT[:400], add_special_tokens=False)
    deltas, tail = _stream(detok_cls, tok, ids)
    assert "".join(deltas) == TEXT[:400] and tail == ""
    assert all("\ufffd" not in d for d in deltas)
    assert any(d == "" for d in deltas)  # some tokens were held back mid-character


def test_stream_emits_character_once_complete(detok_cls, tok):
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    detok = detok_cls(tok)
    assert [detok.add(i) for i in ids] == [""] * (len(ids) - 1) + ["😀"]


def test_flush_emits_unfinished_character(detok_cls, tok):
    ids = tok.encode("a😀", add_special_tokens=False)
    deltas, tail = _stream(detok_cls, tok, ids[:-1])
    assert "".join(deltas) == "a" and tail == tok.decode(ids[:-1])[1:] and "\ufffd" in tail


@given(st.lists(st.integers(0, 299), max_size=40))
def test_deltas_concatenate_to_decode_for_random_ids(detok_cls, tok, ids):
    # Random ids include special tokens (skipped) and invalid byte sequences.
    ids = [i % tok.vocab_size for i in ids]
    deltas, tail = _stream(detok_cls, tok, ids)
    assert "".join(deltas) + tail == tok.decode(ids)


def test_deltas_with_prompt_context(detok_cls, tok):
    rng = random.Random(0)
    prompt = tok.encode("你好 world", add_special_tokens=False)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 30))]
        deltas, tail = _stream(detok_cls, tok, ids, prompt)
        full = tok.decode(prompt + ids)
        assert "".join(deltas) + tail == full[len(tok.decode(prompt)):]


def test_a_prompt_ending_mid_character_keeps_its_bytes_out_of_the_output(detok_cls, tok):
    # The prompt's unfinished character is the prompt's text (decoded as U+FFFD there).
    prompt = tok.encode("a😀", add_special_tokens=False)[:-1]
    ids = tok.encode("kowp-01", add_special_tokens=False)
    deltas, tail = _stream(detok_cls, tok, ids, prompt)
    assert "".join(deltas) + tail == "kowp-01" == tok.decode(prompt + ids)[len(tok.decode(prompt)):]


def test_random_multibyte_text_streams_exactly(detok_cls, tok):
    rng = random.Random(1)
    alphabet = "ab 😀你好€ñ👋🏽\n한"
    for _ in range(50):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 40)))
        deltas, tail = _stream(detok_cls, tok, tok.encode(text, add_special_tokens=False))
        assert "".join(deltas) == text and tail == ""
        assert all("\ufffd" not in d for d in deltas)


def test_snapshot_restore_rolls_text_back(tok, detok_cls):
    ids = tok.encode("ab 😀 cd", add_special_tokens=False)
    detok = detok_cls(tok, tok.encode("x", add_special_tokens=False))
    for t in ids[:3]:
        detok.add(t)
    snap, text = detok.snapshot(), detok.text
    rest = [detok.add(t) for t in ids[3:]]
    detok.restore(snap)
    assert detok.text == text and [detok.add(t) for t in ids[3:]] == rest
    assert detok.text + detok.flush() == "ab 😀 cd"
