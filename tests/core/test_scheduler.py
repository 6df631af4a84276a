"""Scheduler behaviour with no model: admission, limits, preemption, prefix hits, freeing."""
import pytest

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request, RequestStatus
from pagedjax.sampling_params import SamplingParams
from pagedjax.core.sched.scheduler import Scheduler


def make(num_blocks=16, block_size=4, max_num_seqs=4, budget=64, max_model_len=64, caching=True):
    """A scheduler whose smallest step is 16 tokens (the small prompts here run whole; the
    8-token rung's trims are tested on their own)."""
    pool = BlockPool(num_blocks, block_size, caching)
    return Scheduler(pool, Buckets(max_num_seqs, budget, min_tokens=16), max_model_len)


def req(rid, n, max_tokens=8, start=100):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), seed=0)


def run_step(s, token=7):
    out = s.schedule()
    produced = s.update(out, [[token]] * len(out.requests))
    for r, _, t in produced:  # as the engine's OutputProcessor does: append, then check
        r.output_token_ids += t
        s.check_stop(r, t[-1])
    return out


def test_rejects_prompts_that_can_never_run():
    s = make(num_blocks=4, block_size=4, max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        s.add(req("long", 64))
    with pytest.raises(ValueError, match="pool has only 4"):
        s.add(req("big", 10, max_tokens=20))  # needs 8 blocks
    assert not s.has_unfinished()


def test_admits_up_to_max_num_seqs_and_decodes_all():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add(req(str(i), 5, start=100 * i))  # distinct prompts: none waits for another's blocks
    out = run_step(s)
    assert out.num_decode == 0 and [r.request_id for r in out.requests] == ["0", "1"]
    assert out.q_lens == [5, 5] and len(s.waiting) == 1
    out = run_step(s)
    assert not out.has_prefill and out.q_lens == [1, 1]


def test_finished_request_returns_blocks_at_once():
    s = make(caching=False)
    s.add(req("a", 5, max_tokens=2))
    run_step(s)
    assert s.pool.num_free == 16 - 2
    run_step(s)  # second token: max_tokens reached
    assert not s.has_unfinished() and s.pool.num_free == 16


def test_abort_frees_blocks():
    s = make()
    r = req("a", 9)
    s.add(r)
    run_step(s)
    s.finish(r, "abort")
    assert r.status is RequestStatus.FINISHED and r.finish_reason == "abort"
    assert s.pool.num_free == 16 and not s.running


def test_preempts_newest_when_pool_runs_out():
    s = make(num_blocks=4, block_size=4, max_num_seqs=4)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8, start=200)
    s.add(a), s.add(b)
    run_step(s)  # both prefilled: 1 block each, 1 token out each
    while s.has_unfinished():
        run_step(s)
        assert sum(len(r.block_ids) for r in s.running) <= 4
    assert s.num_preemptions >= 1  # 2 x 3 blocks needed, 4 in the pool
    assert len(a.output_token_ids) == 8 and len(b.output_token_ids) == 8
    assert s.pool.num_free == 4
    s.pool.check_invariants()


def test_prefix_hits_skip_cached_full_blocks():
    s = make(block_size=4)
    s.add(req("a", 10, max_tokens=1))
    run_step(s)
    assert not s.has_unfinished()
    b = req("b", 10, max_tokens=1)
    s.add(b)
    out = s.schedule()
    assert out.starts == [8] and out.q_lens == [2]  # two full blocks from cache
    assert s.prefix_cache_hit_tokens == 8 and s.prefix_cache_query_tokens == 20
    c = req("c", 8, max_tokens=1)  # exactly two blocks: one token must still be computed
    for r, _, t in s.update(out, [[1]]):
        r.output_token_ids += t
    s.add(c)
    out = s.schedule()  # b (still running) decodes in the same step
    assert out.num_decode == 1 and out.starts[1:] == [4] and out.q_lens[1:] == [4]


def test_chunked_prefill_splits_long_prompts():
    s = make(budget=16, max_model_len=64)
    r = req("a", 40)
    s.add(r)
    chunks = []
    while not r.output_token_ids:
        out = run_step(s)
        chunks.append(out.q_lens[0])
    assert chunks == [16, 16, 8]


def test_long_prompt_is_one_packed_entry_of_its_step():
    pool = BlockPool(32, 4, True)
    s = Scheduler(pool, Buckets(2, 64), 64)
    a, b = req("a", 40), req("b", 8, start=300)
    s.add(a), s.add(b)
    out = run_step(s)
    assert out.requests == [a, b] and out.starts == [0, 0] and out.q_lens == [40, 8]
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    assert len(a.block_ids) == 10 and a.num_computed_tokens == 40


def test_lowered_token_budget_bounds_decodes_and_chunks():
    """While warm-up compiles the larger buckets the engine lowers the budget: steps stay small."""
    s = make(max_num_seqs=4, budget=64, num_blocks=32)
    for i in range(3):
        s.add(req(str(i), 3, max_tokens=5, start=100 * i))
    run_step(s)
    s.token_budget = 2
    out = run_step(s)
    assert out.q_lens == [1, 1] and out.num_decode == 2  # the third decode waits a step
    s.add(req("late", 9, start=500))
    s.token_budget = 16
    out = run_step(s)
    assert out.q_lens == [1, 1, 1, 9] and sum(out.q_lens) <= 16


