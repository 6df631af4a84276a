"""Block pool invariants, by hand and under random interleavings (hypothesis); prefix-cache keys."""
import hashlib
import os
import struct
import subprocess
import sys

import pytest
from hypothesis import given, settings, strategies as st

from pagedjax.core.block_pool import BlockPool, hash_block


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
    key = hash_block(None, (1, 2))
    pool.cache_block(b, key, (1, 2))
    assert pool.lookup(key, (1, 2)) is None and pool.num_cached == 0


def chain(blocks, salt=None):
    """Keys of consecutive blocks, chained as the scheduler does (salt on the first only)."""
    keys, parent = [], None
    for i, tokens in enumerate(blocks):
        parent = hash_block(parent, tokens, None if i else salt)
        keys.append(parent)
    return keys


def test_key_is_sha256_of_parent_salt_and_tokens():
    """The same bytes in every process (not Python's per-process randomized hash)."""
    tokens = (1, 2, 3, 4)
    first = hash_block(None, tokens)
    assert first == hashlib.sha256(b"\x00" + bytes(8) + struct.pack("<4q", *tokens)).digest()
    assert first.hex() == "9212399fad9fbce28be7482cf37471153f9586cb873b0c2d2310d4958a4c53fc"
    salted = hashlib.sha256(b"\x00" + (3).to_bytes(8, "little") + b"abc" + struct.pack("<4q", *tokens)).digest()
    assert hash_block(None, tokens, "abc") == salted
    child = hash_block(first, (5, 6, 7, 8))
    assert child == hashlib.sha256(b"\x01" + first + bytes(8) + struct.pack("<4q", 5, 6, 7, 8)).digest()
    assert len(child) == 32
    code = ("from pagedjax.core.block_pool import hash_block\n"
            "print(hash_block(hash_block(None, (1, 2, 3, 4)), (5, 6, 7, 8)).hex())")
    for seed in ("1", "2"):
        other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                               env={**os.environ, "PYTHONHASHSEED": seed}).stdout.strip()
        assert other == child.hex()


def test_equal_prefixes_equal_keys_and_any_earlier_token_changes_the_key():
    blocks = [tuple(range(i * 16, (i + 1) * 16)) for i in range(4)]
    keys = chain(blocks)
    assert chain([list(b) for b in blocks]) == keys and len(set(keys)) == 4
    for b in range(4):
        for j in range(16):
            changed = [list(t) for t in blocks]
            changed[b][j] += 1
            other = chain(changed)
            assert other[:b] == keys[:b]  # blocks before the change keep their keys
            assert all(x != y for x, y in zip(other[b:], keys[b:]))  # it and every later block differ


def test_salts_separate_keys():
    tokens = tuple(range(16))
    salts = ["a", "b", "ab", "a\x00", " ", "\u00e9", "0" * 100]
    keys = {salt: chain([tokens, tokens], salt) for salt in salts}
    unsalted = chain([tokens, tokens])
    assert chain([tokens, tokens], "") == unsalted  # "" is no salt, as None
    for k in keys.values():
        assert k[0] != unsalted[0] and k[1] != unsalted[1]  # the salt carries on down the chain
    assert len({k[1] for k in keys.values()}) == len(salts)


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
