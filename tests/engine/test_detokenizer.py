"""Incremental detokenization equals one-shot decoding, never emitting half characters."""
import pytest

from pagedjax.engine.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello, world! How are you?", "naïve café — 日本語のテキスト", "emoji: 🤖🚀👍🏽 done",
         "def f(x):\n    return x ** 2\n", "  leading spaces and\ttabs"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode(default_tokenizer, text):
    tok = default_tokenizer
    prompt = tok.encode("Say something:")
    ids = tok.encode(text)
    d = IncrementalDetokenizer(tok, prompt)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) == d.text == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces)


def test_special_tokens_are_skipped(default_tokenizer):
    tok = default_tokenizer
    d = IncrementalDetokenizer(tok, [1])
    for t in tok.encode("hi") + [tok.eos_token_id]:
        d.add(t)
    assert d.text == "hi"