def test_prompt_chunks_share_the_step_with_running_decodes():
    s = make(budget=16, max_model_len=64, num_blocks=32)
    short = req("short", 3, max_tokens=20)
    s.add(short)
    run_step(s)
    long = req("long", 40, start=300)
    s.add(long)
    steps = []
    while not long.output_token_ids:
        out = run_step(s)
        steps.append((out.num_decode, out.q_lens))
    # every step decodes the running request while the long prompt fills the rest of the budget
    assert steps == [(1, [1, 15]), (1, [1, 15]), (1, [1, 10])]
    assert len(short.output_token_ids) == 4


def test_prompt_chunk_trimmed_to_fill_the_rung_below():
    """4 decodes + a 32-token prompt = 36 tokens: padding to 48 would waste 12, so the chunk
    gives up 4 tokens and the step fills the 32 rung exactly; the rest runs next step."""
    s = make(max_num_seqs=8, budget=64, num_blocks=64, max_model_len=64)
    for i in range(4):
        s.add(req(str(i), 3, max_tokens=9, start=50 * i))
    run_step(s)
    s.add(req("p", 32, start=400))
    out = run_step(s)
    assert out.q_lens == [1, 1, 1, 1, 28] and sum(out.q_lens) == 32
    out = run_step(s)
    assert out.q_lens == [1, 1, 1, 1, 4]


def test_the_ladder_starts_at_8_tokens():
    """By default the smallest step is 8 tokens: a lone 10-token prompt fills it (its last 2
    tokens run next step rather than padding a 16-token step with 6), and a decode step of a
    few requests is an 8-token step."""
    buckets = Buckets(4, 64)
    assert buckets.token_buckets()[:3] == [8, 16, 32]
    s = Scheduler(BlockPool(16, 4, True), buckets, 64)
    s.add(req("a", 10))
    assert run_step(s).q_lens == [8]
    assert run_step(s).q_lens == [2]
    assert buckets.token_bucket(sum(run_step(s).q_lens)) == 8
    with pytest.raises(ValueError, match="power of two"):
        Buckets(4, 64, min_tokens=12)
    with pytest.raises(ValueError, match="at least 16"):
        Buckets(4, 8, min_tokens=16)


def test_cache_salt_separates_tenants():
    """Same prompt, different salts: a request hits only blocks cached under its own salt."""
    s = make(block_size=4)
    hits = []
    for salt in ("a", None, "b", "a", ""):
        r = req(f"salt {salt!r}", 10, max_tokens=1)
        r.cache_salt = salt
        s.add(r)
        run_step(s)
        assert r.is_finished
        hits.append(r.num_cached_tokens)
    assert hits == [0, 0, 0, 8, 8]  # "a" hits its own blocks; "" is no salt and hits None's


def forking(rid, n, seats, start, max_tokens=4):
    """A request that forks `seats` siblings once its prompt is computed (n = seats + 1)."""
    parent = req(rid, n, max_tokens, start)
    parent.pending_forks = [req(f"{rid}#{i}", n, max_tokens, start) for i in range(1, seats + 1)]
    parent.reserved_seats = seats
    return parent


def test_small_requests_pass_a_head_that_needs_more_seats_than_are_free():
    s = make(max_num_seqs=4, num_blocks=32)
    for i in range(2):
        s.add(req(f"run{i}", 3, max_tokens=10, start=100 * i))
    run_step(s)
    big, small = forking("big", 5, seats=2, start=300), req("small", 3, start=400)  # big needs 3 seats, 2 free
    s.add(big), s.add(small)
    out = run_step(s)
    assert out.requests[-1] is small and list(s.waiting) == [big] and big.num_passed == 1


def test_small_requests_pass_a_head_that_needs_more_blocks_than_are_free():
    s = make(num_blocks=16, block_size=4, max_num_seqs=4)
    s.add(req("running", 36, max_tokens=20))  # 10 blocks once it decodes
    run_step(s)
    big, small = req("big", 40, start=300), req("small", 3, start=400)  # 10 blocks, 6 free; 1 block
    s.add(big), s.add(small)
    out = run_step(s)
    assert out.requests[-1] is small and list(s.waiting) == [big]


def test_a_passed_request_is_not_starved_by_a_stream_of_small_ones():
    """Each step a new small request arrives and keeps a seat busy: without a bound the big
    request (all 4 seats) would never fit. After max_num_seqs requests passed it, the queue
    waits for it."""
    s = make(max_num_seqs=4, num_blocks=64)
    big = forking("big", 5, seats=3, start=1000)
    s.add(req("s0", 3, max_tokens=3))
    run_step(s)
    s.add(big)
    for step in range(1, 30):
        s.add(req(f"s{step}", 3, max_tokens=3, start=10 * step))
        run_step(s)
        if big.status is not RequestStatus.WAITING:
            break
    assert big.status is RequestStatus.RUNNING and big.num_passed == 4
    assert step <= 8  # 4 passes, then the running small requests drain


def test_a_preempted_request_is_not_passed():
    s = make(num_blocks=4, block_size=4, max_num_seqs=4)
    a, b = req("a", 4, max_tokens=8), req("b", 4, max_tokens=8, start=200)
    s.add(a), s.add(b)
    while not s.num_preemptions:
        run_step(s)
    assert list(s.waiting) == [b] and b.status is RequestStatus.PREEMPTED
    c = req("c", 3, max_tokens=1, start=300)  # one block: it would fit before b does
    s.add(c)
    while c.num_computed_tokens == 0:
        run_step(s)
        assert c.num_computed_tokens == 0 or b.status is RequestStatus.RUNNING
