"""A prompt prefix being computed is computed once: requests that need its blocks wait for
them instead of computing them too (scheduler only, no model), and never wait for a request
that has stopped computing them."""
import numpy as np

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request
from pagedjax.sampling_params import SamplingParams
from pagedjax.core.sched.scheduler import Scheduler


def make(num_blocks=1024, block_size=16, max_num_seqs=32, budget=2048, max_model_len=1024, caching=True):
    return Scheduler(BlockPool(num_blocks, block_size, caching), Buckets(max_num_seqs, budget), max_model_len)


def run_step(s, token=7):
    out = s.schedule()
    for r, _, t in s.update(out, [[token]] * len(out.requests)):
        r.output_token_ids += t  # as the engine's OutputProcessor does
        s.check_stop(r, t[-1])
    return out


def shared_prefix_requests(n, prefix_len, seed=0, max_tokens=4):
    """n requests: one prefix_len-token prefix, then 1-40 distinct tokens each."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(0, 30000, size=prefix_len).tolist()
    return [Request(f"r{i}", prefix + rng.integers(30000, 60000, size=int(rng.integers(1, 41))).tolist(),
                    SamplingParams(max_tokens=max_tokens), seed=0) for i in range(n)]


def test_prefix_shared_by_requests_arriving_together_is_computed_once():
    reqs = shared_prefix_requests(24, 480)
    s = make()
    for r in reqs:  # all before the first step
        s.add(r)
    prefill = 0
    while s.has_unfinished():
        prefill += run_step(s).num_prefill_tokens
    suffixes = sum(r.num_prompt_tokens - 480 for r in reqs)
    assert s.prefix_cache_hit_tokens == 23 * 480  # every request but the first hits the whole prefix
    assert [r.num_cached_tokens for r in reqs] == [0] + [480] * 23
    assert prefill == 480 + suffixes  # the prefix once, each suffix once
    assert s.pool.num_free == s.pool.num_blocks and not s.prefix.inflight
    s.pool.check_invariants()


def test_prefix_caching_off_admits_everything_at_once():
    reqs = shared_prefix_requests(24, 480)
    s = make(caching=False)
    for r in reqs:
        s.add(r)
    out = run_step(s)
    assert len(out.requests) == 5 and sum(out.q_lens) == 2048  # 4 whole prompts and a chunk of a fifth
    assert s.prefix_cache_hit_tokens == 0 and not s.prefix.inflight


def req(rid, tokens, max_tokens=4):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0)


def test_waiter_waits_for_the_last_chunk_while_later_requests_go_first():
    """a's prompt takes two chunks; b, sharing its 96-token prefix, waits while a computes
    it, and the unrelated request behind b is admitted meanwhile."""
    prefix = list(range(96))
    a, b = req("a", prefix + list(range(1000, 1010))), req("b", prefix + list(range(2000, 2010)))
    other = req("other", range(3000, 3020))
    s = make(budget=64)
    s.add(a), s.add(b), s.add(other)
    assert run_step(s).q_lens == [64]  # a's first chunk
    out = run_step(s)
    assert out.requests == [a, other] and out.q_lens == [42, 20] and list(s.waiting) == [b]
    out = run_step(s)
    assert out.requests[-1] is b and out.starts[-1] == 96 and b.num_cached_tokens == 96
    assert s.prefix_cache_hit_tokens == 96


def _stop_mid_prefill(stop):
    """a has computed 32 tokens of a 96-token prefix b shares; `stop(s, a)` ends its work;
    b is admitted at the next step and hits what a cached."""
    prefix = list(range(96))
    a, b = req("a", prefix + [1000]), req("b", prefix + [2000])
    s = make(budget=32)
    s.add(a), s.add(b)
    run_step(s)
    assert a.num_computed_tokens == 32 and list(s.waiting) == [b] and s.prefix.inflight
    stop(s, a)
    assert not s.prefix.inflight  # nothing waits on a request that no longer computes
    out = run_step(s)
    assert out.requests == [b] and out.starts == [32]
    while s.has_unfinished():
        run_step(s)
    assert len(b.output_token_ids) == 4 and b.num_cached_tokens == 32
    s.pool.check_invariants()
    return s, a


def test_waiter_proceeds_when_the_computing_request_is_aborted():
    _stop_mid_prefill(lambda s, a: s.finish(a, "abort"))


def test_waiter_proceeds_when_the_computing_request_is_preempted_then_aborted():
    def preempt_then_abort(s, a):
        s._preempt(a)  # as when a decode needs its blocks: a goes back to the head of the queue
        assert not s.prefix.inflight
        s.finish(a, "abort")  # and its client leaves before it resumes

    s, a = _stop_mid_prefill(preempt_then_abort)
    assert a.finish_reason == "abort" and s.num_preemptions == 1


def test_preempted_computing_request_resumes_and_the_waiter_still_hits():
    """The pool runs short in the middle of the shared prefix: a stalls, is preempted by d's
    decode, resumes first once d is done; b waits for it throughout and computes only its own
    tokens."""
    prefix = list(range(64))
    a, b = req("a", prefix + [1000, 1001, 1002, 1003], 2), req("b", prefix + [2000, 2001, 2002, 2003], 2)
    d = req("d", [3000, 3001, 3002], max_tokens=20)
    s = make(num_blocks=10, block_size=8, max_num_seqs=4, budget=16, max_model_len=128)
    s.add(d)
    run_step(s)
    s.add(a), s.add(b)
    b_prefill = 0
    for _ in range(100):
        if not s.has_unfinished():
            break
        out = run_step(s)
        b_prefill += sum(q for r, q in zip(out.requests[out.num_decode:], out.q_lens[out.num_decode:]) if r is b)
    assert not s.has_unfinished() and s.num_preemptions >= 1
    assert b.num_cached_tokens == 64 and b_prefill == 4
    assert len(a.output_token_ids) == len(b.output_token_ids) == 2
    assert not s.prefix.inflight and s.pool.num_free == 10
    s.pool.check_invariants()
