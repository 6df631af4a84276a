"""/metrics agrees with what clients see at every moment: requests stay in flight until their
client has the end, the compile state is read live while the engine idles, and the warm-up
flag is exported."""
from __future__ import annotations

import asyncio
import gc

from pagedjax.engine.async_engine import AsyncEngine
from pagedjax.sampling_params import SamplingParams

from .conftest import metric, running_server
from .fake_engine import W0, FakeEngine


class CompilingEngine(FakeEngine):
    """A FakeEngine whose background warm-up the test moves by hand."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.compiled, self.shapes = 1, 3

    def compile_stats(self) -> dict:
        return {"num_compiled_shapes": self.compiled, "num_step_shapes": self.shapes,
                "warmup_done": self.compiled == self.shapes}


def test_a_finished_request_stays_in_flight_until_its_client_has_the_end():
    async def run():
        ae = AsyncEngine(FakeEngine())
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams(max_tokens=5, ignore_eos=True))
        while stream.finish_time is None:  # the engine is done; the consumer has taken nothing
            await asyncio.sleep(0.01)
        during = ae.stats()
        outs = [o async for o in stream]
        after = ae.stats()
        await ae.shutdown()
        return during, outs, after

    during, outs, after = asyncio.run(run())
    assert during["num_requests_running"] == 0 and during["num_requests_in_flight"] == 1
    assert during["oldest_request_age_seconds"] > 0
    assert outs[-1].finished
    assert after["num_requests_in_flight"] == 0 and after["oldest_request_age_seconds"] == 0.0


def test_an_aborted_or_dropped_stream_leaves_the_count():
    async def run():
        ae = AsyncEngine(FakeEngine(max_num_seqs=0))  # nothing ever runs
        ae.start()
        kept = await ae.add_request("a", [W0], SamplingParams())
        dropped = await ae.add_request("b", [W0], SamplingParams())
        both = ae.stats()["num_requests_in_flight"]
        kept.abort()
        ae.abort("b")  # as by a disconnect whose handler never reads the stream again
        await asyncio.sleep(0.1)
        del dropped  # ... and then loses it: collected out of the count
        gc.collect()
        left = ae.stats()["num_requests_in_flight"]
        await ae.shutdown()
        return both, left

    assert asyncio.run(run()) == (2, 0)


def test_admitted_request_is_counted_as_waiting_before_any_step():
    async def run():
        ae = AsyncEngine(FakeEngine(max_num_seqs=0, step_delay=1.0))  # a long first step
        ae.start()
        stream = await ae.add_request("a", [W0], SamplingParams())
        await asyncio.sleep(0.2)  # the step runs
        stats = ae.stats()
        stream.abort()
        await ae.shutdown()
        return stats

    stats = asyncio.run(run())
    assert stats["num_requests_waiting"] == 1 and stats["num_requests_in_flight"] == 1


def test_compile_state_is_live_while_the_engine_idles():
    engine = CompilingEngine()
    with running_server(engine) as s:
        assert metric(s.url, "pagedjax:num_compiled_shapes") == 1
        assert metric(s.url, "pagedjax:warmup_done") == 0
        engine.compiled = 3  # the background warm-up finished; no request ran since
        assert metric(s.url, "pagedjax:num_compiled_shapes") == 3
        assert metric(s.url, "pagedjax:warmup_done") == 1
