"""Block pool invariants, by hand and under random interleavings (hypothesis)."""
import pytest
from hypothesis import given, settings, strategies as st

from pagedjax.block_pool import BlockPool, hash_block


def test_allocate_free_and_counts():
    pool = BlockPool(4, 16)
    a = pool.allocate(3)
    assert len(set(a)) == 3 and pool.num_free == 1
    with pytest.raises(MemoryError, match="only 1 free"):
        pool.allocate(2)
    pool.free(a[::-1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="freed more often"):
        pool.free([a[0]])
    pool.check_invariants()


def test_cached_blocks_count_as_free_and_are_evicted_lru():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    hashes = []
    parent = None
    for i, b in enumerate(blocks):
        parent = hash_block(parent, (i, i))
        hashes.append(parent)
        pool.cache_block(b, parent, (i, i))
    pool.free(blocks[::-1])  # tail first: the last block is evicted first
    assert pool.num_free == 3 and pool.num_cached == 3
    assert pool.lookup(hashes[0], (0, 0)) == blocks[0]
    assert pool.lookup(hashes[0], (9, 9)) is None  # a hash hit is confirmed on the tokens
    (new,) = pool.allocate(1)
    assert new == blocks[2] and pool.lookup(hashes[2], (2, 2)) is None
    pool.take(blocks[0])  # a hit revives a free cached block
    assert pool.num_free == 1 and pool.ref_counts[blocks[0]] == 1
    pool.check_invariants()


def test_copy_on_write_copies_only_shared_blocks():
    pool = BlockPool(4, 2)
    (a,) = pool.allocate(1)
    assert pool.copy_on_write(a) == a and pool.num_cow_copies == 0
    pool.take(a)  # a fork
    b = pool.copy_on_write(a)
    assert b != a and pool.ref_counts[a] == 1 and pool.ref_counts[b] == 1 and pool.num_cow_copies == 1
    pool.free([a, b])
    with pytest.raises(RuntimeError, match="not held"):
        pool.copy_on_write(a)
    pool.check_invariants()


def test_prefix_caching_off_caches_nothing():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    (b,) = pool.allocate(1)
    pool.cache_block(b, 123, (1, 2))
    assert pool.lookup(123, (1, 2)) is None and pool.num_cached == 0


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "free", "fork", "write", "cache", "lookup"]),
                          st.integers(0, 10 ** 6)), max_size=80))
def test_random_interleavings_keep_invariants(ops):
    pool = BlockPool(8, 4)
    held: list[list[int]] = []  # each entry: the blocks one "request" holds (one ref each)
    for op, x in ops:
        if op == "alloc":
            n = x % 4 + 1
            if n <= pool.num_free:
                held.append(pool.allocate(n))
            else:
                with pytest.raises(MemoryError):
                    pool.allocate(n)
        elif op == "free" and held:
            pool.free(held.pop(x % len(held))[::-1])
        elif op == "fork" and held:  # a new sequence shares all of another's blocks
            owner = held[x % len(held)]
            for b in owner:
                pool.take(b)
            held.append(list(owner))
        elif op == "write" and held:  # copy-on-write before writing one block
            owner = held[x % len(held)]
            i = x % len(owner)
            shared = pool.ref_counts[owner[i]] > 1
            if shared and pool.num_free == 0:
                with pytest.raises(MemoryError):
                    pool.copy_on_write(owner[i])
                continue
            new = pool.copy_on_write(owner[i])
            assert (new != owner[i]) == shared and pool.ref_counts[new] == 1
            owner[i] = new
        elif op == "cache" and held:
            owner = held[x % len(held)]
            b = owner[x % len(owner)]
            pool.cache_block(b, hash_block(None, (x % 7,)), (x % 7,))
        elif op == "lookup":
            b = pool.lookup(hash_block(None, (x % 7,)), (x % 7,))
            if b is not None:
                pool.take(b)
                held.append([b])
        pool.check_invariants()
        refs = [0] * pool.num_blocks
        for blocks in held:
            for b in blocks:
                refs[b] += 1
        assert refs == pool.ref_counts  # every reference accounted for
    for blocks in held:
        pool.free(blocks)
    assert pool.num_free == pool.num_blocks  # nothing leaked
    pool.check_invariants()
