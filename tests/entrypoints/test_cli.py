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
