"""The host-memory KV tier: device blocks kept in preallocated numpy storage, LRU by block key.

Storage is one numpy array [num_blocks, *shape] per array of the block spec (`kv_block_spec`),
allocated once (np.empty: the OS commits pages as they are first written; `prefault=True`
populates them in the background instead, see host_memory.py). A map from block
key (the block pool's chained prefix key) to a slot keeps least recently used order; `put`
evicts from its cold end. A pinned block (a preempted request's swapped-out blocks, or blocks
being loaded back) is never evicted until unpinned. The worker moves blocks device <-> host in one batched transfer per
step, so `put_many` / `get_many` take and give arrays stacked [n, ...].

Plain Python/numpy, single-threaded (the engine's step loop owns it).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence

import numpy as np

from pagedjax.worker import host_memory
from pagedjax.worker.kv_block_spec import BlockKey, BlockSpec, SpecInput, check_key

GIB = 1 << 30


class HostKVPool:
    """LRU pool of `capacity_bytes // spec.block_bytes` blocks (at most `max_blocks` if given)."""

    def __init__(self, block_spec: SpecInput | BlockSpec, capacity_bytes: int, max_blocks: int | None = None,
                 prefault: bool = False):
        self.spec = BlockSpec(block_spec)
        if not isinstance(capacity_bytes, (int, np.integer)) or isinstance(capacity_bytes, bool):
            raise TypeError(f"capacity_bytes must be an int, got {type(capacity_bytes).__name__}")
        num_blocks = int(capacity_bytes) // self.spec.block_bytes
        if max_blocks is not None:
            num_blocks = min(num_blocks, int(max_blocks))
        if num_blocks < 1:
            raise ValueError(f"host KV pool of {capacity_bytes} bytes (max_blocks {max_blocks}) holds no block: "
                             f"one block takes {self.spec.block_bytes} bytes ({self.spec})")
        self.num_blocks = num_blocks
        self.storage = {name: np.empty((num_blocks, *shape), dtype) for name, shape, dtype in self.spec.fields}
        self.prefault_thread = host_memory.prefault(list(self.storage.values())) if prefault else None
        self._slot_of: OrderedDict[BlockKey, int] = OrderedDict()  # evictable: key -> slot, least recently used first
        self._pinned: dict[BlockKey, int] = {}  # key -> slot, never evicted
        self._free_slots = list(range(num_blocks - 1, -1, -1))  # pop() hands out slot 0 first
        self.num_stored = 0  # blocks written in
        self.num_evicted = 0  # blocks pushed out by later puts
        self.num_dropped = 0  # blocks of a put_many batch larger than the pool, never stored
        self.num_hits = 0
        self.num_misses = 0
        self.bytes_in = 0
        self.bytes_out = 0

    @classmethod
    def from_gb(cls, block_spec: SpecInput | BlockSpec, kv_offload_gb: float, prefault: bool = False) -> HostKVPool:
        """A pool of `kv_offload_gb` GiB (the engine option's unit, as kv_cache_memory_gb)."""
        if not isinstance(kv_offload_gb, (int, float)) or isinstance(kv_offload_gb, bool) or not kv_offload_gb > 0:
            raise ValueError(f"kv_offload_gb must be a number > 0, got {kv_offload_gb!r}")
        return cls(block_spec, int(kv_offload_gb * GIB), prefault=prefault)

    # -- queries ----------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._slot_of) + len(self._pinned)

    def __contains__(self, key) -> bool:
        key = check_key(key)
        return key in self._slot_of or key in self._pinned

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def num_available(self) -> int:
        """Slots a put can take: free ones and those of unpinned blocks (evicted if needed)."""
        return len(self._free_slots) + len(self._slot_of)

    @property
    def capacity_bytes(self) -> int:
        return self.num_blocks * self.spec.block_bytes

    def keys(self) -> list[BlockKey]:
        """Unpinned stored keys, least recently used first."""
        return list(self._slot_of)

    def pinned_keys(self) -> list[BlockKey]:
        return list(self._pinned)

    def stats(self) -> dict[str, int]:
        return {"host_kv_blocks_total": self.num_blocks, "host_kv_blocks_used": len(self),
                "host_kv_blocks_pinned": len(self._pinned),
                "host_kv_blocks_stored": self.num_stored, "host_kv_blocks_evicted": self.num_evicted,
                "host_kv_blocks_dropped": self.num_dropped, "host_kv_hits": self.num_hits,
                "host_kv_misses": self.num_misses, "host_kv_bytes_in": self.bytes_in,
                "host_kv_bytes_out": self.bytes_out}

    # -- one block --------------------------------------------------------------------------
    def put(self, key, arrays: Mapping[str, np.ndarray], pin: bool = False) -> list[BlockKey]:
        """Stores one block (arrays by name, each of its spec shape and dtype), pinned if `pin`;
        returns the keys evicted to make room. A key already stored keeps its contents (same
        key, same prefix) and only becomes most recently used (and pinned if `pin`). Raises
        MemoryError when every slot holds a pinned block."""
        key = check_key(key)
        arrays = self.spec.check(arrays)
        if self._refresh(key, pin):
            return []
        if not self.num_available:
            raise MemoryError(f"host KV pool: all {self.num_blocks} blocks are pinned")
        evicted: list[BlockKey] = []
        slot = self._take_slot(evicted)
        for name, a in arrays.items():
            self.storage[name][slot] = a
        (self._pinned if pin else self._slot_of)[key] = slot
        self.num_stored += 1
        self.bytes_in += self.spec.block_bytes
        return evicted

    def get(self, key) -> dict[str, np.ndarray] | None:
        """Read-only views of a stored block's arrays (valid until its slot is reused by a later
        put), or None; a hit becomes most recently used."""
        key = check_key(key)
        slot = self._lookup(key)
        if slot is None:
            self.num_misses += 1
            return None
        self.num_hits += 1
        self.bytes_out += self.spec.block_bytes
        out = {}
        for name, store in self.storage.items():
            view = store[slot]
            view.flags.writeable = False
            out[name] = view
        return out

    def touch(self, key) -> bool:
        """Marks a stored block most recently used; False if it is not stored."""
        return self._lookup(check_key(key)) is not None

    def pin(self, key) -> bool:
        """Keeps a stored block from eviction until `unpin`; False if it is not stored."""
        key = check_key(key)
        return self._refresh(key, True)

    def unpin(self, key) -> bool:
        """Makes a pinned block evictable again (most recently used); False if it is not pinned."""
        key = check_key(key)
        slot = self._pinned.pop(key, None)
        if slot is None:
            return False
        self._slot_of[key] = slot
        return True

    def pop(self, key) -> dict[str, np.ndarray] | None:
        """Removes a block and returns copies of its arrays, or None if it is not stored."""
        key = check_key(key)
        slot = self._remove(key)
        if slot is None:
            return None
        out = {name: store[slot].copy() for name, store in self.storage.items()}
        self._free_slots.append(slot)
        self.bytes_out += self.spec.block_bytes
        return out

    def discard(self, key) -> bool:
        """Removes a block without reading it; False if it is not stored."""
        slot = self._remove(check_key(key))
        if slot is None:
            return False
        self._free_slots.append(slot)
        return True

    def clear(self) -> None:
        self._slot_of.clear()
        self._pinned.clear()
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))

    # -- a step's batch ---------------------------------------------------------------------
    def put_many(self, keys: Sequence, stacked: Mapping[str, np.ndarray], pin: bool = False) -> list[BlockKey]:
        """Stores n blocks from arrays stacked [n, ...] in key order (one numpy copy per array),
        pinned if `pin`; returns the keys evicted. Keys already stored (or repeated in the batch)
        keep their contents and become most recently used. A batch with more new keys than
        `num_available` stores its last ones that fit (the rest counted in num_dropped)."""
        keys = [check_key(k) for k in keys]
        stacked = self.spec.check(stacked, batch=len(keys))
        rows, new = [], []
        seen = set()
        for i, key in enumerate(keys):
            if self._refresh(key, pin):
                continue
            if key not in seen:
                seen.add(key)
                rows.append(i)
                new.append(key)
        room = self.num_available
        if len(new) > room:
            self.num_dropped += len(new) - room
            rows, new = rows[len(new) - room:], new[len(new) - room:]
        evicted: list[BlockKey] = []
        slots = []
        for key in new:
            slots.append(self._take_slot(evicted))
            (self._pinned if pin else self._slot_of)[key] = slots[-1]
        if slots:
            src, dst = np.asarray(rows), np.asarray(slots)
            for name, a in stacked.items():
                self.storage[name][dst] = a[src]
        self.num_stored += len(new)
        self.bytes_in += len(new) * self.spec.block_bytes
        return evicted

    def get_many(self, keys: Sequence) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(found [n] bool, arrays stacked [num_found, ...] of the found keys in key order): one
        gather (a fresh array, ready for one host -> device transfer) per array; hits become
        most recently used."""
        keys = [check_key(k) for k in keys]
        found = np.zeros(len(keys), bool)
        slots = []
        for i, key in enumerate(keys):
            slot = self._lookup(key)
            if slot is not None:
                found[i] = True
                slots.append(slot)
        hits = len(slots)
        self.num_hits += hits
        self.num_misses += len(keys) - hits
        self.bytes_out += hits * self.spec.block_bytes
        idx = np.asarray(slots, np.int64)
        return found, {name: store[idx] for name, store in self.storage.items()}

    def _lookup(self, key: BlockKey) -> int | None:
        """The block's slot, or None; an unpinned hit becomes most recently used."""
        slot = self._slot_of.get(key)
        if slot is not None:
            self._slot_of.move_to_end(key)
            return slot
        return self._pinned.get(key)

    def _refresh(self, key: BlockKey, pin: bool) -> bool:
        """For a stored key: made most recently used, and pinned if `pin`; False if not stored."""
        if key in self._pinned:
            return True
        if key not in self._slot_of:
            return False
        if pin:
            self._pinned[key] = self._slot_of.pop(key)
        else:
            self._slot_of.move_to_end(key)
        return True

    def _remove(self, key: BlockKey) -> int | None:
        slot = self._slot_of.pop(key, None)
        if slot is None:
            slot = self._pinned.pop(key, None)
        return slot

    def _take_slot(self, evicted: list[BlockKey]) -> int:
        if self._free_slots:
            return self._free_slots.pop()
        key, slot = self._slot_of.popitem(last=False)
        evicted.append(key)
        self.num_evicted += 1
        return slot

    def check_invariants(self) -> None:
        """Raises AssertionError if slots leak or are shared (for tests)."""
        used = list(self._slot_of.values()) + list(self._pinned.values())
        assert not self._slot_of.keys() & self._pinned.keys(), "a key both pinned and evictable"
        assert len(set(used)) == len(used), "a slot holds two blocks"
        assert not set(used) & set(self._free_slots), "a slot is both used and free"
        assert len(used) + len(self._free_slots) == self.num_blocks, "slots leaked"
