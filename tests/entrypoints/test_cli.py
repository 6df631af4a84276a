"""`pagedjax generate` as a user runs it."""
from pagedjax.entrypoints.cli import main


def test_generate_streams_an_answer(default_model_path, capsys):
    rc = main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "8", "--max-model-len", "128"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_rejects_bad_arguments_with_a_clear_message(capsys):
    assert main(["generate", "hi", "--max-tokens", "0"]) == 2
    assert "max_tokens may be 0 only with prompt_logprobs" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "hi", "--max-num-seqs", "0"]) == 2  # not taken for "unset"
    assert "max_num_seqs must be a positive integer, got 0" in capsys.readouterr().err


def test_speculative_config_flag_is_checked(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--speculative-config", "{not json"])
    assert "not valid JSON" in capsys.readouterr().err
    assert main(["generate", "hi", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}']) == 2
    assert "not supported" in capsys.readouterr().err


def test_cli_silences_transformers_torch_advice(monkeypatch):
    """transformers without torch advises on import that its models are unavailable; the CLI,
    which uses only its tokenizers, turns that advice off (unless the user set the variable)."""
    import os

    import pytest

    monkeypatch.delenv("TRANSFORMERS_NO_ADVISORY_WARNINGS", raising=False)
    with pytest.raises(SystemExit):
        main(["--help"])
    assert os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] == "1"


def test_every_engine_option_is_a_flag_with_its_default_shown(capsys):
    """The engine flags are generated from EngineConfig: one per field, defaults in --help,
    and the parsed flags are EngineConfig's keyword arguments."""
    import argparse
    from dataclasses import fields

    import pytest

    from pagedjax.config import EngineConfig
    from pagedjax.entrypoints.cli import add_engine_arguments, engine_kwargs

    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for f in fields(EngineConfig):
        if f.name != "model":
            assert "--" + f.name.replace("_", "-") in text, f.name
    assert "tokens per KV block (a power of two) (default: 16)" in text
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    kw = engine_kwargs(parser.parse_args(["--block-size", "32", "--no-prefix-caching", "--no-async-scheduling",
                                          "-tp", "2", "--scan-layers", "--kv-cache-memory-gb", "1.5",
                                          "--attention-impl", "reference",
                                          "--speculative-config", '{"num_speculative_tokens": 2}']))
    assert set(kw) == {f.name for f in fields(EngineConfig)} - {"model"}
    assert (kw["block_size"], kw["enable_prefix_caching"], kw["async_scheduling"], kw["tensor_parallel_size"],
            kw["scan_layers"], kw["kv_cache_memory_gb"], kw["attention_impl"]) == (32, False, False, 2, True, 1.5,
                                                                                   "reference")
    assert EngineConfig(**kw).speculative_config.num_speculative_tokens == 2
    defaults = engine_kwargs(parser.parse_args([]))
    assert defaults == {f.name: f.default for f in fields(EngineConfig) if f.name != "model"}


def test_llm_signature_lists_every_engine_option():
    import inspect
    from dataclasses import fields

    from pagedjax import LLM
    from pagedjax.config import EngineConfig

    params = inspect.signature(LLM).parameters
    assert list(params) == [f.name for f in fields(EngineConfig)] + ["warmup"]
    assert all(params[f.name].default == f.default for f in fields(EngineConfig))
