"""HostKVPool: the host-memory KV tier (LRU over preallocated numpy slots)."""
import numpy as np
import pytest

from pagedjax.worker.kv_block_spec import BlockSpec
from pagedjax.worker.kv_host_pool import GIB, HostKVPool
from kv_blocks import assert_block_equal, block_spec, key, random_block


def _pool(kind="bf16", blocks=3):
    spec = block_spec(kind)
    return HostKVPool(spec, blocks * BlockSpec(spec).block_bytes), spec


@pytest.mark.parametrize("kind", ["bf16", "f32", "int8"])
def test_round_trip_bit_exact(kind):
    pool, spec = _pool(kind)
    rng = np.random.default_rng(0)
    blocks = [random_block(spec, rng) for _ in range(3)]
    for i, b in enumerate(blocks):
        assert pool.put(key(i), b) == []
    for i, b in enumerate(blocks):
        got = pool.get(key(i))
        assert_block_equal(got, b)
        assert not got["k"].flags.writeable  # views into the pool: read-only
    assert pool.get(key(9)) is None
    s = pool.stats()
    assert (s["host_kv_hits"], s["host_kv_misses"], s["host_kv_blocks_stored"]) == (3, 1, 3)
    assert s["host_kv_bytes_in"] == s["host_kv_bytes_out"] == 3 * pool.spec.block_bytes
    pool.check_invariants()


def test_jnp_bfloat16_spec_is_the_numpy_dtype():
    import jax.numpy as jnp
    spec = {"k": ((2, 4), jnp.bfloat16)}
    pool = HostKVPool(spec, 2 * 16)
    assert pool.num_blocks == 2
    pool.put(7, {"k": np.ones((2, 4), jnp.bfloat16)})
    assert pool.get(7)["k"].dtype == np.dtype(jnp.bfloat16)


def test_lru_eviction_order_and_bound():
    pool, spec = _pool("f32", blocks=3)
    rng = np.random.default_rng(1)
    blocks = {c: random_block(spec, rng) for c in "abcde"}
    for c in "abc":
        assert pool.put(c.encode(), blocks[c]) == []
    pool.get(b"a")  # order b, c, a
    assert pool.put(b"d", blocks["d"]) == [b"b"]  # c, a, d
    assert pool.touch(b"c") and not pool.touch(b"b")  # a, d, c
    assert pool.put(b"e", blocks["e"]) == [b"a"]  # d, c, e
    assert pool.keys() == [b"d", b"c", b"e"] and len(pool) == pool.num_blocks == 3
    assert b"a" not in pool and b"b" not in pool
    for c in "dce":  # the evicted blocks' slots were reused without touching the others
        assert_block_equal(pool.get(c.encode()), blocks[c])
    assert pool.num_evicted == 2
    pool.check_invariants()


def test_put_of_a_stored_key_keeps_contents_and_refreshes():
    pool, spec = _pool("f32", blocks=2)
    rng = np.random.default_rng(2)
    a, other, b, c = (random_block(spec, rng) for _ in range(4))
    pool.put(b"a", a)
    pool.put(b"b", b)
    assert pool.put(b"a", other) == []  # same key: same prefix, kept; a becomes most recent
    assert_block_equal(pool.get(b"a"), a)
    assert pool.put(b"c", c) == [b"b"]
    assert pool.num_stored == 3


def test_pop_and_discard_free_slots():
    pool, spec = _pool("int8", blocks=2)
    rng = np.random.default_rng(3)
    a, b, c = (random_block(spec, rng) for _ in range(3))
    pool.put(1, a)
    pool.put(2, b)
    got = pool.pop(1)
    assert_block_equal(got, a)
    assert pool.pop(1) is None and 1 not in pool and pool.num_free == 1
    assert pool.put(3, c) == []  # the popped slot, no eviction
    got["k"][...] = 0  # a copy: the pool is unaffected
    assert_block_equal(pool.get(3), c)
    assert pool.discard(2) and not pool.discard(2)
    pool.clear()
    assert len(pool) == 0 and pool.num_free == 2
    pool.check_invariants()


def test_pinned_blocks_are_never_evicted():
    pool, spec = _pool("f32", blocks=3)
    rng = np.random.default_rng(7)
    blocks = {c: random_block(spec, rng) for c in "abcdefg"}
    pool.put(b"a", blocks["a"], pin=True)  # a swapped-out request's block
    pool.put(b"b", blocks["b"])
    assert pool.pin(b"b") and not pool.pin(b"x")
    pool.put(b"c", blocks["c"])
    assert pool.num_available == 1
    assert pool.put(b"d", blocks["d"]) == [b"c"]  # the only unpinned block goes
    assert pool.put_many([b"e", b"f"], {n: np.stack([blocks["e"][n], blocks["f"][n]]) for n in spec}) == [b"d"]
    assert pool.keys() == [b"f"] and pool.num_dropped == 1  # room for one: the batch's tail
    assert pool.pin(b"f") and pool.num_available == 0
    with pytest.raises(MemoryError, match="all 3 blocks are pinned"):
        pool.put(b"g", blocks["g"])
    for c in "abf":
        assert c.encode() in pool
        assert_block_equal(pool.get(c.encode()), blocks[c])
    assert pool.unpin(b"a") and not pool.unpin(b"a")
    assert pool.put(b"g", blocks["g"]) == [b"a"]
    assert sorted(pool.pinned_keys()) == [b"b", b"f"] and pool.stats()["host_kv_blocks_pinned"] == 2
    assert_block_equal(pool.pop(b"b"), blocks["b"])  # resumed: popped, its slot freed
    assert pool.num_free == 1 and b"b" not in pool
    pool.check_invariants()


