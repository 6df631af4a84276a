"""The asyncio side of a request the AsyncEngine runs: its stream of RequestOutput deltas
(merged while the consumer lags, so a stream holds one pending update at most), and the
errors a submission can end with."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Callable

from pagedjax.outputs import RequestOutput


class QueueFullError(RuntimeError):
    """Too many sequences are waiting for their first token."""


class ShuttingDownError(RuntimeError):
    """The server is shutting down and admits no new requests."""


class EngineDeadError(RuntimeError):
    """The engine thread is gone, or the engine failed while running the request."""


@dataclass(eq=False)
class RequestStream:
    """The asyncio side of one request: an async iterator of RequestOutput deltas (text,
    token ids and logprobs new since the previous item; the last one has finished=True)."""

    request_id: str
    n: int
    abort_fn: Callable[[str], None]
    loop: asyncio.AbstractEventLoop | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None
    started: bool = False  # got its first output (or ended): no longer counts as pending
    finished: bool = False  # the consumer has seen the end
    num_prompt_tokens: int = 0
    num_tokens: dict[int, int] = field(default_factory=dict)  # completion index -> tokens delivered
    finish_reasons: dict[int, str] = field(default_factory=dict)
    _pending: RequestOutput | None = None  # delivered, not yet taken by the consumer
    _error: BaseException | None = None
    _wakeup: asyncio.Future | None = None

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while self._pending is None and self._error is None:
            self._wakeup = asyncio.get_running_loop().create_future()
            await self._wakeup
        item, self._pending = self._pending, None
        if item is None:
            self.finished = True
            raise self._error
        if item.finished:
            self.finished = True
        return item

    def push(self, item: RequestOutput | BaseException) -> None:
        """Runs on the event loop: merge an update into the pending one (or record the error)."""
        if isinstance(item, BaseException):
            self._error = item
        elif self._pending is None:
            self._pending = item
        else:
            merge_delta(self._pending, item)
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)

    def abort(self) -> None:
        """Abort the request unless it already ended (safe to call from `finally`)."""
        if not self.finished:
            self.finished = True
            self.abort_fn(self.request_id)


def merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Append delta `new` to delta `into` (both of one request), in place."""
    by_index = {o.index: o for o in into.outputs}
    for o in new.outputs:
        old = by_index.get(o.index)
        if old is None:
            into.outputs.append(o)
            continue
        old.text += o.text
        old.token_ids.extend(o.token_ids)
        if o.logprobs is not None:
            if old.logprobs is None:
                old.logprobs = []
            old.logprobs.extend(o.logprobs)  # deltas are fresh lists: extending is safe
        old.finish_reason, old.stop_reason = o.finish_reason, o.stop_reason
    into.finished = into.finished or new.finished
    into.num_cached_tokens = new.num_cached_tokens
    if into.prompt_logprobs is None:  # carried once, by the first output that has it
        into.prompt_logprobs = new.prompt_logprobs
