"""Sliding-window block release with no model: which blocks go back, and that every
reference is still returned exactly once (finish, preemption, forks)."""
import pytest
from hypothesis import given, settings, strategies as st

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request
from pagedjax.core.sched.scheduler import Scheduler, cdiv
from pagedjax.core.sched.window import WindowBlockRelease, window_release
from pagedjax.sampling_params import SamplingParams


def make(window=8, num_blocks=32, block_size=4, max_num_seqs=4, max_model_len=128, caching=True):
    pool = BlockPool(num_blocks, block_size, caching)
    s = Scheduler(pool, Buckets(max_num_seqs, 64, min_tokens=16), max_model_len)
    s.window = WindowBlockRelease(window, block_size)
    return s


def req(rid, n, max_tokens=64, start=100):
    return Request(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens), seed=0)


def run_step(s, token=7):
    out = s.schedule()
    produced = s.update(out, [[token]] * len(out.requests))
    for r, _, t in produced:
        r.output_token_ids += t
        s.check_stop(r, t[-1])
    return out


def held(s):
    return s.pool.num_blocks - s.pool.num_free


def test_only_blocks_wholly_below_the_next_querys_window_are_released():
    w = WindowBlockRelease(window=8, block_size=4)
    # a query at position p sees keys p-7..p: block b (keys 4b..4b+3) is out when 4b+3 < p-7
    for p in range(40):
        n = w.num_outside(p)
        assert all(4 * b + 3 < p - 7 for b in range(n))
        assert not 4 * n + 3 < p - 7  # the next block is still (partly) visible


def test_a_long_generation_holds_a_bounded_number_of_blocks_and_returns_them_all():
    s = make(window=8, block_size=4)
    s.add(req("a", 10, max_tokens=60))
    peak = 0
    while s.has_unfinished():
        out = run_step(s)
        peak = max(peak, held(s))
        r = out.requests[0]
        if not r.is_finished:
            # every block from the one holding position computed - 7 on is still held
            first_visible = max(0, r.num_computed_tokens - 7) // 4
            assert r.num_released_blocks <= first_visible
            assert all(s.pool.ref_counts[b] > 0 for b in r.block_ids[first_visible:])
        s.pool.check_invariants()
    # window 8 + the block being written: at most 4 blocks at once, against 70 / 4 -> 18 without
    assert peak <= 4 and s.window.num_released > 0
    assert s.pool.num_free == s.pool.num_blocks


def test_released_blocks_stay_in_the_block_table_at_their_logical_index():
    s = make(window=8, block_size=4)
    s.add(req("a", 12, max_tokens=30))
    r = s.waiting[0]
    for _ in range(12):
        run_step(s)
    ids = list(r.block_ids)
    assert r.num_released_blocks > 0 and len(ids) == cdiv(r.num_computed_tokens, 4)  # one entry per written block
    run_step(s)
    assert r.block_ids[:len(ids)] == ids  # released entries are not shifted out


def test_preemption_and_finish_free_only_what_is_held():
    s = make(window=8, block_size=4, num_blocks=32)
    s.add(req("a", 10, max_tokens=100, start=100))
    for _ in range(20):
        run_step(s)
    a = s.running[0]
    assert a.num_released_blocks > 0
    s._preempt(a)
    assert a.num_released_blocks == 0 and a.block_ids == []
    s.pool.check_invariants()
    assert s.pool.num_free == s.pool.num_blocks
    run_step(s)  # readmitted: recomputes its prompt and outputs
    s.finish(a, "abort")
    s.pool.check_invariants()
    assert s.pool.num_free == s.pool.num_blocks


def test_a_fork_takes_only_the_held_blocks():
    s = make(window=8, block_size=4)
    s.add(req("p", 10, max_tokens=40))
    for _ in range(12):
        run_step(s)
    parent = s.running[0]
    child = req("c", 10, max_tokens=40)
    s.fork(parent, child)
    assert child.num_released_blocks == parent.num_released_blocks > 0
    assert all(s.pool.ref_counts[b] == 2 for b in parent.held_block_ids)
    for _ in range(10):
        run_step(s)
        s.pool.check_invariants()
    s.finish(parent, "abort"), s.finish(child, "abort")
    s.pool.check_invariants()
    assert s.pool.num_free == s.pool.num_blocks


