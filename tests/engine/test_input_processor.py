"""InputProcessor's tokenization: a prompt longer than the tokenizer's own model_max_length
is the engine's business (max_model_len), so transformers' "Token indices sequence length is
longer than the specified maximum sequence length" warning never reaches the user."""
import logging

import pytest

from pagedjax.engine.input_processor import InputProcessor
from tiny_models import make_tokenizer

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8


@pytest.fixture
def transformers_warnings():
    """The records transformers logs (its loggers do not propagate to caplog's)."""
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def _short_limit_tokenizer():
    tokenizer = make_tokenizer(384)
    tokenizer.model_max_length = 16
    return tokenizer


def _length_warnings(records):
    return [r for r in records if "Token indices sequence length" in r.getMessage()]


def test_a_bare_tokenizer_warns(transformers_warnings):
    """What the engine avoids (and proof that the fixture sees the warning)."""
    ids = _short_limit_tokenizer().encode(LONG_PROMPT)
    assert len(ids) > 16
    assert _length_warnings(transformers_warnings)


def test_a_long_prompt_tokenizes_without_the_warning(transformers_warnings):
    bare = _short_limit_tokenizer().encode(LONG_PROMPT, add_special_tokens=True)
    transformers_warnings.clear()
    inputs = InputProcessor(_short_limit_tokenizer(), 384, 384, "tiny")
    text, ids = inputs.tokenize(LONG_PROMPT)
    assert (text, ids) == (LONG_PROMPT, bare)  # the same tokens, nothing truncated
    assert not _length_warnings(transformers_warnings)


def test_no_tokenizer_and_token_id_prompts_are_untouched():
    assert InputProcessor(None, 384, 384, "tiny").tokenize([1, 2, 3]) == (None, [1, 2, 3])
