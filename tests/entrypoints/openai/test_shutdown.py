"""`serve()` in a subprocess: SIGTERM/SIGINT stop admitting, finish in-flight work, exit 0."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from .conftest import MODEL, metric, wait_for

SCRIPT = Path(__file__).parent / "serve_fake.py"
ROOT = Path(__file__).parents[2]


def _start(*args: str) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(port), *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.TransportError:
            return False

    if not wait_for(lambda: up() or proc.poll() is not None, timeout=30) or proc.poll() is not None:
        proc.kill()
        pytest.fail(f"server did not start: {proc.communicate()[0].decode()[-2000:]}")
    return proc, url


def test_sigterm_finishes_in_flight_stream_and_exits_0():
    proc, url = _start()
    lines: list[str] = []
    body = {"model": MODEL, "prompt": "w1", "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}

    def stream():
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(line for line in r.iter_lines() if line)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert wait_for(lambda: metric(url, "pagedjax:num_requests_running") == 1)
        proc.send_signal(signal.SIGTERM)
        t.join(30)
        assert proc.wait(30) == 0, proc.communicate()[0].decode()[-2000:]
    finally:
        proc.kill()
    assert lines[-1] == "data: [DONE]"
    last = json.loads(lines[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length"
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/health", timeout=1)


def test_sigint_exits_0():
    proc, url = _start()
    try:
        time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.communicate()[0].decode()[-2000:]
    finally:
        proc.kill()


def test_engine_failure_exits_1():
    """A step that raises may have poisoned the device state: the request fails with 503 and
    the server exits non-zero so that a supervisor restarts it."""
    proc, url = _start("fail")
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "w1", "max_tokens": 3}, timeout=10)
    assert r.status_code == 503 and "injected" not in r.text
    try:
        assert proc.wait(timeout=20) == 1
    finally:
        proc.kill()
    assert "the engine failed" in proc.communicate()[0].decode()
