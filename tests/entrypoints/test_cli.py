"""`pagedjax generate` as a user runs it."""
import pytest

from pagedjax.entrypoints.cli import main


def test_generate_streams_an_answer(default_model_path, capsys):
    rc = main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "8", "--max-model-len", "128"])
    assert rc == 0
    assert "Paris" in capsys.readouterr().out


def test_generate_rejects_bad_arguments_with_a_clear_message(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:  # a usage error, before anything loads
        main(["generate", "hi", "--max-tokens", "0"])
    assert e.value.code == 2
    assert "--max-tokens may be 0 only with prompt_logprobs" in capsys.readouterr().err
    assert main(["generate", "hi", "--model", "/nonexistent/dir"]) == 2
    assert "pagedjax generate: error: model directory '/nonexistent/dir' does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["generate", "hi", "--max-num-seqs", "0"])  # not taken for "unset"
    assert "--max-num-seqs must be a positive integer, got 0" in capsys.readouterr().err


def test_speculative_config_flag_is_checked(capsys):
    import pytest

    with pytest.raises(SystemExit):
        main(["generate", "hi", "--speculative-config", "{not json"])
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--speculative-config", '{"method": "medusa", "num_speculative_tokens": 2}'])
    assert e.value.code == 2
    assert "error: --speculative-config: method 'medusa' is not supported" in capsys.readouterr().err


def test_transformers_notices_that_do_not_concern_users_are_dropped(default_model_path):
    """transformers without torch says on import that its models are unavailable, and on every
    start that it ignores a BPE tokenizer's clean_up_tokenization_spaces; pagedjax uses only its
    tokenizers and configs, so those two lines go (checked for real: torch hidden from a fresh
    process that imports pagedjax, then transformers, and loads a BPE tokenizer). Every other
    transformers warning stays."""
    import subprocess
    import sys

    code = r"""
import importlib.util, logging, sys
_find = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name.split(".")[0] == "torch" else _find(name, *a)
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "torch":
            raise ModuleNotFoundError("No module named 'torch'", name=name)
sys.meta_path.insert(0, _NoTorch())
import pagedjax, transformers
from transformers import PreTrainedTokenizerFast
assert not transformers.is_torch_available()
tok = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
tok.decode(tok.encode("Hello , world"))
logging.getLogger("transformers").warning("Some other warning")
"""
    tokenizer_dir = str(default_model_path)  # SmolLM2's byte-level BPE tokenizer
    out = subprocess.run([sys.executable, "-c", code, tokenizer_dir], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr and "clean_up_tokenization_spaces" not in out.stderr
    assert "Some other warning" in out.stderr
    # without pagedjax's filters the same process prints both (so the test would see them)
    bare = subprocess.run([sys.executable, "-c", code.replace("import pagedjax, transformers", "import transformers"),
                           tokenizer_dir], capture_output=True, text=True, timeout=120)
    assert "PyTorch was not found" in bare.stderr and "Ignoring clean_up_tokenization_spaces" in bare.stderr


def test_every_engine_option_is_a_flag_with_its_default_shown(capsys):
    """The engine flags are generated from EngineConfig: one per field, defaults in --help,
    and the parsed flags are EngineConfig's keyword arguments."""
    import argparse
    from dataclasses import fields

    import pytest

    from pagedjax.config import EngineConfig
    from pagedjax.entrypoints.cli_args import add_engine_arguments, engine_kwargs

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
    assert list(params) == [f.name for f in fields(EngineConfig)] + ["warmup", "weights"]
    assert all(params[f.name].default == f.default for f in fields(EngineConfig))


# ---- issue 34: --version, defaults in every --help, errors naming the flag, prompt order ----------


def test_version(capsys, monkeypatch):
    import importlib.metadata

    import pytest

    import pagedjax

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"pagedjax {importlib.metadata.version('pagedjax')}\n"

    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert pagedjax.__version__ == "unknown"  # a source tree never installed


def _subcommand_parsers():
    """(name, parser) of `pagedjax` and every subcommand, nested ones included."""
    import argparse

    from pagedjax.entrypoints.cli import build_parser

    todo, found = [("pagedjax", build_parser())], []
    while todo:
        name, parser = todo.pop()
        found.append((name, parser))
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo += [(f"{name} {sub}", p) for sub, p in action.choices.items()]
    return found


def test_every_option_of_every_subcommand_shows_its_default():
    """Every flag's help (but --help and --version) says its default, switches included;
    walks the real parsers, so a flag added later without one fails here."""
    import argparse

    from pagedjax.entrypoints.cli_args import HelpFormatter

    parsers = _subcommand_parsers()
    assert {"pagedjax generate", "pagedjax serve", "pagedjax bench compare"} <= {n for n, _ in parsers}
    missing = []
    for name, parser in parsers:
        formatter = parser._get_formatter()
        assert isinstance(formatter, HelpFormatter), name
        for action in parser._actions:
            if (not action.option_strings or action.help is argparse.SUPPRESS
                    or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
                continue
            text = " ".join(formatter._format_action(action).split())
            if "(default:" not in text:
                missing.append(f"{name} {action.option_strings[-1]}: {text}")
    assert not missing, "\n".join(missing)


def test_generate_help_shows_the_sampling_defaults(capsys):
    import re

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    text = text[text.index("options:"):]  # past the usage lines
    for flag, default in [("--max-tokens MAX_TOKENS", "128"), ("--temperature TEMPERATURE", "0.0"),
                          ("--top-p TOP_P", "1.0"), ("--top-k TOP_K", "0"), ("--min-p MIN_P", "0.0"),
                          ("--ignore-eos", "off"), ("--chat", "off"), ("--block-size BLOCK_SIZE", "16"),
                          ("--enable-prefix-caching, --no-enable-prefix-caching", "on")]:
        after = text[text.index(flag + " ") + len(flag):]
        help_text, _, rest = after.partition("(default: ")
        assert not re.search(r" --?[a-z]", help_text), (flag, help_text)  # the flag's own, not the next flag's
        assert rest.startswith(default + ")"), (flag, after[:200])


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens must be an integer in [0, 2147483647], got -1"),
    (["generate", "hi", "--temperature", "-1"], "--temperature must be a finite number >= 0, got -1.0"),
    (["generate", "hi", "--top-p", "2"], "--top-p must be in (0, 1], got 2.0"),
    (["generate", "hi", "--min-p", "1.5"], "--min-p must be in [0, 1], got 1.5"),
    (["generate", "hi", "--stop", ""], "--stop must be a non-empty string"),
    (["generate", "hi", "--block-size", "0"], "--block-size must be a positive integer, got 0"),
    (["generate", "hi", "--block-size", "24"], "--block-size must be a power of two, got 24"),
    (["generate", "hi", "--kv-cache-memory-gb", "-1"], "--kv-cache-memory-gb must be > 0, got -1.0"),
    (["generate", "hi", "-tp", "0"], "--tensor-parallel-size must be a positive integer, got 0"),
    (["generate", "hi", "--num-processes", "2"], "--num-processes > 1 needs --coordinator-address"),
    (["serve", "--block-size", "0"], "--block-size must be a positive integer, got 0"),
    (["serve", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens must be at least 16, got 8"),
    (["serve", "--num-blocks", "-3"], "--num-blocks must be a positive integer, got -3"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_the_flag(argv, message, capsys):
    """Checked right after parsing (nothing loads): exit code 2, argparse's usage and
    "error:" line, the flag's name rather than the Python field's, no traceback."""
    import re

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: pagedjax " + argv[0])
    assert f"pagedjax {argv[0]}: error: {message}" in err
    field = message.split()[0].lstrip("-").replace("-", "_")  # the Python name, never bare in the error line
    assert not re.search(rf"(?<![-\w]){field}(?!\w)", err.splitlines()[-1]) and "Traceback" not in err


def test_flag_names_rewrites_whole_names_only():
    from pagedjax.entrypoints.cli_args import engine_flags, flag_names

    names = engine_flags()
    assert (flag_names("kv_cache_dtype, kv_cache and kv_cache_memory_gb; not my_kv_cache or kv_caches", names)
            == "--kv-cache-dtype, --kv-cache and --kv-cache-memory-gb; not my_kv_cache or kv_caches")
    assert flag_names("max_model_len=300 exceeds", names) == "--max-model-len=300 exceeds"


class _ScriptedEngine:
    """Finishes its requests in the order given, one a step (stands in for LLMEngine)."""

    def __init__(self, texts: dict[str, str], finish_order: list[str]):
        self.texts, self.order = texts, list(finish_order)

    def has_unfinished_requests(self) -> bool:
        return bool(self.order)

    def step(self):
        from types import SimpleNamespace

        rid = self.order.pop(0)
        running = [SimpleNamespace(request_id=r, finished=False, outputs=[SimpleNamespace(text="...")])
                   for r in self.order]
        done = SimpleNamespace(request_id=rid, finished=True, outputs=[SimpleNamespace(text=self.texts[rid])])
        return running + [done]


def test_generate_prints_outputs_in_prompt_order(capsys):
    """Several prompts: each prompt's text in prompt order, whatever order they end in, each as
    soon as those before it are out."""
    from pagedjax.entrypoints.cli import _stream

    texts = {str(i): f"answer {i}" for i in range(4)}
    _stream(_ScriptedEngine(texts, ["2", "0", "3", "1"]), 4)
    assert capsys.readouterr().out == "".join(f"--- [{i}] ---\nanswer {i}\n" for i in range(4))


@pytest.fixture(scope="module")
def tiny_model_dir(tiny_checkpoints, tmp_path_factory):
    """The tiny random Llama with a real tokenizer whose model_max_length (16) is below the
    engine's max_model_len, as an HF checkpoint directory."""
    import shutil

    from tiny_models import make_tokenizer

    src, _ = tiny_checkpoints("llama")
    path = tmp_path_factory.mktemp("tiny-llama-cli")
    shutil.copytree(src, path, dirs_exist_ok=True)
    tokenizer = make_tokenizer(384)
    tokenizer.model_max_length = 16
    tokenizer.save_pretrained(str(path))
    return path


TINY_FLAGS = ["--max-model-len", "64", "--block-size", "8", "--num-blocks", "32", "--max-num-batched-tokens", "32",
              "--dtype", "float32", "--no-async-scheduling"]


@pytest.fixture
def transformers_warnings():
    """The records transformers logs (its loggers do not propagate to caplog's)."""
    import logging

    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


def test_generate_several_prompts_end_to_end_in_prompt_order(tiny_model_dir, capsys, transformers_warnings):
    """On a tiny model: one block per prompt, in prompt order; a prompt longer than the
    tokenizer's own limit (16 tokens) but within --max-model-len runs without transformers'
    "Token indices sequence length" warning."""
    prompts = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello", '{"id": 1, "value": null}']
    assert main(["generate", *prompts, "--model", str(tiny_model_dir), "--max-tokens", "4", "--ignore-eos",
                 *TINY_FLAGS]) == 0
    captured = capsys.readouterr()
    headers = [line for line in captured.out.splitlines() if line.startswith("--- [")]
    assert headers == ["--- [0] ---", "--- [1] ---", "--- [2] ---"]
    assert "Token indices sequence length" not in captured.err
    assert not [r for r in transformers_warnings if "Token indices" in r.getMessage()]


def test_generate_too_long_prompt_is_the_engines_error_only(tiny_model_dir, capsys, transformers_warnings):
    assert main(["generate", "The quick brown fox jumps over the lazy dog. " * 10, "--model", str(tiny_model_dir),
                 *TINY_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "pagedjax generate: error: prompt has" in err and "--max-model-len is 64" in err
    assert "Token indices sequence length" not in err
    assert not [r for r in transformers_warnings if "Token indices" in r.getMessage()]


def test_serve_banner_of_a_real_engine(tiny_model_dir):
    """The banner reads the dtype and KV pool size off a real LLMEngine."""
    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.entrypoints.openai.api_server import engine_banner

    engine = LLMEngine(str(tiny_model_dir), max_model_len=64, block_size=8, num_blocks=32, dtype="float32")
    tokens = 32 * 8
    gib = tokens * engine.kv_bytes_per_token / 2**30
    assert engine_banner(engine) == (f"{tiny_model_dir.name} (dtype float32, KV float32, KV pool {tokens:,} tokens / "
                                     f"{gib:.2f} GiB)")
    quantized = LLMEngine(str(tiny_model_dir), max_model_len=64, block_size=8, num_blocks=32, dtype="float32",
                          quantization="int8", kv_cache_dtype="int8")
    assert "(dtype float32, weights int8, KV int8, KV pool 256 tokens" in engine_banner(quantized)
    assert engine_banner(engine, "tiny").startswith(f"{tiny_model_dir.name} as 'tiny' (dtype float32")


def test_generate_chat_without_a_chat_template_says_so(tiny_model_dir, capsys):
    assert main(["generate", "Hello", "--chat", "--model", str(tiny_model_dir), "--max-tokens", "2",
                 *TINY_FLAGS]) == 2
    err = capsys.readouterr().err
    assert "this model has no chat template; leave out --chat" in err and "Traceback" not in err


def test_moe_options_on_a_model_without_experts_are_refused(tiny_model_dir, capsys):
    assert main(["generate", "Hello", "--moe-impl", "dense", "--model", str(tiny_model_dir), *TINY_FLAGS]) == 2
    assert "--moe-impl='dense' applies to mixture-of-experts models" in capsys.readouterr().err
    assert main(["generate", "Hello", "-ep", "--model", str(tiny_model_dir), *TINY_FLAGS]) == 2
    assert "--expert-parallel needs a mixture-of-experts model" in capsys.readouterr().err
