"""Client-side soak and overload test of a running `pagedjax serve` (issue 11).

Usage:
    python scripts/soak.py --url http://127.0.0.1:8000 [--requests 1000] [--rate 4]
        [--concurrency 48] [--seed 0] [--api-key KEY] [--server-pid PID] [--quick]
    python scripts/soak.py --launch [--server-args "--max-num-seqs 64"] ...

A full run takes about 7 minutes against the default model on a 2-core CPU; --quick
(100 requests, a 3x burst) about 2.5.

`--launch` starts `python -m pagedjax.entrypoints.cli serve` itself on a free port, waits for /health
and stops it with SIGTERM at the end (its exit code is reported and must be 0). Otherwise
the server at --url must already run; its PID (for memory and CPU) comes from --server-pid,
or is looked up from the listening port when the server runs on this machine.

What it does, in order:
  1. warm-up: a few small requests, then the "start" RSS of the server is taken;
  2. soak: --requests requests of random shapes at Poisson arrival times (--rate per
     second, at most --concurrency in flight): /v1/completions and /v1/chat/completions,
     streaming or not, n up to 8, stop strings, logprobs / top_logprobs, seeds, several
     prompts per request; streams closed after k chunks and requests cancelled mid-way;
     slow readers (a raw socket with a tiny receive buffer that reads a few bytes, stalls,
     then closes); oversized bodies (> 8 MiB, with Content-Length or chunked); malformed
     bodies (invalid JSON, wrong types, out-of-range values, huge arrays of floats as the
     prompt, deep nesting, a text/plain content type) and unknown fields;
  3. overload: --overload-factor x --max-batch requests at once; each must be served or
     refused with 429 and a Retry-After header;
  4. settle: waits until the server holds no request and every KV block is free again
     (scraped from /metrics), then takes the "end" RSS;
  5. idle: the server's CPU use (utime + stime from /proc/PID/stat) over --idle-seconds,
     with the busiest threads.

The server's RSS (VmRSS) is sampled every 0.5 s from warm-up to the end of the settle
phase. It prints requests by outcome class (completed, client-abort = a disconnect the
test made on purpose, 4xx by status, 429, 5xx (an error event inside a 200 stream counts
as "5xx in-stream"), conn-error, hung = no answer within
--hang-timeout, invalid = a 2xx whose body is wrong), p50/p99 latency of the completed
requests, KV blocks free at the end, RSS start/peak/end, idle CPU, then PASS/FAIL per
target: no 5xx, no hung request, every KV block free at the end, RSS at the end within 10%
of the start, every overload request served or 429 + Retry-After, idle CPU at most 5% of
a core, and (with --launch) exit code 0 after SIGTERM. --only KIND,... restricts the soak to some request kinds (see --help) to chase one
problem. Exit code: 0 when every target passes, 1 when one fails, 2 when the server cannot
be reached.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Awaitable, Callable
from urllib.parse import urlparse

import httpx

MIB = 1 << 20
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly hum about "
         "paged attention kernels caches tokens blocks engines servers streams of text and "
         "numbers like one two three four five six seven eight nine ten").split()
STOPS = [".", "\n", " the", "!", "?", ",", "and", "ing", "\n\n", "###"]
KINDS = ("completion", "completion-stream", "chat", "chat-stream", "abort-stream", "cancel-midway", "slow-reader",
         "oversized", "malformed", "huge-floats", "text-plain", "unknown-field")
CHAT_MODEL_HINT = [{"role": "system", "content": "You are a terse assistant."}]


# ---- results ---------------------------------------------------------------------------------


@dataclass
class Result:
    """What one request ended as. outcome: completed, client-abort, 4xx, 429, 5xx,
    conn-error, hung or invalid; expect_4xx marks requests built to be refused."""

    kind: str
    outcome: str
    status: int | None = None
    latency: float | None = None
    expect_4xx: bool = False
    retry_after: bool = False
    note: str = ""

    @property
    def label(self) -> str:
        if self.outcome not in ("4xx", "5xx"):
            return self.outcome
        return f"{self.outcome} {self.status if self.status is not None else 'in-stream'}"


def outcome_of_status(status: int) -> str:
    if status == 429:
        return "429"
    if 400 <= status < 500:
        return "4xx"
    if status >= 500:
        return "5xx"
    return "completed"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q / 100 * len(ordered) + 0.5)) - 1))]


# ---- server process: memory, CPU, launch -------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _cpu_ticks(stat_path: str) -> int:
    with open(stat_path) as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))


def thread_cpu_ticks(pid: int) -> dict[str, int]:
    """CPU ticks per thread, keyed "name (tid)"."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            out[f"{name} ({tid})"] = _cpu_ticks(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # the thread ended meanwhile
            continue
    return out


def pid_listening_on(port: int) -> int | None:
    """The local process listening on `port` (psutil when installed), else None."""
    try:
        import psutil

        for conn in psutil.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port and conn.pid:
                return conn.pid
    except Exception:
        return None
    return None


