import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

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