def test_put_many_get_many_batches():
    pool, spec = _pool("bf16", blocks=4)
    rng = np.random.default_rng(4)
    batch = random_block(spec, rng, batch=3)
    assert pool.put_many([key(0), key(1), key(2)], batch) == []
    more = random_block(spec, rng, batch=3)
    # key(1) is stored (kept as is), key(5) repeats within the batch (first row wins)
    assert pool.put_many([key(1), key(5), key(5)], more) == []
    assert len(pool) == 4 and pool.num_stored == 4
    found, got = pool.get_many([key(9), key(2), key(5), key(1), key(0)])
    assert found.tolist() == [False, True, True, True, True]
    want = {n: np.stack([batch[n][2], more[n][1], batch[n][1], batch[n][0]]) for n in spec}
    assert_block_equal(got, want)
    found, got = pool.get_many([key(7)])
    assert not found.any() and got["k"].shape == (0, *spec["k"][0])
    # the stored keys are all more recent now except none: evict from the cold end of the LRU
    assert pool.put_many([key(6)], random_block(spec, rng, batch=1)) == [key(2)]
    pool.check_invariants()


def test_put_many_larger_than_pool_keeps_its_tail():
    pool, spec = _pool("f32", blocks=2)
    rng = np.random.default_rng(5)
    pool.put(b"old", random_block(spec, rng))
    batch = random_block(spec, rng, batch=3)
    assert pool.put_many([b"x", b"y", b"z"], batch) == [b"old"]
    assert pool.keys() == [b"y", b"z"] and pool.num_dropped == 1
    assert_block_equal(pool.get(b"z"), {n: batch[n][2] for n in spec})
    pool.check_invariants()


def test_sizes():
    spec = block_spec("int8")
    bb = BlockSpec(spec).block_bytes
    assert bb == 2 * (2 * 3 * 4 * 8 * 1 + 2 * 3 * 4 * 2)  # pages int8 + float16 scales, K and V
    pool = HostKVPool.from_gb(spec, 1e-5)
    assert pool.num_blocks == int(1e-5 * GIB) // bb and pool.capacity_bytes == pool.num_blocks * bb
    assert HostKVPool(spec, 10 * bb, max_blocks=4).num_blocks == 4


def test_clear_errors():
    spec = block_spec("bf16")
    bb = BlockSpec(spec).block_bytes
    with pytest.raises(ValueError, match=f"holds no block: one block takes {bb} bytes"):
        HostKVPool(spec, bb - 1)
    with pytest.raises(ValueError, match="kv_offload_gb"):
        HostKVPool.from_gb(spec, 0)
    with pytest.raises(ValueError, match="non-empty dict"):
        HostKVPool({}, 1 << 20)
    with pytest.raises(ValueError, match="'k'.*dimensions must be >= 1"):
        HostKVPool({"k": ((0, 2), np.float32)}, 1 << 20)
    with pytest.raises(ValueError, match="not a dtype"):
        HostKVPool({"k": ((2,), "no_such_dtype")}, 1 << 20)
    pool = HostKVPool(spec, 2 * bb)
    rng = np.random.default_rng(6)
    good = random_block(spec, rng)
    with pytest.raises(ValueError, match=r"'v': shape \(2, 3, 4, 7\), expected \(2, 3, 4, 8\)"):
        pool.put(1, {**good, "v": np.zeros((2, 3, 4, 7), good["v"].dtype)})
    with pytest.raises(ValueError, match="'k': dtype float32, expected bfloat16"):
        pool.put(1, {**good, "k": good["k"].astype(np.float32)})
    with pytest.raises(ValueError, match=r"missing \['v'\], unexpected \['w'\]"):
        pool.put(1, {"k": good["k"], "w": good["v"]})
    with pytest.raises(ValueError, match=r"'k': shape .*expected \(3, 2, 3, 4, 8\)"):
        pool.put_many([1, 2, 3], random_block(spec, rng, batch=2))
    with pytest.raises(TypeError, match="block key must be bytes"):
        pool.put("abc", good)
    with pytest.raises(ValueError, match="block key must be >= 0"):
        pool.get(-1)
    assert len(pool) == 0 and pool.num_stored == 0  # nothing half-stored
    pool.check_invariants()
