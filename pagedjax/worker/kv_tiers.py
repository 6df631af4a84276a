"""KVTierCopier: the device <-> host copies of the KV tiers (owned by the engine, called by the
ModelRunner's `dispatch`, the one place, right before the copy-on-write copies).

Each step's SchedulerOutput names the blocks to move (core/kv_offload.py decides which):
`saves` (device block, key): prefix blocks the device pool evicted, gathered before the step
that rewrites them; `loads` (key, device block): host hits, scattered in before the step that
reads them. One jitted gather and one jitted, donated scatter per step at most, over every
layer at once, their block counts padded to powers of two so the compiled shapes stay few
(the warm-up compiles them all: `compile_shapes`).
A gather's result starts its copy to the host at once and is stored in the HostKVPool at the
next step's dispatch (the device has run it by then); until then its keys count as missing.

The device pool is `[Hkv, L * NB, BS, D]` per K and V (an 8-bit pool: pages and float16
scales `[Hkv, L * NB, BS]`), layer l's block b at `l * NB + b`; a host block is the gather of
those rows for every l: `[Hkv, L, BS, D]` (scales `[Hkv, L, BS]`), see kv_block_spec.py. Under
tensor parallelism the gather and scatter run on the sharded pool (XLA moves each head shard);
the host holds every head.

The disk tier (`kv_offload_dir`, a DiskKVStore): `writes` (device block, key) are full blocks
computed by steps already dispatched; they join the step's gather and, at the next dispatch,
go to the store's writer thread (atomic files written in the background). Disk hits are read
and verified while the scheduler matches, a run of a prompt's blocks at once on the store's
reader threads (`fetch`: a corrupt file is a miss, never a wrong load), and staged in memory
until their load. `close` (LLM.close, the server's
shutdown) writes the blocks completed since the last step and waits for the writer.
"""
from __future__ import annotations

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.kv_offload import KVOffloadPolicy
from pagedjax.pallas_kernels.paged_attention import cpu_native
from pagedjax.parallel.distributed import is_multiprocess
from pagedjax.pallas_kernels.paged_attention.ops import write_kv
from pagedjax.worker.kv_block_spec import BlockSpec
from pagedjax.worker.kv_disk_identity import disk_key_fields
from pagedjax.worker.kv_disk_store import DiskKVStore
from pagedjax.worker.kv_host_pool import HostKVPool

GIB = 1 << 30
MAX_PENDING_DISK_WRITES = 256  # blocks queued for the writer thread; more are dropped (recomputed later)


def padded(n: int) -> int:
    """The power of two >= n that a batch of n blocks is padded to (at least 1)."""
    return 1 << max(n - 1, 0).bit_length()


def pool_leaves(kv) -> tuple[list[str], list]:
    """The pool's arrays with their block-spec names: k, v, or with an 8-bit pool k, k_scales,
    v, v_scales (QuantizedPages' data and scales)."""
    names = []
    for side, part in zip(("k", "v"), kv):
        leaves = jax.tree.leaves(part)
        names += [side] if len(leaves) == 1 else [side, f"{side}_scales"]
    return names, jax.tree.leaves(tuple(kv))


def block_spec(kv, num_layers: int) -> dict:
    """The host block spec of the pool `kv`: name -> ((Hkv, L, *rest), dtype)."""
    names, leaves = pool_leaves(kv)
    return {n: ((x.shape[0], num_layers, *x.shape[2:]), np.dtype(x.dtype)) for n, x in zip(names, leaves)}


