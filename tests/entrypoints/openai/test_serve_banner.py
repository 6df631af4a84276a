"""`pagedjax serve` logs one line when it is ready: the model, its dtype, the KV pool's size
and the URL it listens on (the port actually bound)."""
import logging
import threading
import time
from types import SimpleNamespace

import jax.numpy as jnp
import uvicorn

from pagedjax.engine.async_engine import AsyncEngine
from pagedjax.entrypoints.openai import build_app
from pagedjax.entrypoints.openai.api_server import _Server, engine_banner

from .fake_engine import FakeEngine

LOGGER = "pagedjax.entrypoints.openai"


def _engine(**kw):
    return SimpleNamespace(model_name="SmolLM2-135M-Instruct", model=SimpleNamespace(dtype=jnp.dtype(jnp.bfloat16)),
                           kv_memory=lambda: SimpleNamespace(capacity=43_690), kv_bytes_per_token=24_576, **kw)


def test_banner_names_model_dtype_and_kv_pool():
    assert engine_banner(_engine()) == "SmolLM2-135M-Instruct (dtype bfloat16, KV pool 43,690 tokens / 1.00 GiB)"
    assert engine_banner(_engine(), "smol") == ("SmolLM2-135M-Instruct as 'smol' (dtype bfloat16, KV pool 43,690 "
                                                "tokens / 1.00 GiB)")
    assert engine_banner(_engine(), "SmolLM2-135M-Instruct").startswith("SmolLM2-135M-Instruct (dtype")


def test_banner_leaves_out_what_an_engine_does_not_report():
    assert engine_banner(FakeEngine()) == "fake-model"
    assert engine_banner(SimpleNamespace(), "served") == "served"


def test_server_logs_the_banner_once_with_the_port_it_bound(caplog):
    """--port 0: the URL has the port the system chose, logged once uvicorn listens."""
    engine = FakeEngine()
    async_engine = AsyncEngine(engine)
    config = uvicorn.Config(build_app(async_engine, "fake-model"), host="127.0.0.1", port=0, log_level="warning",
                            lifespan="on", timeout_graceful_shutdown=2)
    server = _Server(config, async_engine, engine_banner(engine))
    with caplog.at_level(logging.INFO, logger=LOGGER):
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 10
        try:
            while not server.started:
                assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
                time.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            assert port != 0
        finally:
            server.should_exit = True
            thread.join(10)
    banners = [r.getMessage() for r in caplog.records
               if r.name == LOGGER and r.getMessage().startswith("pagedjax serving")]
    assert banners == [f"pagedjax serving fake-model at http://127.0.0.1:{port}"]
    assert all(r.levelno == logging.INFO for r in caplog.records if r.getMessage() in banners)


def test_url_brackets_an_ipv6_host():
    server = _Server(uvicorn.Config(None, host="::1", port=8000), SimpleNamespace())
    assert server.url() == "http://[::1]:8000"
    server = _Server(uvicorn.Config(None, host="0.0.0.0", port=9000), SimpleNamespace())
    assert server.url() == "http://0.0.0.0:9000"


def test_serve_on_a_taken_port_fails_before_loading_the_model(caplog, monkeypatch):
    """The port is checked before the engine loads and compiles (seconds to minutes)."""
    import socket

    import pagedjax.engine.llm_engine as llm_engine
    from pagedjax.entrypoints.cli import main

    def never(*args, **kwargs):
        raise AssertionError("the engine must not load when the port is taken")

    monkeypatch.setattr(llm_engine, "LLMEngine", never)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with caplog.at_level(logging.ERROR, logger=LOGGER):
            assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use (another server is listening there: " \
           f"stop it or choose another --port)" in caplog.text


def test_background_warmup_logs_when_done(caplog):
    from pagedjax.worker.warmup import BackgroundWarmup

    done = []
    warmup = BackgroundWarmup()
    with caplog.at_level(logging.INFO, logger="pagedjax.worker.warmup"):
        warmup.start([(done.append, 8), (done.append, 16)])
        warmup.wait()
    assert done == [8, 16]
    assert "warm-up done: every step shape compiled (2 in the background" in caplog.text
