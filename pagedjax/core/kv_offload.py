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
- Disk (kv_offload_dir): every full block the prefix cache completes (`PrefixCache.written`)
  is written through (`take_writes`); the key chain goes on from the host tier to the disk
  tier (`on_disk(keys)`: the copier reads and verifies up to DISK_RUN files at once, now; a
  corrupt one is a miss), and disk hits load like host hits. Without a host tier
  (kv_offload_gb unset) nothing is saved on eviction: the disk holds every computed block.
- Swap (a host tier): a preempted request's computed blocks go to the host under fresh int
  keys, pinned, when the host has room for all of them (`swap_out`), and are loaded back when
  it resumes instead of recomputed (`resume`, `admit`); no room: recompute, as without tiers.
  The gather of a swap runs at this step's dispatch; the next `begin` has the copier store it
  (`flush`), so a resumed request always finds its blocks in the host.
"""
from __future__ import annotations

from collections.abc import Callable

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.sched.prefix_cache import PrefixCache, block_key

DISK_RUN = 64  # blocks a match asks the disk tier for at once (read in parallel)


class KVOffloadPolicy:
    def __init__(self, pool: BlockPool, in_host: Callable[[bytes], bool] | None,
                 prefix: PrefixCache | None = None, on_disk: Callable[[list[bytes]], int] | None = None):
        """in_host(key): whether the host tier holds the block of this key now (a hit is
        made most recently used there); None: no host tier. on_disk(keys): how many of the
        leading keys the disk tier has (read and verified now, held for this step's load);
        None: no disk tier, else `prefix` (the scheduler's PrefixCache) records the blocks
        to write through."""
        self.pool = pool
        self.block_size = pool.block_size
        self.in_host = in_host
        self.on_disk = on_disk
        self.prefix = prefix
        if in_host is not None:
            pool.evicted = []  # the pool records what allocate evicts from now on
        if on_disk is not None:
            prefix.written = []  # the prefix cache records the blocks it completes from now on
        self._from_disk: set[bytes] = set()  # keys match found on disk this schedule
        self.num_saved_blocks = 0  # blocks planned for a device -> host copy
        self.num_save_skipped = 0  # evicted blocks the host already held (no copy)
        self.num_loaded_blocks = 0  # blocks planned for a host or disk -> device copy
        self.host_hit_tokens = 0  # prompt tokens found in the host tier (not recomputed)
        self.disk_hit_tokens = 0  # prompt tokens found in the disk tier (not recomputed)
        self.num_write_blocks = 0  # blocks planned for a device -> disk copy
        # swap preemption (host tier): the copier's views, set by it (None: no swap)
        self.swap_room: Callable[[], int] | None = None  # host slots pinned puts can take now
        self.drop_swaps: Callable[[list[int]], None] | None = None  # frees swap keys (stored or in flight)
        self.flush: Callable[[], None] | None = None  # stores the gathers in flight in the host now
        self.swapped: dict[Request, tuple[list[int], int]] = {}  # preempted request -> (its swap keys, computed tokens)
        self._next_swap_key = 0
        self.planned_swaps: list[tuple[int, int]] = []  # (device block, swap key) planned this schedule
        self._swapped_now: set[Request] = set()  # requests swapped out this schedule (blocks not on the host yet)
        self._swaps_in_flight = False
        self.num_swapped_out_blocks = 0
        self.num_swapped_in_blocks = 0
        self.num_swap_fallbacks = 0  # preemptions recomputed: the host had no room

    def match(self, req: Request, num_hits: int, next_key: bytes) -> list[bytes]:
        """Keys of req's full blocks after its `num_hits` device hits that the host or disk
        tier holds, in order, stopping at the first block neither has; next_key: block
        num_hits's key (the device match's). The request's last token is never among them
        (it is computed). At a host miss the disk is asked for a run of up to DISK_RUN keys
        at once (read together; a block both tiers hold inside a run comes from disk)."""
        bs, ids = self.block_size, req.all_token_ids
        limit = min(req.num_tokens - 1, req.num_cacheable_tokens) // bs

        def key_at(i: int, prev: bytes) -> bytes:
            return req.block_hashes[i] if i < len(req.block_hashes) else \
                block_key(req, i, prev, tuple(ids[i * bs:(i + 1) * bs]))

        keys: list[bytes] = []
        i, key, ask_disk = num_hits, next_key, self.on_disk is not None
        while i < limit:
            if self.in_host is not None and self.in_host(key):
                keys.append(key)
                i += 1
                ask_disk = self.on_disk is not None
            elif not ask_disk:  # neither tier has it
                break
            else:  # up to DISK_RUN blocks from here read from disk together
                run = [key]
                while len(run) < DISK_RUN and i + len(run) < limit:
                    run.append(key_at(i + len(run), run[-1]))
                found = self.on_disk(run)
                keys += run[:found]
                self._from_disk.update(run[:found])
                i += found
                if found < len(run):  # the disk lacks run[found]: the host may still have it
                    if found == 0:
                        break
                    key, ask_disk = run[found], False
                    continue
            if i < limit:
                key = key_at(i, keys[-1])
        return keys

    def admit(self, req: Request, num_hits: int, keys: list, loads: list[tuple[bytes, int]], skip: int = 0) -> None:
        """req was admitted with `keys` loaded from the host into its blocks after its
        `num_hits` device hits (already allocated): registers them in the prefix cache and
        in req's block hashes, and appends (key, device block) to `loads`. skip: req's leading
        blocks outside its sliding window (released): those keys only go in its block hashes
        (neither loaded nor cached; they count as hit tokens, not recomputed). A resumed swapped
        request (keys from `resume`): its swap keys are loaded (those its hits cover dropped),
        its blocks are cached by the prefix cache after its next step."""
        if req in self.swapped:
            swap_keys, _ = self.swapped.pop(req)
            for j, key in enumerate(keys):
                loads.append((key, req.block_ids[num_hits + j]))
            self.drop_swaps([k for k in swap_keys if k not in keys])
            self.num_swapped_in_blocks += len(keys)
            return
        bs, ids = self.block_size, req.all_token_ids
        for j, key in enumerate(keys):
            i = num_hits + j
            if i < skip:
                continue
            block = req.block_ids[i]
            self.pool.cache_block(block, key, tuple(ids[i * bs:(i + 1) * bs]))
            loads.append((key, block))
        req.block_hashes = req.block_hashes[:num_hits] + keys
        disk = sum(key in self._from_disk for key in keys)
        self.num_loaded_blocks += len(keys) - max(0, min(skip - num_hits, len(keys)))
        self.host_hit_tokens += (len(keys) - disk) * bs
        self.disk_hit_tokens += disk * bs

    # -- swap preemption -------------------------------------------------------------------
    def begin(self) -> None:
        """At the start of a schedule: the swaps gathered at the last dispatch go to the host
        now (pinned), so that a request resuming in this schedule finds its blocks there."""
        if self._swaps_in_flight:
            self._swaps_in_flight = False
            self.flush()

    def swap_out(self, req: Request) -> bool:
        """req is being preempted: plans the copy of its computed blocks to the host under new
        swap keys (pinned) and keeps its computed tokens; False (recompute) when there is no
        host tier or no room for all of them."""
        n = -(-req.num_computed_tokens // self.block_size)
        if self.swap_room is None or n == 0 or req.num_released_blocks or req.needs_every_prompt_position:
            return False  # (prompt logprobs, mean pooling: their outputs come from recomputing the prompt)
        if n > self.swap_room():
            self.num_swap_fallbacks += 1
            return False
        keys = list(range(self._next_swap_key, self._next_swap_key + n))
        self._next_swap_key += n
        self.planned_swaps += zip(req.block_ids[:n], keys)
        self.swapped[req] = (keys, req.num_computed_tokens)
        self._swapped_now.add(req)
        self.num_swapped_out_blocks += n
        return True

    def resume(self, req: Request, num_hits: int):
        """For a waiting request: None if it is not swapped out; "wait" if its blocks go to the
        host only at this step's dispatch; else (swap keys to load after its num_hits device
        hits, the token it starts at)."""
        entry = self.swapped.get(req)
        if entry is None or req.status is not RequestStatus.PREEMPTED:
            return None
        if req in self._swapped_now:
            return "wait"
        keys, computed = entry
        if num_hits * self.block_size >= computed:  # the device's cached prefix covers it all
            return [], num_hits * self.block_size
        return keys[num_hits:], computed

    def forget(self, req: Request) -> None:
        """req ended (finished or aborted): its swapped blocks, if any, are dropped."""
        entry = self.swapped.pop(req, None)
        if entry is not None:
            self.drop_swaps(entry[0])

    def forget_all(self) -> None:
        """The host tier was cleared (reset, new weights): swapped requests recompute."""
        for req in self.swapped:
            req.num_computed_tokens = 0
        self.swapped.clear()
        self.planned_swaps, self._swapped_now = [], set()

    def take_saves(self) -> list[tuple[int, bytes | int]]:
        """(device block, key) of the blocks evicted since the last call that the host tier
        does not hold yet, then the swaps planned this schedule (int keys, stored pinned): the
        copier saves them before the step that rewrites them."""
        self._from_disk.clear()  # called once per schedule, after its matches and admissions
        if self.in_host is None:
            return []
        swaps, self.planned_swaps, self._swapped_now = self.planned_swaps, [], set()
        self._swaps_in_flight |= bool(swaps)
        evicted, self.pool.evicted = self.pool.evicted, []
        saves = []
        for block, key in evicted:
            if self.in_host(key):
                self.num_save_skipped += 1
            else:
                saves.append((block, key))
        self.num_saved_blocks += len(saves)
        return saves + swaps

    def take_writes(self) -> list[tuple[int, bytes]]:
        """(device block, key) of the full blocks completed since the last call (by steps
        already dispatched): the copier writes them through to the disk tier. [] without one."""
        if self.on_disk is None:
            return []
        writes, self.prefix.written = self.prefix.written, []
        self.num_write_blocks += len(writes)
        return writes

    def stats(self) -> dict[str, int]:
        out = {"kv_offload_saved_blocks": self.num_saved_blocks,
               "kv_offload_save_skipped_blocks": self.num_save_skipped,
               "kv_offload_loaded_blocks": self.num_loaded_blocks,
               "kv_offload_host_hit_tokens": self.host_hit_tokens}
        if self.swap_room is not None:
            out.update(kv_offload_swapped_out_blocks=self.num_swapped_out_blocks,
                       kv_offload_swapped_in_blocks=self.num_swapped_in_blocks,
                       kv_offload_swap_fallbacks=self.num_swap_fallbacks)
        if self.on_disk is not None:
            out.update(kv_offload_disk_hit_tokens=self.disk_hit_tokens, kv_offload_written_blocks=self.num_write_blocks)
        return out
