"""Fixtures: a real uvicorn server on a free loopback port, in a thread, over a FakeEngine."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import uvicorn

from pagedjax.entrypoints.openai import AsyncEngine, build_app

from .fake_engine import FakeEngine

MODEL = "fake-model"


@contextmanager
def running_server(engine: FakeEngine | None = None, *, api_key: str | None = None,
                   max_pending_requests: int = 1024, **app_kwargs):
    """Serve `engine` on 127.0.0.1:<free port> until the block exits (app_kwargs go to build_app)."""
    engine = engine or FakeEngine()
    async_engine = AsyncEngine(engine, max_pending_requests=max_pending_requests)
    app = build_app(async_engine, MODEL, api_key=api_key, **app_kwargs)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    url = f"http://127.0.0.1:{port}"
    try:
        yield SimpleNamespace(url=url, engine=engine, async_engine=async_engine, server=server)
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


def openai_client(url: str, api_key: str = "unused", **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=20, **kw)


def metric(url: str, name: str) -> float:
    """The value of an unlabelled metric on /metrics."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_for(cond, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.fixture(scope="session")
def server():
    with running_server(FakeEngine(step_delay=0.001)) as s:
        yield s


@pytest.fixture
def slow_server():
    """A server whose engine takes 10 ms a step (room to disconnect mid-request)."""
    with running_server(FakeEngine(step_delay=0.01)) as s:
        yield s


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai_client(server.url)


@pytest.fixture
def aclient(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=30)