def _rows(blocks, num_layers: int, nb: int):
    """Pool rows [L, n] of blocks [n] in every layer: block g = r * NB + b is data rank r's
    block b (rank r's pool follows rank r - 1's on the block axis: row r * L * NB + l * NB + b)."""
    layers = jnp.arange(num_layers, dtype=jnp.int32)[:, None] * nb
    return (blocks // nb * (num_layers * nb) + blocks % nb)[None, :] + layers


def gather_blocks(leaves: list, blocks, num_layers: int, num_ranks: int = 1) -> list:
    """Blocks [n] (r * NB + b) of every layer -> per leaf [n, Hkv, L, ...] (one gather per leaf)."""
    rows = _rows(blocks, num_layers, leaves[0].shape[1] // (num_layers * num_ranks))  # [L, n]
    return [jnp.moveaxis(x[:, rows], 2, 0) for x in leaves]


def scatter_blocks(leaves: list, blocks, values: list, num_layers: int, num_ranks: int = 1) -> list:
    """Writes values (per leaf [n, Hkv, L, ...]) into blocks [n] (r * NB + b) of every layer;
    entries with blocks >= num_ranks * NB (padding) are dropped."""
    total = leaves[0].shape[1]
    rows = _rows(blocks, num_layers, total // (num_layers * num_ranks))
    rows = jnp.where(blocks[None, :] < total // num_layers, rows, total)  # [L, n]; out of range: dropped
    return [x.at[:, rows].set(jnp.moveaxis(v, 0, 2).astype(x.dtype), mode="drop") for x, v in zip(leaves, values)]


def scatter_blocks_native(leaves: list, blocks, values: list, num_layers: int, num_ranks: int = 1) -> list:
    """scatter_blocks for a bfloat16 pool on the CPU (k and v, no scales), in place: the
    blocks' rows written as tokens through the native KV write (`ops.write_kv`), since XLA:CPU
    widens a bf16 scatter to f32 over the whole pool (~1.4 s a step on a 740 MB pool)."""
    k_pages, v_pages = leaves
    total, bs = k_pages.shape[1], k_pages.shape[2]
    rows = _rows(blocks, num_layers, total // (num_layers * num_ranks))  # [L, n]
    slots = rows[:, :, None] * bs + jnp.arange(bs, dtype=jnp.int32)  # [L, n, BS]
    slots = jnp.where(blocks[None, :, None] < total // num_layers, slots, -1).reshape(-1)  # padding: dropped

    def tokens(v):  # [n, Hkv, L, BS, D] -> [L * n * BS, Hkv, D], in the order of slots
        return jnp.transpose(v, (2, 0, 3, 1, 4)).reshape(-1, v.shape[1], v.shape[4])

    return list(write_kv(k_pages, v_pages, tokens(values[0]), tokens(values[1]), slots))


class KVTierCopier:
    """Owns the host tier (HostKVPool of `kv_offload_gb` GiB; None: none) and the disk tier
    (`disk`, a DiskKVStore; None: none) and moves blocks to and from the device pool `kv` (the
    runner's, for its layout: the arrays it gets later are the runner's own)."""

    def __init__(self, kv, num_layers: int, kv_offload_gb: float | None, num_ranks: int = 1,
                 disk: tuple[str, float, dict] | None = None):
        """num_ranks: data-parallel ranks, each its own pool of NB blocks (their tiers are shared:
        keys are content keys). disk: (folder, size bound in GiB, key fields) of the disk tier."""
        self.num_layers = num_layers
        self.names, leaves = pool_leaves(kv)
        self.num_blocks = leaves[0].shape[1] // (num_layers * num_ranks)  # NB, per rank
        self.num_ranks = num_ranks
        spec = block_spec(kv, num_layers)
        self.block_bytes = BlockSpec(spec).block_bytes
        self._fields = spec  # name -> (shape, dtype) of one block
        self.host = HostKVPool.from_gb(spec, kv_offload_gb, prefault=True) if kv_offload_gb is not None else None
        self.disk = None
        if disk is not None:
            folder, disk_gb, key_fields = disk
            self.disk = DiskKVStore(folder, int(disk_gb * GIB), key_fields, spec,
                                    max_pending_writes=MAX_PENDING_DISK_WRITES)
        self.disk_writable = self.disk is not None  # False after close(): reads only
        self._staged: dict[bytes, dict] = {}  # disk hits read by fetch, waiting for their load
        self._dropped_swaps: set[int] = set()  # swap keys dropped while their gather was in flight
        self.policies: list[KVOffloadPolicy] = []  # one per data rank, in rank order
        self._treedef = jax.tree.structure(tuple(kv))
        shardings = [x.sharding for x in leaves]
        self._gather = jax.jit(lambda leaves, blocks: gather_blocks(leaves, blocks, num_layers, num_ranks))
        # bf16 on the CPU, one device: the native in-place write (a plain scatter copies the pool)
        native = (len(leaves) == 2 and cpu_native.native_write_supported(leaves[0].dtype)
                  and len(leaves[0].sharding.device_set) == 1)
        scatter = scatter_blocks_native if native else scatter_blocks
        self._scatter = jax.jit(lambda leaves, blocks, values: scatter(leaves, blocks, values, num_layers, num_ranks),
                                donate_argnums=(0,), out_shardings=shardings)
        # gathers in flight: (save keys (prefix keys, int swap keys), write keys, gathered [n_pad, ...] on device)
        self._pending: list[tuple[list, list[bytes], list]] = []
        self._shapes: set[tuple[str, int]] = set()  # (gather / scatter, padded n) compiled so far
        self.num_saves = self.num_loads = 0  # batched copies run
        self.bytes_saved = self.bytes_loaded = 0
        self.num_writes = 0  # blocks gathered for the disk tier
        self.copy_seconds = 0.0  # host time in this object: reading back, host pool copies, launches

    def in_host(self, key: bytes) -> bool:
        """Whether the host tier holds this key (a hit becomes most recently used there)."""
        return self.host.touch(key)

    def fetch(self, keys: list[bytes]) -> int:
        """How many of the leading keys the disk tier has: their files are read and verified
        now (on the store's reader threads at once) and staged for a load; a missing or
        corrupt file ends the run (its block and the rest are recomputed)."""
        staged = next((i for i, key in enumerate(keys) if key not in self._staged), len(keys))
        if staged == len(keys) or self.disk is None:  # self.disk None: dropped (new weights)
            return staged
        blocks = self.disk.read_run(keys[staged:])
        self._staged.update(zip(keys[staged:], blocks))
        return staged + len(blocks)

    def policy(self, pool, prefix=None) -> KVOffloadPolicy:
        """The scheduler's policy over `pool` (a BlockPool) and `prefix` (its PrefixCache: the
        disk tier's write-through), reading these tiers; kept in `policies` (one per rank)."""
        policy = KVOffloadPolicy(pool, self.in_host if self.host is not None else None, prefix,
                                 self.fetch if self.disk is not None else None)
        if self.host is not None:  # swap preemption
            policy.swap_room, policy.drop_swaps, policy.flush = self.swap_room, self.drop_swaps, self.flush
        self.policies.append(policy)
        return policy

    def swap_room(self) -> int:
        """Host slots that pinned puts can take now, less the swaps planned (every rank's) or
        whose gather is in flight."""
        in_flight = sum(isinstance(k, int) and k not in self._dropped_swaps
                        for saves, _, _ in self._pending for k in saves)
        return self.host.num_available - in_flight - sum(len(p.planned_swaps) for p in self.policies)

    def drop_swaps(self, keys: list[int]) -> None:
        """Frees swap keys: stored ones now, those still in flight when their gather lands."""
        for key in keys:
            if not self.host.discard(key):
                self._dropped_swaps.add(key)

    def apply(self, kv, outs) -> tuple[object, bool]:
        """Runs the step's saves and loads on the pool `kv` (before its copy-on-write copies
        and the step); returns (the new pool, whether a copy compiled now). outs: the step's
        SchedulerOutputs (one per data rank; None: idle)."""
        nb = self.num_blocks  # rank r's block b is r * NB + b below
        saves = [(r * nb + b, key) for r, out in enumerate(outs) if out is not None for b, key in out.saves]
        loads = [(key, r * nb + b) for r, out in enumerate(outs) if out is not None for key, b in out.loads]
        writes = [(r * nb + b, key) for r, out in enumerate(outs) if out is not None for b, key in out.writes] \
            if self.disk_writable else []
        if not (saves or loads or writes or self._pending):
            return kv, False
        began = time.perf_counter()
        compiled = False
        values = None
        if loads:  # read before the puts below, which could evict the keys to load
            values = self._load_values([key for key, _ in loads])
        self._store_pending()
        _, leaves = pool_leaves(kv)
        if saves or writes:  # before the loads: a load's block may be one this step evicted
            compiled |= self._start_gather(leaves, saves, writes)
        if loads:
            n = padded(len(loads))
            blocks = np.full(n, self.num_ranks * nb, np.int32)  # padding: dropped
            blocks[:len(loads)] = [b for _, b in loads]
            compiled |= self._compiling("scatter", n)
            leaves = self._scatter(leaves, blocks, values)
            kv = jax.tree.unflatten(self._treedef, leaves)
            self.num_loads += 1
            self.bytes_loaded += len(loads) * self.block_bytes
        while len(self._staged) > self.num_blocks:  # disk hits of requests that were not admitted
            del self._staged[next(iter(self._staged))]
        self.copy_seconds += time.perf_counter() - began
        return kv, compiled

    def _load_values(self, keys: list[bytes]) -> list[np.ndarray]:
        """The blocks of keys (staged disk hits, else host hits) stacked per leaf [n_pad, ...]."""
        values = [np.zeros((padded(len(keys)), *self._fields[name][0]), self._fields[name][1]) for name in self.names]
        from_host = [i for i, key in enumerate(keys) if key not in self._staged]
        if from_host:
            found, stacked = self.host.get_many([keys[i] for i in from_host]) if self.host is not None else \
                (np.zeros(len(from_host), bool), None)
            if not found.all():
                raise RuntimeError(f"{int((~found).sum())} KV blocks planned for loading left the host tier")
            for v, name in zip(values, self.names):
                v[from_host] = stacked[name]
            for i in from_host:  # a swapped request's blocks: read once, freed now
                if isinstance(keys[i], int):
                    self.host.discard(keys[i])
        for i, key in enumerate(keys):
            arrays = self._staged.get(key)
            if arrays is not None:
                for v, name in zip(values, self.names):
                    v[i] = arrays[name]
        for key in keys:  # after the loop: two data ranks may load the same key
            self._staged.pop(key, None)
        return values

    def _start_gather(self, leaves: list, saves: list, writes: list) -> bool:
        """Gathers the blocks of saves (for the host tier) and writes (for the disk tier) in
        one jitted gather, starts their copy to the host; True if its shape compiled now."""
        n = padded(len(saves) + len(writes))
        blocks = np.zeros(n, np.int32)
        blocks[:len(saves) + len(writes)] = [b for b, _ in saves] + [b for b, _ in writes]
        compiled = self._compiling("gather", n)
        gathered = self._gather(leaves, blocks)
        for x in gathered:
            x.copy_to_host_async()
        self._pending.append(([key for _, key in saves], [key for _, key in writes], gathered))
        self.num_saves += bool(saves)
        self.num_writes += len(writes)
        return compiled

    def compile_shapes(self, kv) -> None:
        """Compiles (ahead of time, nothing run) the gather and the scatter for every padded
        batch a step can move: loads up to a pool's blocks, saves and writes up to three (an
        eviction, a swap and a write-through may name the same block), per rank; the warm-up's."""
        _, leaves = pool_leaves(kv)
        specs = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) for x in leaves]
        total = self.num_blocks * self.num_ranks
        for kind, top in (("gather", padded(3 * total)), ("scatter", padded(total))):
            n = 1
            while n <= top:
                if self._compiling(kind, n):
                    blocks = jax.ShapeDtypeStruct((n,), np.int32)
                    if kind == "gather":
                        self._gather.lower(specs, blocks).compile()
                    else:
                        values = [jax.ShapeDtypeStruct((n, *self._fields[name][0]), self._fields[name][1])
                                  for name in self.names]
                        self._scatter.lower(specs, blocks, values).compile()
                n *= 2

    def _compiling(self, kind: str, n: int) -> bool:
        new = (kind, n) not in self._shapes
        self._shapes.add((kind, n))
        return new

    def _store_pending(self) -> None:
        """Stores the gathers of earlier steps in the host pool and queues them for the disk
        tier (waits for them if need be); evicted blocks go to disk too (skipped there when
        stored already; a write-through may have been dropped)."""
        for saves, writes, gathered in self._pending:
            arrays = {name: np.asarray(x)[:len(saves) + len(writes)] for name, x in zip(self.names, gathered)}
            swaps = [i for i, k in enumerate(saves) if isinstance(k, int) and k not in self._dropped_swaps]
            self._dropped_swaps.difference_update(k for k in saves if isinstance(k, int))
            if swaps:  # pinned first: swap_room kept room for them; the prefix blocks may be evicted
                self.host.put_many([saves[i] for i in swaps], {name: a[swaps] for name, a in arrays.items()}, pin=True)
            prefix = [i for i, k in enumerate(saves) if not isinstance(k, int)]
            if prefix:
                self.host.put_many([saves[i] for i in prefix], {name: a[prefix] for name, a in arrays.items()})
            self.bytes_saved += (len(swaps) + len(prefix)) * self.block_bytes
            if self.disk_writable:
                rows = prefix + list(range(len(saves), len(saves) + len(writes)))
                if rows:
                    self.disk.put_many([saves[i] for i in prefix] + writes, {n: a[rows] for n, a in arrays.items()})
        self._pending = []

    def flush(self) -> None:
        """Stores every save still in flight in the host pool now."""
        began = time.perf_counter()
        self._store_pending()
        self.copy_seconds += time.perf_counter() - began

    def clear(self) -> None:
        """Forgets every host block and drops the saves and writes in flight (new weights: stale
        KV). The disk tier keeps its files: they are the model files' KV (see drop_disk)."""
        self._pending = []
        self._staged.clear()
        self._dropped_swaps.clear()
        if self.host is not None:
            self.host.clear()
        for policy in self.policies:  # swapped-out requests recompute
            policy.forget_all()

    def drop_disk(self) -> None:
        """Stops using the disk tier (the weights no longer are the model files' whose KV it
        keeps): waits for its queued writes and closes it."""
        if self.disk is not None:
            self._pending, disk, self.disk = [], self.disk, None
            self._staged.clear()
            self.disk_writable = False
            disk.close()

    def close(self, kv) -> None:
        """Writes the blocks completed since the last step through to the disk tier and waits
        for every queued write (LLM.close, the server's shutdown); idempotent, the disk tier
        is read-only afterwards (new blocks are not written)."""
        if not self.disk_writable:
            return
        began = time.perf_counter()
        nb = self.num_blocks
        writes = [(r * nb + b, key) for r, policy in enumerate(self.policies) for b, key in policy.take_writes()]
        if writes:
            self._start_gather(pool_leaves(kv)[1], [], writes)
        self._store_pending()
        self.disk_writable = False
        self.disk.close()
        self.copy_seconds += time.perf_counter() - began

    def stats(self) -> dict:
        out = {**(self.host.stats() if self.host is not None else {}), "kv_offload_save_copies": self.num_saves,
               "kv_offload_load_copies": self.num_loads, "kv_offload_bytes_saved": self.bytes_saved,
               "kv_offload_bytes_loaded": self.bytes_loaded, "kv_offload_copy_seconds": self.copy_seconds,
               "kv_offload_saves_in_flight": sum(len(saves) for saves, _, _ in self._pending),
               "kv_offload_swapped_requests": sum(len(p.swapped) for p in self.policies)}
        if self.disk is not None or self.num_writes:
            out["kv_offload_disk_gathered_blocks"] = self.num_writes
        if self.disk is not None:
            out.update(self.disk.stats())
        return out


def attach_kv_tiers(cfg, runner, schedulers, model_dir=None, weights=None) -> KVTierCopier | None:
    """The engine's KV tiers: a KVTierCopier on the runner's pool, the runner calling it at
    dispatch and each scheduler a KVOffloadPolicy over its pool; None (nothing attached) when
    cfg.kv_offload_gb and cfg.kv_offload_dir are None. cfg: the EngineConfig (or a number or
    None: kv_offload_gb alone); model_dir names the disk tier's namespace; weights: those the
    engine loaded from memory instead of model_dir's files (the disk tier is then refused:
    its blocks would not be theirs)."""
    if cfg is None or isinstance(cfg, (int, float)):
        kv_offload_gb, folder = cfg, None
    else:
        kv_offload_gb, folder = cfg.kv_offload_gb, cfg.kv_offload_dir
    if kv_offload_gb is None and folder is None:
        return None
    name = "kv_offload_gb" if kv_offload_gb is not None else "kv_offload_dir"
    if is_multiprocess():
        raise ValueError(f"{name} is not supported across processes yet (each would hold only its own shards)")
    disk = None
    if folder is not None:
        if weights is not None:
            raise ValueError("kv_offload_dir needs the weights of the model folder's files (weights given in "
                             "memory have no identity on disk to key the blocks by)")
        fields = disk_key_fields(model_dir, cfg, runner.block_size)
        disk = (str(Path(folder).expanduser()), cfg.kv_offload_disk_gb, fields)
    copier = KVTierCopier(runner.kv, runner.num_layers, kv_offload_gb, runner.dp, disk)
    runner.kv_tiers = copier
    for sched in schedulers:
        sched.offload = copier.policy(sched.pool, sched.prefix)
    return copier
