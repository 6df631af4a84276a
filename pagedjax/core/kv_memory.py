"""KV memory accounting read from the allocator's real state, for both cache backends.

Everything is counted in token rows of KV (one row = K and V of one token in every layer;
bytes = rows * kv_bytes_per_token). Both backends run on a `BlockPool`: paged blocks hold
`block_size` rows; a dense slot is one block of `max_model_len` rows.

capacity         rows in the cache arrays: num_blocks * block_size (dense: slots * max_model_len)
budget           the KV memory budget in rows (kv_cache_memory_gb); the capacity if none given
reserved         rows of the blocks live requests hold (ref count > 0), each block counted once
written          rows of those blocks that hold KV: row j of a request's i-th block is written
                 when i * block_size + j < the request's num_computed_tokens; a block shared by
                 several requests is counted once
internal waste   reserved - written: rows inside a request's allocation that hold nothing.
                 Paged: the unfilled tail of each request's last block (< block_size rows).
                 Dense: every row of the slot past the request's current length.
  reserved_future  the part of the internal waste the request may still fill before it ends
                 (rows below min(prompt + max_tokens, max_model_len)); the rest never holds KV
external waste   rows of the budget that are free yet cannot be given to the next request:
                 the remainder of the budget too small to form one more allocation unit
                 (budget - capacity when that is below one block, paged, or one slot, dense).
                 Inside the pool neither backend has any: all units have one size, so every
                 free block (paged) or free slot (dense) fits whatever request comes next.
                 (A budget the engine left unallocated because of max_num_seqs is not waste.)
free             capacity - reserved (cached prefix blocks nobody holds are free: evicted on demand)
shared           rows in blocks held by more than one request (prefix sharing), stored once
sharing_saved    sum over those blocks of (ref count - 1) * written rows: what the holders would
                 take again without sharing

Identities: reserved == written + internal_waste; capacity == reserved + free.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass


@dataclass(slots=True, frozen=True)
class KVMemory:
    capacity: int
    budget: int
    reserved: int
    written: int
    internal_waste: int
    reserved_future: int
    external_waste: int
    free: int
    shared: int
    sharing_saved: int
    num_requests: int  # requests holding blocks

    @property
    def utilization(self) -> float:
        """Fraction of the budget holding KV."""
        return self.written / self.budget if self.budget else 0.0

    @property
    def reserved_fraction(self) -> float:
        """Fraction of the budget held by requests."""
        return self.reserved / self.budget if self.budget else 0.0

    @property
    def waste_fraction(self) -> float:
        """Of the memory taken from the budget (held by requests, or lost to external
        fragmentation), the fraction that holds no KV: (internal + external) / (reserved + external)."""
        taken = self.reserved + self.external_waste
        return (self.internal_waste + self.external_waste) / taken if taken else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(utilization=self.utilization, reserved_fraction=self.reserved_fraction,
                 waste_fraction=self.waste_fraction)
        return d


def block_fill(pool, requests: Iterable) -> dict[int, int]:
    """Written rows of every block a request in `requests` holds (the fullest holder's view)."""
    bs = pool.block_size
    fill: dict[int, int] = {}
    for req in requests:
        computed = req.num_computed_tokens
        for i, block in enumerate(req.held_block_ids, start=req.num_released_blocks):
            rows = min(bs, max(0, computed - i * bs))
            if rows > fill.get(block, -1):
                fill[block] = rows
    return fill


def kv_memory(pool, requests: Iterable, max_model_len: int, budget_tokens: int | None = None) -> KVMemory:
    """The accounting above for `pool` and the requests holding its blocks (scheduler.running)."""
    requests = [r for r in requests if r.block_ids]
    bs = pool.block_size
    capacity = pool.num_blocks * bs
    held = [b for b, ref in enumerate(pool.ref_counts) if ref > 0]
    fill = block_fill(pool, requests)
    reserved = len(held) * bs
    written = sum(fill.get(b, 0) for b in held)
    future = 0
    for req in requests:
        end = min(req.num_prompt_tokens + req.params.max_tokens, max_model_len)
        future += max(0, min(end, len(req.block_ids) * bs) - req.num_computed_tokens)
    shared_blocks = [b for b in held if pool.ref_counts[b] > 1]
    budget = capacity if budget_tokens is None else budget_tokens
    tail = budget - capacity
    return KVMemory(
        capacity=capacity, budget=budget, reserved=reserved, written=written,
        internal_waste=reserved - written, reserved_future=min(future, reserved - written),
        external_waste=tail if 0 < tail < bs else 0, free=capacity - reserved,
        shared=sum(fill.get(b, 0) for b in shared_blocks),
        sharing_saved=sum((pool.ref_counts[b] - 1) * fill.get(b, 0) for b in shared_blocks),
        num_requests=len(requests))


def block_map(pool, requests: Iterable) -> list[dict]:
    """One entry per block: holders (request ids), written rows, ref count, cached (a free
    block still holding a cached prefix). For pictures of the pool."""
    requests = [r for r in requests if r.block_ids]
    owners: dict[int, list[str]] = {}
    for req in requests:
        for block in req.held_block_ids:
            owners.setdefault(block, []).append(req.request_id)
    fill = block_fill(pool, requests)
    cached = set(getattr(pool, "_hash_of", {}))
    return [{"owners": owners.get(b, []), "rows": fill.get(b, 0), "ref": pool.ref_counts[b],
             "cached": pool.ref_counts[b] == 0 and b in cached} for b in range(pool.num_blocks)]
