"""The KV block pool: fixed-size blocks, reference counts, a free list and the prefix cache.

Pure Python/numpy; no JAX. A block is *free* when no live request holds it (ref count 0).
A free block may still hold a cached prefix (it has a hash): it is handed out again only
when the pool needs it, least recently freed first, and its cache entry is dropped then.
"""
from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None,
               adapter_key: str | None = None) -> bytes:
    """Chained prefix-cache key of a full block: sha256 (32 bytes) over the parent block's key,
    the salt, the LoRA adapter and the block's token ids, so equal keys mean equal prefixes up
    to and including this block (and equal salts and adapters), the same in every process.
    Callers pass the request's `cache_salt` and `lora_key` for its first block only (the chain
    carries them on); None and "" are none.

    Input bytes: a tag (0: first block, 1: followed by the 32-byte parent key, 2: first block,
    followed by the adapter key's UTF-8 length (8 bytes) and bytes), the salt's UTF-8 length
    (8 bytes) and bytes, then the token ids as little-endian int64: no two inputs serialize
    alike."""
    salt = cache_salt.encode() if cache_salt else b""
    head = b"\x00" if parent_hash is None else b"\x01" + parent_hash
    if adapter_key:
        if parent_hash is not None:
            raise ValueError("the adapter key goes into a request's first block only")
        key = adapter_key.encode()
        head = b"\x02" + len(key).to_bytes(8, "little") + key
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    return hashlib.sha256(head + len(salt).to_bytes(8, "little") + salt + tokens).digest()


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))  # LRU order
        self._hash_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}  # block -> (key, token ids)
        self._block_of: dict[bytes, int] = {}  # key -> block
        self.num_evictions = 0
        # (block, key) of each cached block `allocate` evicts, for a KV tier below the pool to
        # save before the block is rewritten (core/kv_offload.py drains it); None: not recorded
        self.evicted: list[tuple[int, bytes]] | None = None
        self.num_cow_copies = 0

    # -- counts ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks no live request holds (cached prefix blocks included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    # -- allocation -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Takes n free blocks (ref count 1 each), evicting least recently freed cache entries."""
        if n > len(self._free):
            raise MemoryError(f"asked for {n} KV blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._uncache(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def take(self, block: int) -> None:
        """Adds a reference to a block (a prefix-cache hit or a fork)."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        """Drops one reference from each block; blocks reaching zero become free.

        Pass a request's blocks in reverse so its tail blocks are evicted before its prefix.
        """
        for block in blocks:
            if self.ref_counts[block] <= 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def copy_on_write(self, block: int) -> int:
        """Makes a held block safe to write: returns it unchanged if this is its only holder,
        else a fresh block (the caller copies the contents) and drops one reference of the old."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} is not held; cannot write it")
        if self.ref_counts[block] == 1:
            return block
        (new,) = self.allocate(1)
        self.free([block])
        self.num_cow_copies += 1
        return new

    # -- prefix cache ---------------------------------------------------------------------
    def cache_block(self, block: int, block_hash: bytes, token_ids: tuple[int, ...]) -> None:
        """Registers a full block under its chained key (`hash_block`; first writer wins)."""
        if not self.enable_prefix_caching or block_hash in self._block_of or block in self._hash_of:
            return
        self._block_of[block_hash] = block
        self._hash_of[block] = (block_hash, token_ids)

    def lookup(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The cached block for this key, or None. The key covers the whole prefix; the
        token ids of the block itself are compared too (cheap, a second check)."""
        if not self.enable_prefix_caching:
            return None
        block = self._block_of.get(block_hash)
        if block is None or self._hash_of[block][1] != token_ids:
            return None
        return block

    def _uncache(self, block: int) -> None:
        entry = self._hash_of.pop(block, None)
        if entry is not None:
            del self._block_of[entry[0]]
            self.num_evictions += 1
            if self.evicted is not None:
                self.evicted.append((block, entry[0]))

    def reset_prefix_cache(self) -> None:
        self._hash_of.clear()
        self._block_of.clear()
        if self.evicted is not None:  # not saved below the pool either
            self.evicted.clear()

    def check_invariants(self) -> None:
        """Raises AssertionError if the pool's bookkeeping is inconsistent (for tests)."""
        assert all(r >= 0 for r in self.ref_counts), "negative reference count"
        free = set(self._free)
        assert len(free) == len(self._free)
        for b in range(self.num_blocks):
            assert (b in free) == (self.ref_counts[b] == 0), f"block {b} free-list/ref-count mismatch"
        assert len(self._block_of) == len(self._hash_of)
        for h, b in self._block_of.items():
            assert self._hash_of[b][0] == h
