"""PrefixCache: the scheduler's view of the prefix cache. It finds a request's leading full
blocks among the pool's cached blocks (chained block hashes), caches the full blocks a step
completes, and tracks the full blocks running requests are computing right now (in flight),
so that a waiting request needing one waits for it instead of computing it too."""
from __future__ import annotations

from pagedjax.core.block_pool import BlockPool, hash_block
from pagedjax.core.request import Request, RequestStatus


def block_key(req: Request, i: int, parent: bytes | None, tokens) -> bytes:
    """The prefix-cache key of req's full block i (`hash_block`): its first block carries the
    request's cache salt and LoRA adapter, the later ones inherit them through the chain."""
    return hash_block(parent, tokens, req.cache_salt, req.lora_key) if i == 0 else hash_block(parent, tokens)


class PrefixCache:
    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.inflight: dict[bytes, Request] = {}  # key of a full block being computed -> the request computing it
        self.inflight_keys: dict[Request, list[bytes]] = {}  # request -> its keys in inflight
        # the disk KV tier's write-through (KVOffloadPolicy; None when off): (block, key) of each
        # full block cache_full_blocks completes, drained by the policy every schedule
        self.written: list[tuple[int, bytes]] | None = None

    def match(self, req: Request) -> tuple[list[int], bytes | None]:
        """Cached blocks covering req's leading full blocks (at least one token left to
        compute), and the key of the full block after them (None: none left to look up)."""
        if not self.pool.enable_prefix_caching or req.needs_every_prompt_position:
            return [], None  # prompt logprobs and mean pooling need every prompt position computed
        hits, parent, bs = [], None, self.block_size
        all_ids = req.all_token_ids
        for i in range(min(req.num_tokens - 1, req.num_cacheable_tokens) // bs):
            tokens = tuple(all_ids[i * bs:(i + 1) * bs])
            h = req.block_hashes[i] if i < len(req.block_hashes) else \
                block_key(req, i, parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                return hits, h
            if i >= len(req.block_hashes):
                req.block_hashes.append(h)
            hits.append(block)
            parent = h
        return hits, None

    def in_flight(self, key: bytes, req: Request) -> bool:
        """Whether another running request is computing the full block with this key now."""
        owner = self.inflight.get(key)
        return owner is not None and owner is not req and owner.status is RequestStatus.RUNNING

    def register(self, req: Request) -> None:
        """Marks the full blocks a just admitted req will compute (after its hits) as in
        flight, so that waiting requests needing them wait for them rather than compute them
        too. Entries go when the block is cached, or all at once when req completes its
        pending tokens, finishes or is preempted."""
        if not self.pool.enable_prefix_caching:
            return
        bs, tokens = self.block_size, req.all_token_ids
        parent = req.block_hashes[-1] if req.block_hashes else None
        keys = []
        for i in range(len(req.block_hashes), req.num_tokens // bs):
            parent = block_key(req, i, parent, tokens[i * bs:(i + 1) * bs])
            if self.inflight.setdefault(parent, req) is req:  # first computing request owns it
                keys.append(parent)
        if keys:
            self.inflight_keys[req] = keys

    def release(self, req: Request) -> None:
        """Drops req's in-flight entries: nobody waits for blocks it no longer computes."""
        for key in self.inflight_keys.pop(req, ()):
            if self.inflight.get(key) is req:
                del self.inflight[key]

    def cache_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        tokens = None
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            tokens = tokens or req.all_token_ids
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_key(req, i, req.block_hashes[-1] if req.block_hashes else None, chunk)
            req.block_hashes.append(h)
            self.pool.cache_block(req.block_ids[i], h, chunk)
            if self.written is not None:
                self.written.append((req.block_ids[i], h))
            if self.inflight.get(h) is req:  # waiters hit it from now on
                del self.inflight[h]
