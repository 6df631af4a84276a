"""InputBatch's vectorized decode rows against its entry-by-entry path, and the request rows
kept between steps (block tables rewritten when a request's blocks change: appended, copied
on write, trimmed, preempted and re-admitted; a row reused by another request)."""
import dataclasses

import jax
import numpy as np
import pytest

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.sched.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams
from pagedjax.worker.request_rows import RequestRows
from pagedjax.worker.input_batch import InputBatch

BS, MAX_BLOCKS = 4, 16


def make_batch(max_num_seqs=8, lora=False):
    buckets = Buckets(max_num_seqs, 64, min_tokens=16)
    slots = {}

    def penalty_slot(rank, req):  # a stable slot per request, as the runner's PenaltySlots gives
        return slots.setdefault(req.request_id, len(slots))

    batch = InputBatch(buckets, BS, MAX_BLOCKS, 64, penalty_slot, lora=lora)
    batch.vectorize_from = 1  # every decode entry through the vectorized path
    return batch, buckets


def arrays(prepared) -> dict[str, np.ndarray]:
    """Every array prepare() returns, by name."""
    t, inputs, sampling, (src, dst) = prepared
    leaves = {"t": np.array(t), "src": src, "dst": dst}
    for name, tree in (("in", inputs), ("sample", sampling)):
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
            leaves[name + "".join(str(k) for k in path)] = np.asarray(leaf)
    return leaves


def assert_same_as_entry_by_entry(batch: InputBatch, out) -> None:
    """prepare() with its decode rows packed vectorized == with every entry packed one by one
    (num_decode=0 sends them through the general loop; nothing else reads it)."""
    fast = arrays(batch.prepare([out]))
    slow = arrays(batch.prepare([dataclasses.replace(out, num_decode=0)]))
    assert fast.keys() == slow.keys()
    for k in fast:
        np.testing.assert_array_equal(fast[k], slow[k], err_msg=k)


def params(i: int) -> SamplingParams:
    """A different mix of sampling settings per request."""
    kinds = [dict(), dict(temperature=0.7, top_p=0.9, top_k=5, seed=3), dict(logprobs=2, min_p=0.1),
             dict(min_tokens=3, temperature=1.0), dict(repetition_penalty=1.2, presence_penalty=0.5),
             dict(allowed_token_ids=[1, 2, 3]),
             dict(prompt_logprobs=1)]
    return SamplingParams(max_tokens=12, **kinds[i % len(kinds)])


def test_decode_rows_match_the_entry_by_entry_path_through_a_run():
    """A scheduler with a small pool (blocks appended every 4 tokens, preemptions, a forked
    pair sharing blocks, n = 2), each step packed both ways."""
    batch, buckets = make_batch()
    s = Scheduler(BlockPool(14, BS, True), buckets, 64)
    prompts = [[7, 8, 9, 10, 11], [7, 8, 9, 10, 11], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [5, 6]]
    for i, prompt in enumerate(prompts):
        r = Request(f"r{i}", prompt, params(i), seed=2**33 + i)
        r.lora_slot = i % 3
        if i == 1:  # n = 2: a sibling forked after prefill shares the prompt's blocks
            sib = Request("r1#1", prompt, params(i), seed=5)
            r.pending_forks, r.reserved_seats = [sib], 1
        s.add(r)
    decode_steps = 0
    for step in range(40):
        out = s.schedule()
        if out is None:
            break
        decode_steps += out.num_decode > 0
        assert_same_as_entry_by_entry(batch, out)
        for r, _, toks in s.update(out, [[3 + step % 5]] * len(out.requests)):
            if toks is not None:
                r.output_token_ids += toks
                r.pending_row = step % 3 - 1  # some rows read the previous step's token on the device
                s.check_stop(r, toks[-1])
    assert decode_steps > 10 and s.num_preemptions > 0 and s.pool.num_cow_copies > 0


def test_lora_slots_and_rank_offsets_match():
    batch, buckets = make_batch(lora=True)
    scheds = [Scheduler(BlockPool(32, BS, False), buckets, 64) for _ in range(2)]
    for rank, s in enumerate(scheds):
        for i in range(3 + rank):
            r = Request(f"{rank}-{i}", [4 + i, 5, 6], params(i), seed=i)
            r.lora_slot = i + rank
            s.add(r)
    for step in range(6):
        outs = [s.schedule() for s in scheds]
        fast = arrays(batch.prepare(outs))
        slow = arrays(batch.prepare([dataclasses.replace(o, num_decode=0) for o in outs]))
        for k in fast:
            np.testing.assert_array_equal(fast[k], slow[k], err_msg=k)
        for s, out in zip(scheds, outs):
            for r, _, toks in s.update(out, [[9]] * len(out.requests)):
                r.output_token_ids += toks


def _req(rid, blocks, **params):
    r = Request(rid, [1, 2, 3], SamplingParams(**params), seed=0)
    r.block_ids = list(blocks)
    return r


def gather(rows: RequestRows, reqs):
    return rows.table[rows.rows(list(reqs))]


def test_block_table_rows_follow_every_change():
    rows = RequestRows(4, 6)
    a, b = _req("a", [3, 4]), _req("b", [9])

    def check(*reqs):
        got = gather(rows, reqs)
        for row, r in zip(got, reqs):
            assert row.tolist() == r.block_ids + [0] * (6 - len(r.block_ids)), r.request_id

    check(a, b)
    a.block_ids.append(7)  # a block appended (in place)
    check(a, b)
    a.block_ids[1] = 11  # copy-on-write: same length, one id replaced
    check(a, b)
    del a.block_ids[2:]  # a trimmed tail, then another block appended: same length as before
    a.block_ids.append(12)
    check(a, b)
    a.block_ids = []  # preempted, then re-admitted with other blocks
    check(a)
    a.block_ids = [5, 6, 8]
    check(b, a)
    c, d, e = _req("c", [1]), _req("d", [2, 2]), _req("e", [])
    check(c, d, e, a)  # the 4 rows are full: b's row goes to whoever needs one
    check(b, c)
    assert rows.table.shape == (4, 6)


def test_block_table_rows_refuse_what_does_not_fit():
    rows = RequestRows(2, 3)
    with pytest.raises(ValueError, match="room for 3"):
        gather(rows, [_req("a", [1, 2, 3, 4])])
    with pytest.raises(RuntimeError, match="more request rows"):
        gather(rows, [_req(str(i), [i]) for i in range(3)])


def test_a_finished_requests_row_is_reused_not_read():
    """A new request that takes a finished one's row sees its own blocks and settings only."""
    rows = RequestRows(1, 4)
    old = _req("old", [5, 6, 7, 8], temperature=0.5, logprobs=1, min_tokens=2, presence_penalty=0.5)
    assert gather(rows, [old]).tolist() == [[5, 6, 7, 8]]
    assert (rows.temperature[0], rows.want_logprobs[0], rows.min_tokens[0], rows.penalized[0]) == (0.5, True, 2, True)
    old.status = RequestStatus.FINISHED
    assert gather(rows, [_req("new", [9])]).tolist() == [[9, 0, 0, 0]]
    assert (rows.temperature[0], rows.want_logprobs[0], rows.min_tokens[0], rows.penalized[0]) == (0.0, False, 0, False)