def test_released_prompt_blocks_stay_cached_for_the_next_request_with_that_prompt():
    s = make(window=8, block_size=4)
    s.add(req("a", 24, max_tokens=4))
    while s.has_unfinished():
        run_step(s)
    s.add(req("b", 24, max_tokens=4))
    run_step(s)
    assert s.prefix_cache_hit_tokens == 20  # all its full prompt blocks but the last (recomputed)


@pytest.mark.parametrize("windows, expected", [((), None), ((None, None), None), ((16, None, 16), None),
                                               ((16, 16), 16), ((8, 16), 16)])
def test_only_models_whose_every_layer_slides_release_blocks(windows, expected):
    w = window_release(windows, 4)
    assert (w and w.window) == expected


def test_a_preempted_request_takes_back_only_the_cached_blocks_inside_its_window():
    s = make(window=8, block_size=4, num_blocks=32)
    s.add(req("a", 10, max_tokens=100))
    for _ in range(30):  # 40 tokens, 39 computed: blocks 0..8 full and cached, most released
        run_step(s)
    a = s.running[0]
    s._preempt(a)
    run_step(s)  # readmitted at 36: 9 blocks hit the cache; the 7 wholly below 36 - 7 are not taken
    assert a.num_released_blocks == s.window.num_outside(36) == 7
    assert len(a.held_block_ids) == 3  # blocks 7, 8 (hits) and 9 (positions 36..39)
    assert held(s) == len(a.held_block_ids)
    while s.has_unfinished():
        run_step(s)
        s.pool.check_invariants()
    assert s.pool.num_free == s.pool.num_blocks


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 30), st.integers(1, 40), st.integers(0, 2)), min_size=1, max_size=6),
       st.lists(st.sampled_from(["step", "preempt", "abort", "fork"]), min_size=1, max_size=80),
       st.integers(2, 12))
def test_random_traffic_returns_every_reference_once(reqs, ops, window):
    """Requests with shared prefixes, preemptions, aborts and forks under window release: the
    pool's counts stay consistent, a running request holds every block its window can see,
    and everything is free at the end."""
    s = make(window=window, block_size=4, num_blocks=64, max_num_seqs=4)
    for i, (n, max_tokens, prefix) in enumerate(reqs):
        s.add(req(str(i), n, max_tokens=max_tokens, start=100 * prefix))
    forks = 0
    for op in ops:
        if op == "preempt" and s.running:
            s._preempt(s.running[-1])
        elif op == "abort" and s.running:
            s.finish(s.running[0], "abort")
        elif op == "fork" and s.running and s.num_seats_taken() < 4:
            parent = s.running[0]
            if parent.num_tokens - parent.num_computed_tokens == 1:
                forks += 1
                s.fork(parent, Request(f"f{forks}", parent.prompt_token_ids, parent.params, seed=0))
        elif s.has_unfinished():
            run_step(s)
        s.pool.check_invariants()
        for r in s.running:
            lo = max(0, r.num_computed_tokens - window + 1) // 4  # the block of the first visible key
            assert all(s.pool.ref_counts[b] > 0 for b in r.block_ids[lo:])
    for r in list(s.running) + list(s.waiting):
        s.finish(r, "abort")
    s.pool.check_invariants()
    assert s.pool.num_free == s.pool.num_blocks


def test_a_request_longer_than_the_pool_runs_when_its_window_fits():
    s = make(window=8, block_size=4, num_blocks=24)  # a step takes up to 64 tokens: 8 + 64 -> 19 blocks
    assert s.window.max_blocks_held(64) == 19
    s.add(req("long", 40, max_tokens=80))  # 120 tokens: 30 blocks, more than the pool
    peak = 0
    while s.has_unfinished():
        run_step(s)
        peak = max(peak, held(s))
        s.pool.check_invariants()
    assert peak <= 19 and s.pool.num_free == s.pool.num_blocks
    s.window = None  # without the release the same request is refused up front
    with pytest.raises(ValueError, match="pool has only 24; raise num_blocks or lower max_tokens"):
        s.add(req("long", 40, max_tokens=80))


def test_the_pool_error_of_a_sliding_window_model_names_the_step_budget():
    s = make(window=8, block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="lower max_num_batched_tokens"):
        s.add(req("a", 10, max_tokens=100))
