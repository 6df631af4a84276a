"""KVOffloadPolicy: the host side of the KV tiers below the device pool (host only, no JAX).

Owned by the Scheduler (None when `kv_offload_gb` is unset). It decides, each step, which
device blocks go down to the host tier and which come back up; the worker's KVTierCopier
(worker/kv_tiers.py) moves the bytes. The two only meet through plain callables the engine
hands the policy (`in_host(key) -> bool`), so core/ never imports worker/.

- Saves: the prefix-cache blocks `BlockPool.allocate` evicted while this step was scheduled
  (`BlockPool.evicted`). Their device blocks are rewritten by this step or a later one, so
  the copier gathers them before the step runs. A key the host already holds is not copied
  again (the lookup makes it most recently used).
- Loads: in `Scheduler._admit_waiting`, after the device prefix match stops, the chain of
  block keys goes on through the host tier; the leading full blocks found there get fresh
  device blocks, are copied in before the step, are registered in the prefix cache and count
  as computed tokens.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.request import Request
from pagedjax.core.sched.prefix_cache import block_key


class KVOffloadPolicy:
    def __init__(self, pool: BlockPool, in_host: Callable[[bytes], bool]):
        """in_host(key): whether the host tier holds the block of this key now (a hit is
        made most recently used there)."""
        self.pool = pool
        self.block_size = pool.block_size
        self.in_host = in_host
        pool.evicted = []  # the pool records what allocate evicts from now on
        self.num_saved_blocks = 0  # blocks planned for a device -> host copy
        self.num_save_skipped = 0  # evicted blocks the host already held (no copy)
        self.num_loaded_blocks = 0  # blocks planned for a host -> device copy
        self.host_hit_tokens = 0  # prompt tokens found in the host tier (not recomputed)

    def match(self, req: Request, num_hits: int, next_key: bytes) -> list[bytes]:
        """Keys of req's full blocks after its `num_hits` device hits that the host tier
        holds, in order, stopping at the first miss; next_key: block num_hits's key (the
        device match's). The request's last token is never among them (it is computed)."""
        bs, ids = self.block_size, req.all_token_ids
        limit = min(req.num_tokens - 1, req.num_cacheable_tokens) // bs
        keys: list[bytes] = []
        key = next_key
        for i in range(num_hits, limit):
            if i > num_hits:
                key = req.block_hashes[i] if i < len(req.block_hashes) else \
                    block_key(req, i, key, tuple(ids[i * bs:(i + 1) * bs]))
            if not self.in_host(key):
                break
            keys.append(key)
        return keys

    def admit(self, req: Request, num_hits: int, keys: list[bytes], loads: list[tuple[bytes, int]]) -> None:
        """req was admitted with `keys` loaded from the host into its blocks after its
        `num_hits` device hits (already allocated): registers them in the prefix cache and
        in req's block hashes, and appends (key, device block) to `loads`."""
        bs, ids = self.block_size, req.all_token_ids
        for j, key in enumerate(keys):
            i = num_hits + j
            block = req.block_ids[i]
            self.pool.cache_block(block, key, tuple(ids[i * bs:(i + 1) * bs]))
            loads.append((key, block))
        req.block_hashes = req.block_hashes[:num_hits] + keys
        self.num_loaded_blocks += len(keys)
        self.host_hit_tokens += len(keys) * bs

    def take_saves(self) -> list[tuple[int, bytes]]:
        """(device block, key) of the blocks evicted since the last call that the host tier
        does not hold yet: the copier saves them before the step that rewrites them."""
        evicted, self.pool.evicted = self.pool.evicted, []
        saves = []
        for block, key in evicted:
            if self.in_host(key):
                self.num_save_skipped += 1
            else:
                saves.append((block, key))
        self.num_saved_blocks += len(saves)
        return saves

    def stats(self) -> dict[str, int]:
        return {"kv_offload_saved_blocks": self.num_saved_blocks,
                "kv_offload_save_skipped_blocks": self.num_save_skipped,
                "kv_offload_loaded_blocks": self.num_loaded_blocks,
                "kv_offload_host_hit_tokens": self.host_hit_tokens}
