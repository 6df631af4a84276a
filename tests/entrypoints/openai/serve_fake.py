"""Serve a FakeEngine with the real `serve()` entry point (used by the signal tests).

Usage: python serve_fake.py PORT [fail]   (fail: the first engine step raises)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fake_engine import FakeEngine  # noqa: E402

from pagedjax.engine.async_engine import AsyncEngine  # noqa: E402
from pagedjax.entrypoints.openai.api_server import serve  # noqa: E402

if __name__ == "__main__":
    fake = FakeEngine(step_delay=0.01)
    fake.fail_next_step = sys.argv[2:] == ["fail"]
    engine = AsyncEngine(fake)
    sys.exit(serve(engine, port=int(sys.argv[1]), served_model_name="fake-model", shutdown_timeout=10,
                   log_level="warning"))
