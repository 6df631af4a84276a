"""AsyncEngine: drives a (thread-unsafe) LLMEngine from one background thread for asyncio.

Only the engine thread ever touches the engine. asyncio code talks to it through a command
queue (add, abort, abort-all) and gets results back through `loop.call_soon_threadsafe`
into a per-request `asyncio.Queue`. The thread steps while the engine has work and sleeps
on a condition variable when idle. `stats()` returns the snapshot the thread takes after
every step, so /metrics never calls into the engine from another thread.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedjax.outputs import RequestOutput
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# seconds between an idle engine's idle_tick() calls, if it has one
IDLE_TICK_S = float(os.environ.get("PAGEDJAX_IDLE_TICK_S", "10"))


class QueueFullError(RuntimeError):
    """Too many requests are waiting for their first token."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and admits no new requests."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone, or the engine failed while running the request."""


@dataclass(eq=False)
class RequestStream:
    """The asyncio side of one request: an async iterator of cumulative RequestOutputs."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    abort_fn: Callable[[str], None]
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    started: bool = False  # got its first output (or ended): no longer counts as pending
    finished: bool = False  # the consumer has seen the end
    last: RequestOutput | None = None
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already ended (safe to call from `finally`)."""
        if not self.finished:
            self.finished = True
            self.abort_fn(self.request_id)


class AsyncEngine:
    """Runs `engine.step()` in a background thread and fans outputs out to asyncio streams."""

    def __init__(self, engine: Any, max_pending_requests: int = 1024, metrics: Any = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.model_name: str = getattr(engine, "model_name", "pagedjax")
        self.max_model_len: int = engine.max_model_len
        self.max_pending_requests = max_pending_requests
        self.metrics = metrics  # object with on_request_finished(stream, output) or None
        self.num_pending = 0  # requests admitted that have not produced output yet (loop side)
        self.accepting = True
        self.error: BaseException | None = None  # set when the engine thread dies
        self._cond = threading.Condition()
        self._commands: deque = deque()
        self._stop = False
        self._streams: dict[str, RequestStream] = {}  # engine-thread side
        self._last_outputs: dict[str, RequestOutput] = {}
        self._stats: dict = {}
        self._thread: threading.Thread | None = None

    # ---- lifecycle ------------------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is None:
            self._ready = threading.Event()
            self._thread = threading.Thread(target=self._run, name="pagedjax-engine", daemon=True)
            self._thread.start()
            self._ready.wait(30.0)  # the first stats snapshot, taken on the engine thread

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    def stop_admitting(self) -> None:
        """New add_request calls fail with ShuttingDownError from now on (thread-safe)."""
        self.accepting = False

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `drain_timeout` s, abort
        the rest and join the engine thread."""
        self.stop_admitting()
        deadline = time.monotonic() + drain_timeout
        while self.num_in_flight() and time.monotonic() < deadline and self.is_alive:
            await asyncio.sleep(0.02)
        self._submit(("abort_all",))
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30.0)

    def num_in_flight(self) -> int:
        return len(self._streams)

    def stats(self) -> dict:
        """The engine's stats as of the last step, plus the server-side pending count."""
        return {**self._stats, "num_requests_pending": self.num_pending}

    # ---- asyncio side ---------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int],
                          params: SamplingParams) -> RequestStream:
        """Submit a request; returns its stream. Raises ValueError (bad request),
        QueueFullError, ShuttingDownError or EngineDeadError."""
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        if not self.is_alive:
            raise EngineDeadError(f"the engine is not running: {self.error!r}")
        if self.num_pending >= self.max_pending_requests:
            raise QueueFullError(f"too many pending requests ({self.num_pending} waiting for their "
                                 f"first token, limit {self.max_pending_requests}); retry later")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, self.abort)
        admitted = loop.create_future()
        self.num_pending += 1
        self._submit(("add", stream, prompt, params, admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self._mark_started(stream)
            self.abort(request_id)
            raise
        except BaseException:
            self._mark_started(stream)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; the engine frees its blocks on its next turn)."""
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        with self._cond:
            self._commands.append(command)
            self._cond.notify()

    def _mark_started(self, stream: RequestStream) -> None:
        if not stream.started:
            stream.started = True
            self.num_pending -= 1

    def _deliver(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        """Runs on the event loop: hand one item to the stream and keep the books."""
        now = time.monotonic()
        self._mark_started(stream)
        if isinstance(item, RequestOutput):
            if stream.first_token_time is None and any(o.token_ids for o in item.outputs):
                stream.first_token_time = now
            stream.last = item
            if item.finished:
                stream.finish_time = now
                if self.metrics is not None:
                    try:
                        self.metrics.on_request_finished(stream, item)
                    except Exception:  # metrics must never break serving
                        logger.exception("metrics update failed")
        stream.queue.put_nowait(item)

    # ---- engine thread --------------------------------------------------------------------

    def _post(self, stream: RequestStream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(self._deliver, stream, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _run(self) -> None:
        busy = stalled = False
        # an engine spread over several processes keeps their collectives alive while idle
        idle_tick = getattr(self.engine, "idle_tick", None)
        try:
            self._stats = dict(self.engine.stats())
            self._ready.set()
            while True:
                tick = False
                with self._cond:
                    if stalled and not self._commands and not self._stop:
                        self._cond.wait(0.005)  # work that cannot progress: do not spin on the GIL
                    while not self._commands and not busy and not self._stop and not tick:
                        tick = not self._cond.wait(IDLE_TICK_S if idle_tick else None)
                    commands = list(self._commands)
                    self._commands.clear()
                    stop = self._stop
                if tick and not commands and not stop:
                    idle_tick()
                    continue
                for command in commands:
                    self._handle(command)
                if stop:
                    self._abort_all(ShuttingDownError("the server shut down"))
                    return
                busy = self.engine.has_unfinished_requests()
                stalled = False
                if busy:
                    t0 = time.perf_counter()
                    try:
                        outputs = self.engine.step()
                    except Exception as exc:  # fail the requests in flight, keep serving
                        logger.exception("engine step failed")
                        self._abort_all(EngineDeadError(f"engine step failed: {exc!r}"))
                        outputs = []
                    self._dispatch(outputs)
                    busy = self.engine.has_unfinished_requests()
                    stalled = not outputs and time.perf_counter() - t0 < 1e-3
                self._stats = dict(self.engine.stats())
        except BaseException as exc:  # pragma: no cover - a broken engine
            logger.exception("engine thread died")
            self.error = exc
            self._ready.set()
            self._abort_all(EngineDeadError(f"engine thread died: {exc!r}"), call_engine=False)

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, params, admitted = command
            try:
                self.engine.add_request(stream.request_id, prompt, params)
            except Exception as exc:
                stream.loop.call_soon_threadsafe(_set_future, admitted, exc)
                return
            self._streams[stream.request_id] = stream
            stream.loop.call_soon_threadsafe(_set_future, admitted, None)
        elif kind == "abort":
            rid = command[1]
            self.engine.abort_request(rid)
            last = self._last_outputs.pop(rid, None)
            stream = self._streams.pop(rid, None)
            if stream is not None:  # the consumer is gone; this feeds the metrics
                self._post(stream, _aborted(rid, last))
        elif kind == "abort_all":
            self._abort_all(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._last_outputs.pop(out.request_id, None)
            else:
                self._last_outputs[out.request_id] = out
            self._post(stream, out)

    def _abort_all(self, error: BaseException | None, call_engine: bool = True) -> None:
        """Abort every request in flight: each stream ends with an "abort" output (or
        `error` when given)."""
        for rid, stream in list(self._streams.items()):
            if call_engine:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # pragma: no cover
                    logger.exception("abort_request(%s) failed", rid)
            last = self._last_outputs.pop(rid, None)
            self._post(stream, error if error is not None else _aborted(rid, last))
        self._streams.clear()


def _set_future(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


def _aborted(request_id: str, last: RequestOutput | None) -> RequestOutput:
    """A final output with finish_reason "abort", built from the last one seen (if any)."""
    if last is None:
        return RequestOutput(request_id, None, [], [], finished=True)
    out = copy.deepcopy(last)
    out.finished = True
    for o in out.outputs:
        if o.finish_reason is None:
            o.finish_reason = "abort"
    return out