class RSSSampler:
    """Samples the server's VmRSS every `interval` seconds in the background."""

    def __init__(self, pid: int, interval: float = 0.5) -> None:
        self.pid, self.interval = pid, interval
        self.peak = 0
        self.samples = 0
        self._task: asyncio.Task | None = None

    def sample(self) -> int | None:
        rss = rss_bytes(self.pid)
        if rss is not None:
            self.peak = max(self.peak, rss)
            self.samples += 1
        return rss

    async def _loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.interval)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_server(port: int, extra_args: str) -> tuple[subprocess.Popen, str]:
    """Start `python -m pagedjax.entrypoints.cli serve` on `port`; returns the process and its log path."""
    log = tempfile.NamedTemporaryFile(prefix="pagedjax-soak-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pagedjax.entrypoints.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           *shlex.split(extra_args)]
    print(f"launching: {' '.join(cmd)} (log: {log.name})", flush=True)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log.name


def stop_server(proc: subprocess.Popen, timeout: float = 90.0) -> int | None:
    """SIGTERM, then wait; returns the exit code (None if it had to be killed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None


async def wait_healthy(client: httpx.AsyncClient, timeout: float, proc: subprocess.Popen | None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return False
        try:
            if (await client.get("/health", timeout=5)).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        await asyncio.sleep(1.0)
    return False


async def scrape_metrics(client: httpx.AsyncClient) -> dict[str, float]:
    """The unlabelled `pagedjax:*` samples of /metrics."""
    text = (await client.get("/metrics", timeout=10)).text
    out = {}
    for line in text.splitlines():
        if line.startswith("pagedjax:") and "{" not in line:
            name, _, value = line.partition(" ")
            try:
                out[name[len("pagedjax:"):]] = float(value)
            except ValueError:
                pass
    return out


# ---- request bodies ----------------------------------------------------------------------------


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def prompt_text(rng: random.Random) -> str:
    return words(rng, 100, 250) if rng.random() < 0.02 else words(rng, 3, 40)


def sampling_fields(rng: random.Random, max_tokens: int = 12) -> dict:
    """Random sampling fields shared by both endpoints (small max_tokens keeps work modest)."""
    body: dict = {"max_tokens": rng.randint(1, max_tokens), "temperature": round(rng.uniform(0.0, 1.2), 2)}
    if rng.random() < 0.2:
        body["n"] = rng.randint(2, 8)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS) if rng.random() < 0.5 else rng.sample(STOPS, rng.randint(1, 4))
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(2**31)
    if rng.random() < 0.15:
        body["top_p"] = round(rng.uniform(0.5, 1.0), 2)
    if rng.random() < 0.1:
        body["top_k"] = rng.randint(1, 50)
    if rng.random() < 0.05:
        body["ignore_eos"] = True
    return body


def completion_body(rng: random.Random, stream: bool, max_tokens: int = 12) -> tuple[dict, int]:
    """A /v1/completions body and the number of choices it asks for."""
    body = sampling_fields(rng, max_tokens)
    r = rng.random()
    if r < 0.1:
        body["prompt"] = [prompt_text(rng) for _ in range(rng.randint(2, 3))]
    elif r < 0.25:
        body["prompt"] = [rng.randint(1, 20000) for _ in range(rng.randint(4, 60))]
    else:
        body["prompt"] = prompt_text(rng)
    if rng.random() < 0.25:
        body["logprobs"] = rng.randint(0, 5)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    prompts = len(body["prompt"]) if isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str) else 1
    return body, prompts * body.get("n", 1)


def chat_body(rng: random.Random, stream: bool, max_tokens: int = 12) -> tuple[dict, int]:
    """A /v1/chat/completions body and the number of choices it asks for."""
    body = sampling_fields(rng, max_tokens)
    if rng.random() < 0.3:
        body["max_completion_tokens"] = body.pop("max_tokens")
    messages = list(CHAT_MODEL_HINT) if rng.random() < 0.5 else []
    for turn in range(rng.choice((1, 1, 3))):
        role = "assistant" if turn % 2 else "user"
        content = prompt_text(rng)
        messages.append({"role": role, "content": content if rng.random() < 0.8 else [{"type": "text", "text": content}]})
    body["messages"] = messages
    if rng.random() < 0.25:
        body["logprobs"] = True
        if rng.random() < 0.7:
            body["top_logprobs"] = rng.randint(0, 5)
    if stream:
        body["stream"] = True
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
    return body, body.get("n", 1)


def malformed_body(rng: random.Random) -> tuple[str, bytes, str]:
    """(path, body, content type) of a request that must be refused with a 4xx."""
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    key = "prompt" if path == "/v1/completions" else "messages"
    good = {"prompt": "hello"} if key == "prompt" else {"messages": [{"role": "user", "content": "hello"}]}
    choices: list[Callable[[], bytes]] = [
        lambda: b'{"prompt": "hi", "max_tokens": ',  # truncated
        lambda: b"",
        lambda: b"not json at all",
        lambda: bytes(rng.randrange(256) for _ in range(rng.randint(1, 512))),
        lambda: b"[1, 2, 3]",
        lambda: b'"just a string"',
        lambda: b"null",
        lambda: b'{"prompt": "hi",}',
        lambda: ("[" * 20000 + "]" * 20000).encode(),  # deep nesting
        lambda: json.dumps({key: {"nested": ["x"] * 5}}).encode(),
        lambda: json.dumps({**good, "max_tokens": "ten"}).encode(),
        lambda: json.dumps({**good, "n": "2"}).encode(),
        lambda: json.dumps({**good, "temperature": "hot"}).encode(),
        lambda: json.dumps({**good, "stream": "yes"}).encode(),
        lambda: json.dumps({**good, "stop": 42}).encode(),
        lambda: json.dumps({**good, "max_tokens": -5}).encode(),
        lambda: json.dumps({**good, "n": 0}).encode(),
        lambda: json.dumps({**good, "n": 100000}).encode(),
        lambda: json.dumps({**good, "max_tokens": 10**9}).encode(),
        lambda: json.dumps({**good, "temperature": 1e308 * 10}).encode(),  # Infinity: not JSON
        lambda: json.dumps({**good, "seed": 2**70}).encode(),
        lambda: json.dumps({"prompt": [], "max_tokens": 4}).encode(),
        lambda: json.dumps({"prompt": [-1, 99999999], "max_tokens": 4}).encode(),
        lambda: json.dumps({"messages": []}).encode(),
        lambda: json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(),
        lambda: json.dumps({**good, "model": "no-such-model"}).encode(),
        lambda: json.dumps({**good, "logprobs": 10**6}).encode(),
        lambda: json.dumps({**good, "top_k": rng.choice((2**31, 10**12))}).encode(),  # beyond int32
    ]
    return path, rng.choice(choices)(), "application/json"


def huge_float_body(rng: random.Random) -> bytes:
    """A 1-4 MiB array of floats as the prompt (wrong type: token ids are ints)."""
    n = rng.randint(100_000, 400_000)
    return json.dumps({"prompt": [round(rng.random(), 6)] * n, "max_tokens": 4}).encode()


def unknown_field_body(rng: random.Random) -> tuple[str, bytes]:
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    body = completion_body(rng, False, 4)[0] if path == "/v1/completions" else chat_body(rng, False, 4)[0]
    extra = rng.choice(({"foo": 1}, {"frobnicate": {"x": [1, 2]}}, {"best_of_luck": True},
                        {"functions": []}, {"max_tokenz": 5}))
    return path, json.dumps({**body, **extra}).encode()


# ---- HTTP over httpx ----------------------------------------------------------------------------


def check_completion_json(body: dict, choices: int, chat: bool) -> str:
    """'' if a non-streamed response has the right shape, else what is wrong."""
    got = body.get("choices")
    if not isinstance(got, list) or len(got) != choices:
        return f"expected {choices} choices, got {len(got) if isinstance(got, list) else got!r}"
    for c in got:
        if c.get("finish_reason") not in ("stop", "length"):
            return f"finish_reason {c.get('finish_reason')!r}"
        if chat and not isinstance(c.get("message", {}).get("content"), str):
            return "no message content"
    return ""


def check_sse(events: list[str], choices: int) -> str:
    """'' if a finished stream has one finish_reason per choice and ends with [DONE]."""
    if not events or events[-1] != "[DONE]":
        return "stream did not end with [DONE]"
    finished = set()
    for e in events[:-1]:
        chunk = json.loads(e)
        if "error" in chunk:
            return f"error in stream: {chunk['error'].get('message', '')[:80]}"
        for c in chunk.get("choices", []):
            if c.get("finish_reason"):
                finished.add(c["index"])
    return "" if len(finished) == choices else f"{len(finished)} of {choices} choices finished"


async def post_json(client: httpx.AsyncClient, kind: str, path: str, body: dict, choices: int,
                    headers: dict) -> Result:
    """A non-streamed request, read to the end and checked."""
    t0 = time.monotonic()
    r = await client.post(path, json=body, headers=headers)
    latency = time.monotonic() - t0
    outcome = outcome_of_status(r.status_code)
    if outcome != "completed":
        return Result(kind, outcome, r.status_code, retry_after="retry-after" in r.headers,
                      note=r.text[:120])
    problem = check_completion_json(r.json(), choices, "chat" in path)
    return Result(kind, "invalid" if problem else "completed", r.status_code, latency, note=problem)


async def post_stream(client: httpx.AsyncClient, kind: str, path: str, body: dict, choices: int,
                      headers: dict, close_after: int | None = None) -> Result:
    """A streamed request: read to [DONE] and check, or close the connection after
    `close_after` events (a client that goes away mid-stream)."""
    t0 = time.monotonic()
    async with client.stream("POST", path, json=body, headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Result(kind, outcome_of_status(r.status_code), r.status_code,
                          retry_after="retry-after" in r.headers, note=r.text[:120])
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if close_after is not None and len(events) >= close_after:
                    return Result(kind, "client-abort", 200, note=f"closed after {len(events)} chunks")
    problem = check_sse(events, choices)
    error_in_stream = problem.startswith("error in stream")
    outcome = "5xx" if error_in_stream else "invalid" if problem else "completed"
    return Result(kind, outcome, None if error_in_stream else 200, time.monotonic() - t0, note=problem)


async def post_raw_body(client: httpx.AsyncClient, kind: str, path: str, content: bytes,
                        content_type: str, headers: dict, expect_4xx: bool = True) -> Result:
    r = await client.post(path, content=content, headers={**headers, "content-type": content_type})
    outcome = outcome_of_status(r.status_code)
    return Result(kind, outcome, r.status_code, expect_4xx=expect_4xx,
                  retry_after="retry-after" in r.headers, note=r.text[:120])


# ---- HTTP over raw sockets ----------------------------------------------------------------------


async def open_raw(host: str, port: int, rcvbuf: int | None = None):
    """An asyncio connection whose socket has a small receive buffer when asked."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    return await asyncio.open_connection(sock=sock, limit=rcvbuf or 2**16)


def request_head(host: str, path: str, headers: dict, length: int | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def read_status(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """Status code and headers of an HTTP/1.1 response (raises on a closed connection)."""
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    hdrs = {}
    for line in lines[1:]:
        if ":" in line:
            k, _, v = line.partition(":")
            hdrs[k.strip().lower()] = v.strip()
    return status, hdrs


def close_writer(writer: asyncio.StreamWriter) -> None:
    try:
        writer.transport.abort()
    except Exception:
        pass


async def slow_reader(host: str, port: int, rng: random.Random, headers: dict, stall: float) -> Result:
    """Ask for a long, fat stream, read a few bytes, stall without reading, then close."""
    body = {"prompt": prompt_text(rng), "max_tokens": rng.randint(32, 96), "n": rng.randint(1, 2),
            "logprobs": 5, "stream": rng.random() < 0.7, "ignore_eos": True}
    payload = json.dumps(body).encode()
    reader, writer = await open_raw(host, port, rcvbuf=4096)
    try:
        writer.write(request_head(host, "/v1/completions", {**headers, "Content-Type": "application/json"},
                                  len(payload)) + payload)
        await writer.drain()
        status, _ = await read_status(reader)
        if status != 200:
            return Result("slow-reader", outcome_of_status(status), status)
        await reader.read(rng.randint(1, 200))
        await asyncio.sleep(stall)
        return Result("slow-reader", "client-abort", 200, note=f"stalled {stall:.0f} s")
    finally:
        close_writer(writer)


def oversized_chunks(size: int, token_ids: bool):
    """A JSON body of about `size` bytes whose prompt is huge, as 1 MiB pieces."""
    head = b'{"max_tokens": 1, "prompt": ' + (b"[" if token_ids else b'"')
    tail = b"1]}" if token_ids else b'"}'
    unit = b"17, " if token_ids else b"lorem ipsum "
    piece = unit * (MIB // len(unit))
    yield head
    sent = len(head) + len(tail)
    while sent < size:
        chunk = piece[:size - sent]
        sent += len(chunk)
        yield chunk
    yield tail


async def oversized(host: str, port: int, rng: random.Random, headers: dict) -> Result:
    """POST a body over 8 MiB (Content-Length or chunked); the answer must be a 4xx. The
    server may answer before the body is sent and close: the status still counts."""
    size = rng.choice((9, 9, 12, 33)) * MIB + rng.randint(0, MIB)
    token_ids, chunked = rng.random() < 0.5, rng.random() < 0.3
    kind = f"oversized{'-chunked' if chunked else ''}"
    pieces = list(oversized_chunks(size, token_ids))
    total = sum(len(p) for p in pieces)
    reader, writer = await open_raw(host, port)

    async def send_body() -> None:
        writer.write(request_head(host, "/v1/completions", {**headers, "Content-Type": "application/json"},
                                  None if chunked else total))
        for p in pieces:
            writer.write(b"%x\r\n%s\r\n" % (len(p), p) if chunked else p)
            await writer.drain()
        if chunked:
            writer.write(b"0\r\n\r\n")
        await writer.drain()

    sender = asyncio.ensure_future(send_body())
    try:
        try:
            status, hdrs = await read_status(reader)
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            return Result(kind, "conn-error", expect_4xx=True, note=repr(exc)[:100])
        return Result(kind, outcome_of_status(status), status, expect_4xx=True,
                      retry_after="retry-after" in hdrs, note=f"{total / MIB:.1f} MiB")
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
        close_writer(writer)


# ---- the soak --------------------------------------------------------------------------------


@dataclass
class Target:
    """Where the server is and how to talk to it."""

    client: httpx.AsyncClient
    host: str
    port: int
    headers: dict = field(default_factory=dict)


async def guarded(kind: str, coro: Awaitable[Result], timeout: float) -> Result:
    """Run one request; timeouts become `hung`, transport errors `conn-error`."""
    try:
        return await asyncio.wait_for(coro, timeout)
    except asyncio.TimeoutError:
        return Result(kind, "hung", note=f"no answer within {timeout:.0f} s")
    except (httpx.TransportError, OSError, asyncio.IncompleteReadError) as exc:
        return Result(kind, "conn-error", note=repr(exc)[:120])
    except (ValueError, KeyError) as exc:  # an unparsable 2xx body
        return Result(kind, "invalid", note=repr(exc)[:120])


async def cancelled_midway(t: Target, rng: random.Random) -> Result:
    """A non-streamed request the client gives up on after a random delay."""
    path = rng.choice(("/v1/completions", "/v1/chat/completions"))
    body, choices = (completion_body if "chat" not in path else chat_body)(rng, False, 48)
    try:
        return await asyncio.wait_for(post_json(t.client, "cancel-midway", path, body, choices, t.headers),
                                      rng.uniform(0.05, 1.5))
    except asyncio.TimeoutError:
        return Result("cancel-midway", "client-abort", note="cancelled")


def soak_request(t: Target, rng: random.Random, stall: float,
                 only: frozenset[str] = frozenset()) -> tuple[str, Callable[[], Awaitable[Result]]]:
    """Pick one random request shape (among `only`, when given): (kind, coroutine factory)."""
    c, h = t.client, t.headers
    kinds: list[tuple[float, str, Callable[[], Awaitable[Result]]]] = []

    def add(weight: float, kind: str, make: Callable[[], Awaitable[Result]]) -> None:
        kinds.append((weight, kind, make))

    add(22, "completion", lambda: post_json(c, "completion", "/v1/completions", *completion_body(rng, False), h))
    add(14, "completion-stream",
        lambda: post_stream(c, "completion-stream", "/v1/completions", *completion_body(rng, True), h))
    add(18, "chat", lambda: post_json(c, "chat", "/v1/chat/completions", *chat_body(rng, False), h))
    add(12, "chat-stream", lambda: post_stream(c, "chat-stream", "/v1/chat/completions", *chat_body(rng, True), h))
    add(6, "abort-stream", lambda: post_stream(c, "abort-stream", *rng.choice(
        [("/v1/completions", *completion_body(rng, True, 48)), ("/v1/chat/completions", *chat_body(rng, True, 48))]),
        h, close_after=rng.randint(1, 5)))
    add(3, "cancel-midway", lambda: cancelled_midway(t, rng))
    add(2.5, "slow-reader", lambda: slow_reader(t.host, t.port, rng, h, stall * rng.uniform(0.5, 1.5)))
    add(1, "oversized", lambda: oversized(t.host, t.port, rng, h))
    add(10, "malformed", lambda: post_raw_body(c, "malformed", *malformed_body(rng), h))
    add(2, "huge-floats", lambda: post_raw_body(c, "huge-floats", "/v1/completions", huge_float_body(rng),
                                                "application/json", h))
    add(2, "text-plain", lambda: post_raw_body(c, "text-plain", "/v1/completions", json.dumps(
        {"prompt": prompt_text(rng), "max_tokens": 2}).encode(), "text/plain", h))
    add(4, "unknown-field", lambda: post_raw_body(c, "unknown-field", *unknown_field_body(rng), "application/json", h))
    if only:
        kinds = [k for k in kinds if k[1] in only]
    weights = [w for w, _, _ in kinds]
    _, kind, make = rng.choices(kinds, weights)[0]
    return kind, make


async def run_soak(t: Target, n: int, rate: float, concurrency: int, seed: int, hang_timeout: float,
                   stall: float, only: frozenset[str] = frozenset()) -> list[Result]:
    """n random requests at Poisson arrivals (rate per s), at most `concurrency` in flight."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency)
    tasks = []

    async def one(kind: str, make: Callable[[], Awaitable[Result]]) -> Result:
        async with gate:
            return await guarded(kind, make(), hang_timeout)

    for i in range(n):
        await asyncio.sleep(rng.expovariate(rate))
        kind, make = soak_request(t, random.Random(rng.random()), stall, only)
        tasks.append(asyncio.ensure_future(one(kind, make)))
        if (i + 1) % 100 == 0:
            done = sum(task.done() for task in tasks)
            print(f"  soak: {i + 1}/{n} sent, {done} answered", flush=True)
    return list(await asyncio.gather(*tasks))


async def run_warmup(t: Target, hang_timeout: float) -> list[Result]:
    rng = random.Random(12345)
    out = []
    for stream in (False, True):
        out.append(await guarded("warmup", post_json(t.client, "warmup", "/v1/completions",
                                                     *completion_body(rng, False, 8), t.headers), hang_timeout))
        out.append(await guarded("warmup", post_stream(t.client, "warmup", "/v1/chat/completions",
                                                       *chat_body(rng, True, 8), t.headers), hang_timeout))
    return out


async def run_overload(t: Target, count: int, seed: int, hang_timeout: float) -> list[Result]:
    """`count` small requests released at the same instant."""
    rng = random.Random(seed + 1)
    start = asyncio.Event()

    async def one(i: int) -> Result:
        r = random.Random(rng.random())
        body = {"prompt": words(r, 3, 30), "max_tokens": r.randint(1, 6), "temperature": 0.7}
        await start.wait()
        if i % 4 == 3:
            body["stream"] = True
            return await post_stream(t.client, "overload", "/v1/completions", body, 1, t.headers)
        return await post_json(t.client, "overload", "/v1/completions", body, 1, t.headers)

    tasks = [asyncio.ensure_future(guarded("overload", one(i), hang_timeout)) for i in range(count)]
    await asyncio.sleep(0.2)
    start.set()
    return list(await asyncio.gather(*tasks))


async def settle(client: httpx.AsyncClient, minimum: float, maximum: float) -> dict[str, float]:
    """Wait at least `minimum` s, then until no request is in the server and every KV block
    is free (at most `maximum` s); returns the last /metrics sample."""
    await asyncio.sleep(minimum)
    deadline = time.monotonic() + maximum - minimum
    while True:
        m = await scrape_metrics(client)
        idle = (m.get("kv_blocks_free") == m.get("kv_blocks_total") and not m.get("num_requests_running")
                and not m.get("num_requests_waiting") and not m.get("num_requests_pending"))
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(1.0)


async def idle_cpu(pid: int, seconds: float) -> tuple[float, list[tuple[str, float]]]:
    """The server's CPU use (% of one core) over `seconds` of idleness, and per thread."""
    tick = os.sysconf("SC_CLK_TCK")
    before, threads_before, t0 = _cpu_ticks(f"/proc/{pid}/stat"), thread_cpu_ticks(pid), time.monotonic()
    await asyncio.sleep(seconds)
    after, threads_after, elapsed = _cpu_ticks(f"/proc/{pid}/stat"), thread_cpu_ticks(pid), time.monotonic() - t0
    per_thread = sorted(((name, 100 * (v - threads_before.get(name, 0)) / tick / elapsed)
                         for name, v in threads_after.items()), key=lambda kv: -kv[1])
    return 100 * (after - before) / tick / elapsed, per_thread


# ---- report ----------------------------------------------------------------------------------


def outcome_line(results: list[Result]) -> str:
    """"completed 540 | client-abort 80 | 4xx 370 (400: 350, 413: 20) | ..."."""
    by = Counter(r.outcome for r in results)
    status = defaultdict(Counter)
    for r in results:
        if r.outcome in ("4xx", "5xx"):
            status[r.outcome][r.status if r.status is not None else "in-stream"] += 1
    parts = []
    for name in ("completed", "client-abort", "4xx", "429", "5xx", "conn-error", "hung", "invalid"):
        detail = ", ".join(f"{s}: {k}" for s, k in sorted(status[name].items(), key=lambda x: str(x[0])))
        parts.append(f"{name} {by[name]}" + (f" ({detail})" if detail else ""))
    return " | ".join(parts)


def print_kinds(results: list[Result]) -> None:
    by_kind: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        by_kind[r.kind][r.label] += 1
    for kind in sorted(by_kind):
        counts = ", ".join(f"{label} {k}" for label, k in by_kind[kind].most_common())
        print(f"    {kind:<18} {sum(by_kind[kind].values()):>5}: {counts}")


SEVERITY = ("hung", "5xx", "conn-error", "invalid", "completed")


def print_notes(results: list[Result], per_class: int = 3) -> None:
    """What went wrong, worst first: hung, 5xx, conn-error, invalid, then a 2xx to a request
    built to be refused; the `per_class` most frequent messages of each."""
    odd: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        if r.expect_4xx and r.outcome == "completed":
            odd["completed"][(r.kind, r.label, "answered 2xx, expected 4xx")] += 1
        elif r.outcome in SEVERITY[:-1]:
            odd[r.outcome][(r.kind, r.label, r.note[:110])] += 1
    for outcome in SEVERITY:
        for (kind, label, why), count in odd[outcome].most_common(per_class):
            print(f"    ! {count} x {kind}: {label}: {why}")
        if len(odd[outcome]) > per_class:
            print(f"    ! ... and {len(odd[outcome]) - per_class} more kinds of {outcome}")


def mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / MIB:.0f} MiB"


@dataclass
class Report:
    soak: list[Result]
    soak_seconds: float
    overload: list[Result]
    overload_seconds: float
    max_batch: int
    metrics: dict[str, float]
    rss_start: int | None = None
    rss_peak: int | None = None
    rss_end: int | None = None
    warmup_count: int = 0
    idle: tuple[float, list[tuple[str, float]]] | None = None
    idle_seconds: float = 0.0
    exit_code: int | None | str = "n/a"

    def targets(self, rss_tolerance: float, idle_cpu_max: float) -> list[tuple[str, str, str]]:
        """(PASS/FAIL/SKIP, target, detail) per target."""
        every = self.soak + self.overload
        fivexx = sum(r.outcome == "5xx" for r in every)
        hung = sum(r.outcome == "hung" for r in every)
        free, total = self.metrics.get("kv_blocks_free"), self.metrics.get("kv_blocks_total")
        ok_overload = sum(r.outcome == "completed" or (r.outcome == "429" and r.retry_after) for r in self.overload)
        out = [
            ("PASS" if fivexx == 0 else "FAIL", "no 5xx responses", f"{fivexx} 5xx"),
            ("PASS" if hung == 0 else "FAIL", "no hung requests", f"{hung} hung"),
            ("PASS" if free is not None and free == total else "FAIL", "all KV blocks free at the end",
             f"{free:.0f} / {total:.0f} free" if free is not None else "no metrics"),
        ]
        if self.rss_start and self.rss_end:
            growth = self.rss_end / self.rss_start - 1
            out.append(("PASS" if abs(growth) <= rss_tolerance else "FAIL",
                        f"RSS at the end within {rss_tolerance:.0%} of the start (after warm-up)",
                        f"{mib(self.rss_start)} -> {mib(self.rss_end)} ({growth:+.1%})"))
        else:
            out.append(("SKIP", "RSS at the end within 10% of the start", "server PID unknown"))
        out.append(("PASS" if ok_overload == len(self.overload) else "FAIL",
                    "overload: every request served or refused with 429 + Retry-After",
                    f"{ok_overload} / {len(self.overload)}"))
        if self.idle is not None:
            out.append(("PASS" if self.idle[0] <= idle_cpu_max else "FAIL",
                        f"idle CPU at most {idle_cpu_max:g}% of a core", f"{self.idle[0]:.1f}%"))
        else:
            out.append(("SKIP", "idle CPU", "server PID unknown"))
        if self.exit_code != "n/a":
            out.append(("PASS" if self.exit_code == 0 else "FAIL", "launched server exits 0 on SIGTERM",
                        f"exit code {self.exit_code}"))
        return out

    def print(self, rss_tolerance: float, idle_cpu_max: float) -> int:
        print("\n===== soak summary =====")
        print(f"soak: {len(self.soak)} requests in {self.soak_seconds:.0f} s")
        print(f"  outcomes: {outcome_line(self.soak)}")
        print("  by kind:")
        print_kinds(self.soak)
        print_notes(self.soak)
        lat = [r.latency for r in self.soak if r.outcome == "completed" and r.latency is not None]
        if lat:
            print(f"  latency of completed requests: p50 {percentile(lat, 50):.2f} s, "
                  f"p99 {percentile(lat, 99):.2f} s (n={len(lat)})")
        with_ra = sum(r.outcome == "429" and r.retry_after for r in self.overload)
        print(f"overload: {len(self.overload)} requests at once ({len(self.overload) // max(1, self.max_batch)} x "
              f"max batch {self.max_batch}) in {self.overload_seconds:.0f} s")
        print(f"  outcomes: {outcome_line(self.overload)}; 429 with Retry-After: {with_ra}")
        print_notes(self.overload)
        lat = [r.latency for r in self.overload if r.outcome == "completed" and r.latency is not None]
        if lat:
            print(f"  latency of served requests: p50 {percentile(lat, 50):.2f} s, p99 {percentile(lat, 99):.2f} s")
        m = self.metrics
        print(f"KV blocks free at the end: {m.get('kv_blocks_free', float('nan')):.0f} / "
              f"{m.get('kv_blocks_total', float('nan')):.0f} (requests running {m.get('num_requests_running', 0):.0f}, "
              f"waiting {m.get('num_requests_waiting', 0):.0f}, pending {m.get('num_requests_pending', 0):.0f})")
        print(f"server RSS: start {mib(self.rss_start)} (after a warm-up of {self.warmup_count} requests), "
              f"peak {mib(self.rss_peak)}, end {mib(self.rss_end)}")
        if self.idle is not None:
            top = ", ".join(f"{name} {pct:.1f}%" for name, pct in self.idle[1][:3] if pct >= 0.05) or "none"
            print(f"server CPU while idle for {self.idle_seconds:.0f} s: {self.idle[0]:.1f}% of a core "
                  f"(busiest threads: {top})")
        if self.exit_code != "n/a":
            print(f"launched server exit code after SIGTERM: {self.exit_code}")
        print("targets:")
        targets = self.targets(rss_tolerance, idle_cpu_max)
        for verdict, name, detail in targets:
            print(f"  {verdict}  {name}: {detail}")
        failed = sum(v == "FAIL" for v, _, _ in targets)
        print(f"RESULT: {'FAIL' if failed else 'PASS'} ({failed} of {len(targets)} targets failed)")
        return 1 if failed else 0


# ---- main ------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default=None, help="server base URL (default with --launch: a free local port)")
    p.add_argument("--launch", action="store_true", help="start `python -m pagedjax.entrypoints.cli serve` and stop it at the end")
    p.add_argument("--server-args", default="", help="extra `serve` arguments with --launch (one string)")
    p.add_argument("--server-pid", type=int, default=None, help="server PID for RSS/CPU (default: found from the port)")
    p.add_argument("--api-key", default=None, help="sent as `Authorization: Bearer KEY`")
    p.add_argument("--requests", type=int, default=1000, help="soak requests (default 1000)")
    p.add_argument("--rate", type=float, default=4.0, help="mean arrivals per second (default 4)")
    p.add_argument("--concurrency", type=int, default=48, help="most soak requests in flight (default 48)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-batch", type=int, default=64, help="the server's max_num_seqs (default 64)")
    p.add_argument("--overload-factor", type=int, default=10, help="burst size in multiples of --max-batch")
    p.add_argument("--hang-timeout", type=float, default=180.0, help="seconds without an answer that count as hung")
    p.add_argument("--stall", type=float, default=15.0, help="mean seconds a slow reader stalls (default 15)")
    p.add_argument("--idle-seconds", type=float, default=20.0, help="idle window for the CPU measure (default 20)")
    p.add_argument("--idle-cpu-max", type=float, default=5.0, help="idle CPU target, %% of one core (default 5)")
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed RSS change, start to end (default 0.10)")
    p.add_argument("--only", default="", metavar="KIND,...", help=f"soak only these request kinds: {', '.join(KINDS)}")
    p.add_argument("--quick", action="store_true", help="100 requests, a 3x burst, shorter stalls and idle window")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.overload_factor, args.stall, args.idle_seconds = 100, 3, 5.0, 10.0
    if not args.launch and not args.url:
        p.error("give --url of a running server, or --launch")
    args.only = frozenset(k for k in args.only.split(",") if k)
    if args.only - set(KINDS):
        p.error(f"unknown kinds {sorted(args.only - set(KINDS))}; known: {', '.join(KINDS)}")
    return args


async def run(args: argparse.Namespace) -> int:
    proc, log = None, None
    if args.launch:
        port = free_port() if not args.url else urlparse(args.url).port
        args.url = args.url or f"http://127.0.0.1:{port}"
        proc, log = launch_server(port, args.server_args)
    url = urlparse(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    burst = args.overload_factor * args.max_batch
    limits = httpx.Limits(max_connections=args.concurrency + burst + 16, max_keepalive_connections=0)
    timeout = httpx.Timeout(args.hang_timeout + 30)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:
        t = Target(client, url.hostname or "127.0.0.1", url.port or 80, headers)
        if not await wait_healthy(client, 600 if proc else 30, proc):
            print(f"server at {args.url} is not healthy" + (f"; see {log}" if log else ""), file=sys.stderr)
            if proc is not None:
                stop_server(proc)
            return 2
        pid = proc.pid if proc else args.server_pid or pid_listening_on(t.port)
        print(f"server {args.url} healthy (pid {pid or 'unknown'}); warming up", flush=True)
        try:
            report = await measure(t, pid, args)
        finally:
            if proc is not None:
                code = stop_server(proc)
        if proc is not None:
            report.exit_code = code
    return report.print(args.rss_tolerance, args.idle_cpu_max)


async def measure(t: Target, pid: int | None, args: argparse.Namespace) -> Report:
    warm = await run_warmup(t, args.hang_timeout)
    await asyncio.sleep(2.0)
    sampler = RSSSampler(pid) if pid else None
    rss_start = sampler.sample() if sampler else None
    if sampler:
        sampler.start()
    print(f"warm-up done ({outcome_line(warm)}); RSS {mib(rss_start)}. soak: {args.requests} requests at "
          f"{args.rate:g}/s", flush=True)
    t0 = time.monotonic()
    soak = await run_soak(t, args.requests, args.rate, args.concurrency, args.seed, args.hang_timeout, args.stall,
                          args.only)
    soak_s = time.monotonic() - t0
    burst = args.overload_factor * args.max_batch
    print(f"soak done in {soak_s:.0f} s; overload burst of {burst} requests", flush=True)
    t0 = time.monotonic()
    overload = await run_overload(t, burst, args.seed, args.hang_timeout)
    overload_s = time.monotonic() - t0
    print(f"overload done in {overload_s:.0f} s; settling", flush=True)
    metrics = await settle(t.client, 5.0, 60.0)
    report = Report(soak, soak_s, overload, overload_s, args.max_batch, metrics, warmup_count=len(warm))
    if sampler:
        report.rss_start, report.rss_end = rss_start, sampler.sample()
        sampler.stop()
        report.rss_peak = sampler.peak
        print(f"measuring idle CPU for {args.idle_seconds:.0f} s", flush=True)
        report.idle, report.idle_seconds = await idle_cpu(pid, args.idle_seconds), args.idle_seconds
    return report


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(run(parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
