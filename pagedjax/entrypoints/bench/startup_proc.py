"""Child processes for `pagedjax bench startup`: each in its own session, its stdout and stderr
read by threads and stamped with the seconds since its start, counted compilations from its
JAX_LOG_COMPILES lines, and every one of them killed on exit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

_live: list[subprocess.Popen] = []  # processes started here and not reaped yet


def pagedjax_cmd() -> list[str]:
    """The `pagedjax` command a user runs (this interpreter's CLI module where none is on PATH)."""
    exe = shutil.which("pagedjax")
    return [exe] if exe else [sys.executable, "-m", "pagedjax.entrypoints.cli"]


def child_env(cache_dir: str, min_compile_secs: float | None) -> dict:
    """This environment with JAX's compilation cache in `cache_dir` (pagedjax's own cache
    setting dropped) and compilations logged."""
    env = dict(os.environ)
    env.pop("PAGEDJAX_COMPILE_CACHE", None)
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    if min_compile_secs is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(min_compile_secs)
    return env


class Proc:
    """A child process in its own session, its stdout and stderr read by threads, each
    stdout chunk stamped with the seconds since the start."""

    def __init__(self, cmd: list[str], env: dict):
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
        _live.append(self.p)
        self.chunks: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read_out, daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for r in self.readers:
            r.start()

    def _read_out(self) -> None:
        fd = self.p.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self.chunks.append((time.perf_counter() - self.t0, chunk.decode(errors="replace")))

    def _read_err(self) -> None:
        for line in iter(self.p.stderr.readline, b""):
            self.err.append((time.perf_counter() - self.t0, line.decode(errors="replace")))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=max(0.0, timeout - self.elapsed()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"still running after {timeout:.0f} s") from None
        self._reap()
        return rc

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGINT, then SIGKILL after `grace` seconds."""
        if self.p.poll() is None:
            _signal(self.p, signal.SIGINT)
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()
        return self.p.returncode

    def kill(self) -> None:
        _signal(self.p, signal.SIGKILL)
        self.p.wait()
        self._reap()

    def _reap(self) -> None:
        for r in self.readers:
            r.join(timeout=5)
        if self.p in _live:
            _live.remove(self.p)

    def stdout(self) -> str:
        return "".join(c for _, c in self.chunks)

    def stderr_tail(self, n: int = 15) -> str:
        lines = [line for _, line in self.err if "XLA compilation" not in line and "compilation cache" not in line
                 and "Compiling " not in line and "Finished " not in line]
        return "".join(lines[-n:])

    def compile_counts(self, until: float | None = None) -> dict:
        """From the JAX_LOG_COMPILES lines on stderr up to `until` seconds after the start
        (default: all): every backend compile request logs 'Finished XLA compilation'
        (persistent-cache hits included); hits also log 'Persistent compilation cache hit'.
        Also the same counts over the whole life of the process."""
        def count(lines: list[str]) -> tuple[int, int]:
            finished = sum("Finished XLA compilation" in line for line in lines)
            hits = sum("Persistent compilation cache hit" in line for line in lines)
            return finished - hits, hits

        compiled, hits = count([line for t, line in self.err if until is None or t <= until])
        all_compiled, all_hits = count([line for _, line in self.err])
        return {"compiled": compiled, "cache_hits": hits, "process_compiled": all_compiled,
                "process_cache_hits": all_hits}


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # its own session: the group holds only what it started
    except (ProcessLookupError, PermissionError):
        pass


def cleanup(*_args) -> None:
    for p in list(_live):
        _signal(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _live.remove(p)


def cache_entries(cache_dir: str) -> int:
    return sum(1 for f in Path(cache_dir).rglob("*") if f.is_file() and not f.name.endswith("-atime"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    """(status, body) of a GET, or of a POST of `body` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
