"""How the AsyncEngine's outputs reach their streams: the engine thread posts each step's
outputs to the event loop that owns each stream (`_post`, `_dispatch`, `_abort_all`), and the
loop hands them over while keeping a stream's books (`_deliver`: token counts, first-token and
finish times, the metrics). A mixin of AsyncEngine: it reads `_streams`, `_beam_searches`,
`num_pending`, `metrics` and `engine`.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from pagedjax.core.beam_search import BeamSearchOutput
from pagedjax.engine.request_stream import RequestStream
from pagedjax.outputs import CompletionOutput, EmbeddingRequestOutput, RequestOutput

logger = logging.getLogger("pagedjax.engine.async_engine")


class OutputRouting:
    """Routing of outputs from the engine thread to the asyncio streams."""

    def _mark_started(self, stream: RequestStream) -> None:
        if not stream.started:
            stream.started = True
            self.num_pending -= stream.n

    def _deliver(self, stream: RequestStream, item: RequestOutput | BaseException) -> None:
        """Runs on the event loop: hand one item to the stream and keep the books."""
        now = time.monotonic()
        self._mark_started(stream)
        if isinstance(item, RequestOutput):
            stream.num_prompt_tokens = len(item.prompt_token_ids) or stream.num_prompt_tokens
            for o in item.outputs:
                stream.num_tokens[o.index] = stream.num_tokens.get(o.index, 0) + len(o.token_ids)
                if o.finish_reason is not None:
                    stream.finish_reasons[o.index] = o.finish_reason
            if stream.first_token_time is None and any(stream.num_tokens.values()):
                stream.first_token_time = now
        elif isinstance(item, EmbeddingRequestOutput):  # done in one piece: its prompt is its work
            stream.num_prompt_tokens = len(item.prompt_token_ids)
            stream.finish_reasons[0] = "stop"
        if isinstance(item, (RequestOutput, EmbeddingRequestOutput)) and item.finished:
            stream.finish_time = now
            if self.metrics is not None:
                try:
                    self.metrics.on_request_finished(stream)
                except Exception:  # metrics must never break serving
                    logger.exception("metrics update failed")
        stream.push(item)

    # ---- engine thread side ---------------------------------------------------------------

    def _post(self, stream: RequestStream, item: Any) -> None:
        try:
            stream.loop.call_soon_threadsafe(self._deliver, stream, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        if self._beam_searches and self.engine.finished_beam_searches:
            for rid in [r for r in self.engine.finished_beam_searches if r in self._beam_searches]:
                self._beam_searches.discard(rid)
                outputs.append(_beam_output(self.engine.finished_beam_searches.pop(rid)))
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
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
            # a fresh exception per stream: each is raised in its own task
            self._post(stream, type(error)(*error.args) if error is not None else _aborted(rid))
        self._streams.clear()
        self._beam_searches.clear()


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None,
             result: Any = None) -> None:
    """Settle `fut` on its loop, from any thread."""
    try:
        loop.call_soon_threadsafe(_set_future, fut, exc, result)
    except RuntimeError:  # the loop is closed
        pass


def _set_future(fut: asyncio.Future, exc: BaseException | None, result: Any = None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(result)
    else:
        fut.set_exception(exc)


def _beam_output(result: BeamSearchOutput) -> RequestOutput:
    """A finished beam search as one finished RequestOutput: beam i (best first) is completion i."""
    return RequestOutput(result.request_id, None, list(result.prompt_token_ids),
                         [CompletionOutput(i, seq.text, list(seq.token_ids), seq.finish_reason)
                          for i, seq in enumerate(result.sequences)], finished=True)


def _aborted(request_id: str) -> RequestOutput:
    """The final delta of an aborted request: nothing new, finished (O(1) on the engine
    thread; the consumer gives "abort" to every completion that has no finish reason)."""
    return RequestOutput(request_id, None, [], [], finished=True)
