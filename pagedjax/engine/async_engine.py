"""AsyncEngine: drives a (thread-unsafe) LLMEngine from one background thread for asyncio.

Only the engine thread ever touches the engine. asyncio code talks to it through a command
queue (add, add a beam search, abort, abort-all, call: run a function such as loading a LoRA
adapter) and gets results back through `loop.call_soon_threadsafe`. The LoRA adapters the
engine knows are mirrored in `loras` (name -> LoRARequest), a snapshot the engine thread
replaces whenever they change, so request handlers look names up without a round trip.
The engine runs with `output_deltas`, so each step posts only what is new; a stream whose
consumer has not taken its last update yet merges the new one into it, so a stream holds at
most one pending update however slowly its client reads. The thread steps while the engine
has work that can progress and sleeps on a condition variable otherwise. `stats()` returns
the snapshot the thread takes after every step and every batch of commands, so /metrics
never calls into the engine from another thread (except `compile_stats()`, read live: the
background warm-up changes it while the engine idles). The request counts a client can check
against its own streams (in flight, pending, the oldest age) are kept on the event loop: a
request stays in flight until its consumer has taken the final output, even when the engine
finished it steps earlier. How outputs travel from the thread to the streams:
`output_routing.py`.

A step that raises may leave the device state poisoned (the KV cache is donated to the
step), so it is fatal: every stream and every queued command ends with EngineDeadError,
`is_alive` turns False (/health answers 503) and the `on_dead` callbacks run (the server
exits non-zero so that a supervisor restarts it).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
from collections import deque
from typing import Any, Callable

from pagedjax.core.beam_search import BeamSearchParams
from pagedjax.engine.output_routing import OutputRouting, _aborted, _resolve
from pagedjax.engine.request_stream import EngineDeadError, QueueFullError, RequestStream, ShuttingDownError
from pagedjax.lora.request import LoRARequest
from pagedjax.pooling.params import PoolingParams
from pagedjax.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
# seconds between an idle engine's idle_tick() calls, if it has one
IDLE_TICK_S = float(os.environ.get("PAGEDJAX_IDLE_TICK_S", "10"))


class AsyncEngine(OutputRouting):
    """Runs `engine.step()` in a background thread and fans outputs out to asyncio streams."""

    def __init__(self, engine: Any, max_pending_requests: int = 1024, metrics: Any = None) -> None:
        if not hasattr(engine, "output_deltas"):
            raise TypeError(f"{type(engine).__name__} has no `output_deltas`: AsyncEngine needs an engine that "
                            f"can return only what is new in each output (as LLMEngine does)")
        self.engine = engine
        engine.output_deltas = True
        self.tokenizer = engine.tokenizer
        self.model_name: str = getattr(engine, "model_name", "pagedjax")
        self.max_model_len: int = engine.max_model_len
        self.max_pending_requests = max_pending_requests  # sequences waiting for their first token
        self.metrics = metrics  # object with on_request_finished(stream) or None
        self.num_pending = 0  # sequences admitted that have not produced output yet (loop side)
        self.accepting = True
        self.error: BaseException | None = None  # set when the engine thread dies
        self.on_dead: list[Callable[[], None]] = []  # run (on the engine thread) when it dies
        self._cond = threading.Condition()
        self._commands: deque = deque()
        self._stop = False
        self._dead = False  # guarded by _cond: commands are refused from now on
        self._streams: dict[str, RequestStream] = {}  # engine-thread side
        self._beam_searches: set[str] = set()  # the ids in _streams that are beam searches
        self._stats: dict = {}
        # loop side: admitted streams; a stream leaves when its consumer has seen the end (or
        # aborted it); one its handler dropped is garbage-collected out of the set
        self._open_streams: weakref.WeakSet[RequestStream] = weakref.WeakSet()
        self._thread: threading.Thread | None = None
        self.lora_enabled = getattr(engine, "lora", None) is not None  # the engine has enable_lora
        self.embeddings_enabled = hasattr(engine, "add_embed_request")  # the engine computes embeddings
        self.loras: dict[str, LoRARequest] = {}  # the adapters the engine knows, by name (a snapshot)
        self._refresh_loras()

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
        """Requests the engine thread still serves (their final output not yet posted)."""
        return len(self._streams)

    def stats(self) -> dict:
        """The engine's stats as of the last step, its compile state now, and the loop-side
        counts: requests in flight until their client has the end, pending sequences and the
        age of the oldest request in flight."""
        live = [s for s in self._open_streams if not s.finished]
        compile_stats = getattr(self.engine, "compile_stats", None)
        return {**self._stats, **(compile_stats() if compile_stats is not None else {}),
                "num_requests_in_flight": len(live), "num_requests_pending": self.num_pending,
                "oldest_request_age_seconds": time.monotonic() - min(s.arrival_time for s in live) if live else 0.0}

    def _snapshot(self) -> None:
        """Engine thread: publish the stats for the event loop (one atomic assignment)."""
        self._stats = self.engine.stats()

    # ---- asyncio side ---------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Submit a request (with `lora_request`: run with that adapter); returns its stream.
        Raises ValueError (bad request), QueueFullError, ShuttingDownError or EngineDeadError."""
        return await self._add(("add", prompt, params, cache_salt, lora_request), request_id, params.n)

    async def add_embed_request(self, request_id: str, prompt: str | list[int],
                                params: PoolingParams | None = None) -> RequestStream:
        """Submit an embedding request; its stream yields one EmbeddingRequestOutput (or, if
        aborted, a finished RequestOutput with no outputs). Raises as add_request does."""
        return await self._add(("add_embed", prompt, params), request_id, 1)

    async def add_beam_search(self, request_id: str, prompt: str | list[int],
                              params: BeamSearchParams) -> RequestStream:
        """Submit a beam search; its stream yields one finished RequestOutput holding the
        beams as completions, best first (no deltas: beams change until the search ends).
        Aborting it (or a client disconnect) ends the search and returns its blocks. Raises
        as add_request does."""
        return await self._add(("add_beam", prompt, params), request_id, params.beam_width)

    async def _add(self, command: tuple, request_id: str, num_seqs: int) -> RequestStream:
        if not self.accepting:
            raise ShuttingDownError("the server is shutting down and accepts no new requests")
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        if self.num_pending + num_seqs > self.max_pending_requests:
            raise QueueFullError(f"too many pending sequences ({self.num_pending} waiting for their "
                                 f"first token, limit {self.max_pending_requests}); retry later")
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, num_seqs, self.abort, loop)
        admitted = loop.create_future()
        self.num_pending += num_seqs
        # ("add" | "add_beam", stream, <arguments>..., admitted)
        self._submit((command[0], stream, *command[1:], admitted))
        try:
            await admitted
        except asyncio.CancelledError:
            self._mark_started(stream)
            self.abort(request_id)
            raise
        except BaseException:
            self._mark_started(stream)
            raise
        self._open_streams.add(stream)
        return stream

    async def call(self, fn: Callable, *args) -> Any:
        """fn(*args) on the engine thread, between steps; returns its result or raises its
        exception (EngineDeadError when the engine is gone)."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._submit(("call", loop, fn, args, done))
        return await done

    # ---- LoRA adapters (each runs on the engine thread) -----------------------------------

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load the adapter at `path` as `name` with the next free id (the largest + 1);
        ValueError if LoRA is off, the name is taken or the adapter cannot serve."""
        return await self.call(self._load_lora, name, path)

    async def unload_lora(self, name: str) -> LoRARequest:
        """Unload the adapter called `name` (running requests finish with it); KeyError if
        no adapter has that name."""
        return await self.call(self._unload_lora, name)

    def _load_lora(self, name: str, path: str) -> LoRARequest:
        if not self.lora_enabled:
            raise ValueError("LoRA adapters need a server started with --enable-lora")
        known = self._engine_loras()
        if any(lora.lora_name == name for lora in known):
            raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        lora = LoRARequest(name, max((l.lora_int_id for l in known), default=0) + 1, path)
        self._with_refresh(self.engine.add_lora, lora)
        return lora

    def _unload_lora(self, name: str) -> LoRARequest:
        lora = next((l for l in self._engine_loras() if l.lora_name == name), None)
        if lora is None:
            raise KeyError(name)
        self._with_refresh(self.engine.remove_lora, lora.lora_int_id)
        return lora

    def _engine_loras(self) -> list[LoRARequest]:
        list_loras = getattr(self.engine, "list_loras", None)
        return list(list_loras()) if self.lora_enabled and list_loras is not None else []

    def _refresh_loras(self) -> None:
        """Engine thread (or before it starts): publish the adapters (one atomic assignment)."""
        self.loras = {lora.lora_name: lora for lora in self._engine_loras()}

    def _with_refresh(self, fn: Callable, *args) -> Any:
        try:
            return fn(*args)
        finally:
            self._refresh_loras()

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe; the engine frees its blocks on its next turn)."""
        self._submit(("abort", request_id))

    def _submit(self, command: tuple) -> None:
        with self._cond:
            if not self._dead:
                self._commands.append(command)
                self._cond.notify()
                return
        if command[0] in _ANSWERED:  # the engine is gone: nothing will ever answer it
            _resolve(_loop_of(command), command[-1], EngineDeadError("the engine is not running"))

    # ---- engine thread --------------------------------------------------------------------

    def _run(self) -> None:
        # work that cannot progress (e.g. a request waiting for blocks that only an abort can
        # free) waits for the next command instead of spinning
        stalled = False
        # an engine spread over several processes keeps their collectives alive while idle
        idle_tick = getattr(self.engine, "idle_tick", None)
        try:
            self._snapshot()
            self._ready.set()
            while True:
                tick = False
                with self._cond:
                    while not self._commands and not self._stop and not tick and \
                            (stalled or not self.engine.has_unfinished_requests()):
                        tick = not self._cond.wait(IDLE_TICK_S if idle_tick else None)
                    commands = list(self._commands)
                    self._commands.clear()
                    stop = self._stop
                if tick and not commands and not stop and not self.engine.has_unfinished_requests():
                    idle_tick()
                    continue
                for i, command in enumerate(commands):
                    try:
                        self._handle(command)
                    except BaseException:  # fatal: what is left of the batch must fail with the rest
                        with self._cond:
                            self._commands.extendleft(reversed(commands[i:]))
                        raise
                if stop:
                    self._abort_all(ShuttingDownError("the server shut down"))
                    close = getattr(self.engine, "close_kv_tiers", None)  # the disk KV tier's pending writes
                    if close is not None:
                        close()
                    return
                if commands:  # an admitted request counts as waiting before its first step
                    self._snapshot()
                stalled, outputs = False, []
                if self.engine.has_unfinished_requests():
                    steps = self.engine.num_steps
                    outputs = self.engine.step()  # raising is fatal: see the module docstring
                    stalled = not outputs and self.engine.num_steps == steps  # nothing could run
                # the snapshot first: a client never sees tokens that /metrics does not count yet
                self._snapshot()
                self._dispatch(outputs)
        except BaseException as exc:
            logger.exception("the engine failed; it stops and every request in flight fails "
                             "(restart the server)")
            self._die(exc)

    def _die(self, exc: BaseException) -> None:
        """Fail everything in flight and everything queued; refuse what comes later."""
        self.error = exc
        with self._cond:
            self._dead = True
            commands = list(self._commands)
            self._commands.clear()
        self._ready.set()
        message = "the engine failed while running this request (see the server log)"
        for command in commands:
            if command[0] in _ANSWERED:
                _resolve(_loop_of(command), command[-1], EngineDeadError(message))
        self._abort_all(EngineDeadError(message), call_engine=False)
        for callback in self.on_dead:
            try:
                callback()
            except Exception:  # pragma: no cover
                logger.exception("on_dead callback failed")

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, stream, prompt, params, cache_salt, lora_request, admitted = command
            # only the options given: an engine without them (a test double) still serves the rest
            extra = {k: v for k, v in (("cache_salt", cache_salt), ("lora_request", lora_request)) if v is not None}
            if lora_request is not None and lora_request not in self._engine_loras():  # unloaded since the lookup
                _resolve(stream.loop, admitted, ValueError(f"the LoRA adapter {lora_request.lora_name!r} is not loaded"))
                return
            self._admit(stream, admitted, lambda: self.engine.add_request(stream.request_id, prompt, params, **extra))
        elif kind == "add_embed":
            _, stream, prompt, params, admitted = command
            self._admit(stream, admitted, lambda: self.engine.add_embed_request(stream.request_id, prompt, params))
        elif kind == "add_beam":
            _, stream, prompt, params, admitted = command
            if self._admit(stream, admitted, lambda: self.engine.add_beam_search(stream.request_id, prompt, params)):
                self._beam_searches.add(stream.request_id)
        elif kind == "abort":
            rid = command[1]
            self.engine.abort_request(rid)
            self._beam_searches.discard(rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:  # the consumer is gone; this feeds the metrics
                self._post(stream, _aborted(rid))
        elif kind == "abort_all":
            self._abort_all(None)
        elif kind == "call":
            _, loop, fn, args, done = command
            try:
                result = fn(*args)
            except Exception as exc:
                _resolve(loop, done, exc)
            else:
                _resolve(loop, done, None, result)

    def _admit(self, stream, admitted, add) -> bool:
        """Runs add() (the engine's add_* call for stream's request) and answers the caller's
        `admitted` future: its error, or None once the stream is registered."""
        try:
            add()
        except Exception as exc:
            _resolve(stream.loop, admitted, exc)
            return False
        self._streams[stream.request_id] = stream
        _resolve(stream.loop, admitted, None)
        return True


_ANSWERED = ("add", "add_embed", "add_beam", "call")  # commands whose last item is a future someone awaits


def _loop_of(command: tuple) -> asyncio.AbstractEventLoop:
    """The event loop that awaits an answered command's future."""
    return command[1] if command[0] == "call" else command[1].loop
