"""Prompts encoded piece by piece (cut at the added tokens, repeated pieces cached) get
exactly the ids of encoding the whole text; tokenizers where that does not hold by
construction are encoded whole."""

from __future__ import annotations

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers, trainers

from engine.chat import _encode
from engine.chat import encode_prompt
from engine.testing import build_tiny_tokenizer

CORPUS = [
    "You are a helpful assistant. Answer with the final number after '####'.",
    "Ava has 97 apples and buys 6 more. How many apples does Ava have now?",
    "A box holds 40 pencils. Ben takes 3 of them out. How many are left?",
    "  leading spaces, trailing spaces   and\nnew\nlines\t\ttabs",
]
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|im_start|>x", "<|endoftext|>"]  # "<|im_start|>x": longest match wins


def _bpe(normalizer=None, extra=()):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tok.normalizer = normalizer
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens(list(extra))
    return tok


def _whole(tok, text):
    return tok.encode(text, add_special_tokens=False).ids


TEXTS = [
    "",
    "<|im_start|>",
    "<|im_start|><|im_end|><|im_start|>x<|im_start|>xy",
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nAva has 97 apples"
    " and buys 6 more.<|im_end|>\n<|im_start|>assistant\n",
    "no special tokens at all, just text with  double  spaces ",
    "<|im_end|>trailing text after a token",
    "<|im_start|><|im_start|>  <|im_end|>\n\n<|endoftext|>",
    "unicode: caf\u00e9 \u65e5\u672c\u8a9e \U0001f600<|im_end|>\U0001f600",
    "<|im_sta<|im_end|>rt|>",  # a broken token around a real one
]


@pytest.mark.parametrize("make", [
    lambda: _bpe(),
    lambda: _bpe(normalizers.Lowercase(), extra=[AddedToken("APPLES", normalized=True)]),
    lambda: build_tiny_tokenizer().backend_tokenizer,
])
def test_the_same_ids_as_encoding_the_whole_text(make):
    tok = make()
    for _ in range(2):  # the second pass hits the piece cache
        for text in TEXTS:
            assert encode_prompt(tok, text) == _whole(tok, text), text
    assert _encode._ENCODERS[tok][1] is not None  # the piece encoder was used


def test_tokens_that_strip_spaces_are_encoded_whole():
    tok = _bpe()
    tok.add_special_tokens([AddedToken("<sep>", lstrip=True, rstrip=True)])
    text = "a  <sep>  b<|im_end|>"
    assert encode_prompt(tok, text) == _whole(tok, text)
    assert _encode._ENCODERS[tok][1] is None


def test_a_tokenizer_changed_in_place_is_followed():
    tok = _bpe()
    text = "<|im_start|>user\nAva has 97 apples and buys 6 more.<|im_end|>"
    assert encode_prompt(tok, text) == _whole(tok, text)
    tok.enable_truncation(5)  # truncation applies to the whole text: pieces cannot be encoded alone
    assert encode_prompt(tok, text) == _whole(tok, text) and len(_whole(tok, text)) == 5
    tok.no_truncation()
    tok.add_special_tokens(["apples"])  # a new raw-text token moves the cut points
    assert encode_prompt(tok, text) == _whole(tok, text)
    assert tok.token_to_id("apples") in encode_prompt(tok, text)


def test_the_piece_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(_encode, "PIECE_CACHE_SIZE", 3)
    tok = _bpe()
    for i in range(10):
        text = f"<|im_start|>user {i}<|im_end|>system<|im_end|>"
        assert encode_prompt(tok, text) == _whole(tok, text)
    pieces = _encode._ENCODERS[tok][1]._pieces
    assert len(pieces) == 3 and "system" in pieces  # the repeated piece stays (least recently used goes)


def test_the_cache_does_not_keep_a_tokenizer_alive():
    import gc
    import weakref

    tok = _bpe()
    encode_prompt(tok, "<|im_start|>user<|im_end|>")
    ref = weakref.ref(tok)
    del tok
    gc.collect()
    assert ref() is None
