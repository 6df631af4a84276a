"""KVOffloadPolicy with the scheduler, host side only (no model, no copies): a set of keys
stands in for the host tier. Evicted prefix blocks are planned as saves; a prefix that
misses the device but hits the host is planned as loads into fresh, cached blocks and counts
as computed."""
from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.kv_offload import KVOffloadPolicy
from pagedjax.core.request import Request
from pagedjax.core.sched.scheduler import Scheduler
from pagedjax.sampling_params import SamplingParams

BS = 4


class FakeHost:
    """The copier's side: keys it holds (a save lands at once here)."""

    def __init__(self):
        self.keys: set[bytes] = set()

    def __call__(self, key: bytes) -> bool:
        return key in self.keys


def make(num_blocks=8):
    s = Scheduler(BlockPool(num_blocks, BS), Buckets(4, 64), 64)
    host = FakeHost()
    s.offload = KVOffloadPolicy(s.pool, host)
    return s, host


def drain(s, host, req):
    """Runs req to the end; every step's saves land in the host. -> the step outputs."""
    s.add(req)
    return run_all(s, host)


def run_all(s, host):
    """Runs s's requests to the end; every step's saves land in the host. -> the step outputs."""
    outs = []
    while s.has_unfinished():
        out = s.schedule()
        host.keys.update(key for _, key in out.saves)
        outs.append(out)
        for r, _, t in s.update(out, [[7]] * len(out.requests)):
            r.output_token_ids += t
            s.check_stop(r, t[-1])
    return outs


def req(rid, tokens, max_tokens=1):
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens), seed=0)


def test_evicted_blocks_are_saved_and_loaded_back():
    s, host = make(num_blocks=8)
    doc = list(range(100, 124))  # 6 full blocks
    outs = drain(s, host, req("a", doc + [1]))
    assert not any(o.saves or o.loads for o in outs)  # nothing evicted yet
    keys_a = list(s.pool._block_of)  # the doc's 6 cached blocks
    outs = drain(s, host, req("b", list(range(200, 224)) + [2]))  # needs 7 of 8 blocks: evicts a's
    saved = [key for o in outs for _, key in o.saves]
    assert saved and set(saved) <= set(keys_a)
    assert s.offload.num_saved_blocks == len(saved)
    # a's doc again: the device kept at most 1 of its blocks (the first); the rest come from the host
    c = req("c", doc + [3])
    outs = drain(s, host, c)
    first = outs[0]
    device_hits = 6 - len(saved)
    assert [key for key, _ in first.loads] == keys_a[device_hits:]
    assert first.q_lens == [1] and first.starts == [24]  # only the last token is computed
    assert c.num_cached_tokens == 24 and s.prefix_cache_hit_tokens == device_hits * BS
    assert s.offload.host_hit_tokens == len(saved) * BS
    for key, block in first.loads:  # registered in the prefix cache under their keys
        assert s.pool._hash_of[block][0] == key
    s.pool.check_invariants()
    assert s.pool.num_free == 8


def test_host_match_stops_at_the_first_miss_and_before_the_last_token():
    s, host = make(num_blocks=16)
    r = req("r", list(range(50, 66)))  # exactly 4 blocks: the 4th holds the last token
    from pagedjax.core.sched.prefix_cache import block_key

    keys, parent = [], None
    for i in range(4):
        parent = block_key(r, i, parent, tuple(r.all_token_ids[i * BS:(i + 1) * BS]))
        keys.append(parent)
    host.keys = {keys[0], keys[1], keys[3]}
    assert s.offload.match(r, 0, keys[0]) == keys[:2]  # block 2 misses: stop there
    host.keys = set(keys)
    assert s.offload.match(r, 0, keys[0]) == keys[:3]  # block 3 holds the last token: computed
    assert s.offload.match(r, 1, keys[1]) == keys[1:3]



class FakeDisk:
    """The copier's disk side: on_disk(keys) -> how many leading keys it holds; records each run asked."""

    def __init__(self, keys=()):
        self.keys, self.runs = set(keys), []

    def __call__(self, run: list[bytes]) -> int:
        self.runs.append(list(run))
        return next((i for i, k in enumerate(run) if k not in self.keys), len(run))


def test_disk_runs_cross_host_hits_and_stop_where_neither_tier_has_a_block(monkeypatch):
    monkeypatch.setattr("pagedjax.core.kv_offload.DISK_RUN", 4)
    from pagedjax.core.sched.prefix_cache import block_key

    s = Scheduler(BlockPool(16, BS), Buckets(4, 64), 64)
    host, disk = FakeHost(), FakeDisk()
    s.offload = KVOffloadPolicy(s.pool, host, s.prefix, disk)
    r = req("r", list(range(50, 95)))  # 45 tokens: 11 full blocks before the last token's
    keys, parent = [], None
    for i in range(11):
        parent = block_key(r, i, parent, tuple(r.all_token_ids[i * BS:(i + 1) * BS]))
        keys.append(parent)

    def match(host_keys, disk_keys, num_hits=0):
        host.keys, disk.keys, disk.runs = set(host_keys), set(disk_keys), []
        return s.offload.match(r, num_hits, keys[num_hits])

    assert match([], keys) == keys and disk.runs == [keys[0:4], keys[4:8], keys[8:11]]  # the last run ends at the limit
    # block 1 only on the host: the run stops there, the host serves it, the disk goes on after
    assert match([keys[1]], keys[:1] + keys[2:]) == keys
    assert disk.runs == [keys[0:4], keys[2:6], keys[6:10], keys[10:11]]
    assert match([], keys[:2]) == keys[:2] and disk.runs == [keys[0:4]]  # block 2 in neither tier
    assert match([keys[0]], keys[1:3]) == keys[:3] and disk.runs == [keys[1:5]]
    assert match([], []) == [] and disk.runs == [keys[0:4]]
    assert match(keys, [], num_hits=3) == keys[3:] and disk.runs == []  # every block on the host
    assert s.offload._from_disk >= set(keys[:3])

