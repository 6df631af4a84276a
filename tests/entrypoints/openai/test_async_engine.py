"""AsyncEngine on its own: outputs, errors, the pending limit, aborts and shutdown."""
from __future__ import annotations

import asyncio

import pytest

from pagedjax.sampling_params import SamplingParams
from pagedjax.engine.async_engine import AsyncEngine, QueueFullError, ShuttingDownError

from .fake_engine import W0, FakeEngine


async def _until(cond, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    assert cond()


def test_outputs_and_drain_on_shutdown():
    async def run():
        ae = AsyncEngine(FakeEngine(step_delay=0.001))
        ae.start()
        stream = await ae.add_request("a", [W0 + 1], SamplingParams(max_tokens=3))
        # deltas: each carries only what is new (a consumer that lags gets the unread steps merged
        # into one delta, so on a busy machine there may be fewer than 3)
        outs = [o async for o in stream]
        assert "".join(o.outputs[0].text for o in outs) == "w2 w3 w4" and 1 <= len(outs) <= 3
        assert [t for o in outs for t in o.outputs[0].token_ids] == [W0 + 2, W0 + 3, W0 + 4]
        assert all(o.outputs[0].token_ids for o in outs) and [o.finished for o in outs][-1:] == [True]
        assert not any(o.finished for o in outs[:-1])
        assert stream.first_token_time is not None and stream.finish_time >= stream.first_token_time
        stream = await ae.add_request("b", [W0 + 1], SamplingParams(max_tokens=20))
        await ae.shutdown(drain_timeout=10)  # in flight: allowed to finish
        outs = [o async for o in stream]
        assert outs[-1].outputs[0].finish_reason == "length" and sum(len(o.outputs[0].token_ids) for o in outs) == 20
        assert not ae.is_alive

    asyncio.run(run())


def test_errors_pending_limit_abort_and_shutdown():
    async def run():
        engine = FakeEngine(max_num_seqs=0, step_delay=0.005)  # nothing runs: requests stay pending
        ae = AsyncEngine(engine, max_pending_requests=2)
        ae.start()
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("e", [], SamplingParams())
        assert ae.num_pending == 0
        a = await ae.add_request("a", [W0], SamplingParams(max_tokens=5))
        b = await ae.add_request("b", [W0], SamplingParams(max_tokens=5))
        with pytest.raises(QueueFullError):
            await ae.add_request("c", [W0], SamplingParams(max_tokens=5))
        b.abort()
        await _until(lambda: ae.num_pending == 1)
        c = await ae.add_request("c", [W0], SamplingParams(max_tokens=5))
        await ae.shutdown()
        for stream in (a, c):
            outs = [o async for o in stream]
            assert len(outs) == 1 and outs[0].finished and outs[0].outputs == []
        with pytest.raises(ShuttingDownError):
            await ae.add_request("d", [W0], SamplingParams())
        assert engine.aborted == ["b", "a", "c"] and not ae.is_alive and len(engine.threads) == 1

    asyncio.run(run())


def test_abort_during_run_ends_the_stream():
    async def run():
        engine = FakeEngine(step_delay=0.005)
        ae = AsyncEngine(engine)
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await stream.__anext__()
        assert first.outputs[0].text == "w1"
        await ae.shutdown()  # no drain: aborted
        outs = [o async for o in stream]
        assert outs[-1].finished and all(c.finish_reason is None for o in outs for c in o.outputs)
        assert engine.free_blocks == engine.num_blocks

    asyncio.run(run())
