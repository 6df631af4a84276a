"""--generation-config auto|vllm|DIR: which generation_config.json sampling fields become the
defaults, and `pagedjax generate`'s flags taking them where the user gave none (the engine
stubbed: no model loads)."""
from __future__ import annotations

import json
import logging

import pytest

from pagedjax.engine.generation_config import sampling_defaults
from pagedjax.entrypoints.cli import main

FILE = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": None,
        "repetition_penalty": 1.05, "max_new_tokens": 300}
EXPECTED = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 300}


def folder(path, config: dict):
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def test_auto_reads_the_models_sampling_fields(tmp_path, caplog):
    model = folder(tmp_path / "model", FILE)
    with caplog.at_level(logging.WARNING, "pagedjax.engine.generation_config"):
        assert sampling_defaults("auto", model) == EXPECTED
    assert "Default sampling parameters have been overridden by the model's Hugging Face generation config" \
        in caplog.text and "generation_config='vllm'" in caplog.text


def test_vllm_a_folder_and_a_model_without_any(tmp_path, caplog):
    model = folder(tmp_path / "model", FILE)
    assert sampling_defaults("vllm", model) == {}
    other = folder(tmp_path / "other", {"temperature": 0.3})
    assert sampling_defaults(str(other), model) == {"temperature": 0.3}
    caplog.clear()
    with caplog.at_level(logging.WARNING, "pagedjax.engine.generation_config"):
        assert sampling_defaults("auto", folder(tmp_path / "plain", {"bos_token_id": 1, "eos_token_id": 2})) == {}
        assert sampling_defaults("auto", tmp_path / "no-file") == {}
    assert not caplog.records  # nothing overridden: nothing logged


def test_a_value_the_engine_cannot_use_names_the_file(tmp_path):
    model = folder(tmp_path / "model", {"top_p": 1.5})
    with pytest.raises(ValueError, match=r"generation_config\.json \(generation_config='auto'\) has a sampling "
                                         r"default the engine cannot use: top_p must be in \(0, 1\]"):
        sampling_defaults("auto", model)


class StubEngine:
    """Stands in for LLMEngine in `pagedjax generate`: the model's defaults, requests recorded."""

    added: list = []
    defaults: dict = {}

    def __init__(self, model, stream_text=True, **kwargs):
        from entrypoints.openai.fake_engine import make_tokenizer

        self.tokenizer = make_tokenizer()
        self.sampling_defaults = dict(StubEngine.defaults)

    def add_request(self, request_id, prompt, params):
        StubEngine.added.append((prompt, params))

    def has_unfinished_requests(self) -> bool:
        return False


@pytest.fixture
def stub(monkeypatch):
    import pagedjax.engine.llm_engine

    monkeypatch.setattr(pagedjax.engine.llm_engine, "LLMEngine", StubEngine)
    StubEngine.added, StubEngine.defaults = [], dict(EXPECTED)
    return StubEngine


def test_generate_flags_not_given_take_the_models_defaults(stub, capsys):
    assert main(["generate", "w1", "--temperature", "0.2", "--top-k", "0"]) == 0
    _, params = stub.added[0]
    assert (params.temperature, params.top_k) == (0.2, 0)  # given
    assert (params.top_p, params.repetition_penalty, params.max_tokens) == (0.95, 1.05, 300)  # the model's
    stub.defaults = {}
    assert main(["generate", "w1"]) == 0
    _, params = stub.added[1]
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.0, 1.0, 0, 128)  # generate's


def test_generate_chat_renders_with_the_shared_helper(stub, capsys):
    assert main(["generate", "w1 w2", "--chat", "--max-tokens", "2"]) == 0
    prompt, _ = stub.added[0]
    tok = StubEngine(None).tokenizer
    assert prompt == tok.apply_chat_template([{"role": "user", "content": "w1 w2"}], add_generation_prompt=True,
                                             tokenize=True, return_dict=False)


def test_generation_config_flag_is_checked(capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--generation-config", str(tmp_path / "nowhere")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "error: --generation-config must be 'auto', 'vllm' or a folder with a generation_config.json" in err