def test_saves_skip_keys_the_host_holds():
    s, host = make(num_blocks=8)
    drain(s, host, req("a", list(range(100, 124)) + [1]))
    host.keys = set(s.pool._block_of)  # as if saved before
    outs = drain(s, host, req("b", list(range(200, 224)) + [2]))
    assert not any(o.saves for o in outs)
    assert s.offload.num_save_skipped > 0 and s.offload.num_saved_blocks == 0


def test_off_by_default():
    s = Scheduler(BlockPool(8, BS), Buckets(4, 64), 64)
    assert s.offload is None and s.pool.evicted is None
    s.add(req("a", range(100, 125)))
    out = s.schedule()
    assert out.saves == [] and out.loads == []


def _swap_setup(room: int):
    s, host = make(num_blocks=8)
    flushed, dropped = [], []
    s.offload.swap_room = lambda: room - sum(isinstance(k, int) for k in host.keys)
    s.offload.flush, s.offload.drop_swaps = lambda: flushed.append(1), dropped.extend
    for i in range(2):  # 3 prompt blocks each, growing to 6: the second is preempted in decode
        s.add(req(f"r{i}", range(100 * i + 10, 100 * i + 22), max_tokens=12))
    return s, run_all(s, host), flushed, dropped


def test_swap_preemption_saves_pinned_and_resumes_from_the_host():
    s, outs, flushed, dropped = _swap_setup(room=100)
    assert s.num_preemptions == 1
    (swap_out,) = [o for o in outs if any(isinstance(k, int) for _, k in o.saves)]
    swaps = [(b, k) for b, k in swap_out.saves if isinstance(k, int)]
    loads = [(k, b) for o in outs for k, b in o.loads if isinstance(k, int)]
    assert flushed  # the next schedule stored the swap before any resume
    assert s.offload.num_swapped_out_blocks == len(swaps) >= 4
    # resumed: its device hits first (none survive here, or a few), then its swap keys, not recomputed
    assert len(loads) + len(dropped) == len(swaps) and s.offload.num_swapped_in_blocks == len(loads) > 0
    i = outs.index(next(o for o in outs if o.loads))
    j = [r.request_id for r in outs[i].requests].index("r1")
    # preempted while decoding: it resumes after its prompt and the tokens it had, one token to go
    assert outs[i].starts[j] > 12 and outs[i].q_lens[j] == 1
    assert not s.offload.swapped and s.offload.num_swap_fallbacks == 0
    s.pool.check_invariants()
    assert s.pool.num_free == 8


def test_swap_falls_back_to_recompute_without_room():
    s, outs, flushed, dropped = _swap_setup(room=2)
    assert s.num_preemptions == 1 and s.offload.num_swap_fallbacks == 1
    assert not any(isinstance(k, int) for o in outs for _, k in o.saves) and not flushed
    assert s.offload.num_swapped_out_blocks == 0 and not s.offload.swapped


def test_sliding_window_loads_only_the_blocks_its_window_reads():
    """Window release on (window 8, blocks of 4): a prompt of 6 host blocks + 1 token starts at
    24, where the window reads blocks 4 and 5 only: blocks 0-3 are neither loaded nor held (their
    keys stay in the request's chain), the pool gets every block back."""
    from pagedjax.core.sched.window import WindowBlockRelease

    s, host = make(num_blocks=8)
    s.window = WindowBlockRelease(8, BS)
    doc = list(range(100, 124))  # 6 full blocks
    drain(s, host, req("a", doc + [1]))
    keys_a = list(s.pool._block_of)  # the doc's 6 blocks: released on the way, still cached
    assert len(keys_a) == 6
    host.keys = set(keys_a)  # as if saved
    drain(s, host, req("b", list(range(200, 224)) + [2]))  # evicts a's blocks
    assert not any(key in s.pool._block_of for key in keys_a[4:])  # blocks 4 and 5 left the device
    c = req("c", doc + [3])
    s.add(c)
    first = s.schedule()
    assert first.starts == [24] and first.q_lens == [1]
    assert [key for key, _ in first.loads] == keys_a[4:]  # 2 loads, not 6
    assert c.num_released_blocks == s.window.num_outside(24) == 4 and len(c.block_ids) == 7
    assert c.block_hashes == keys_a and len(c.held_block_ids) == 3
    assert s.offload.num_loaded_blocks == 2 and s.offload.host_hit_tokens + s.prefix_cache_hit_tokens >= 24
    for r, _, t in s.update(first, [[7]]):
        r.output_token_ids += t
        s.check_stop(r, t[-1])
    s.pool.check_invariants()
    assert s.pool.num_free == 8
