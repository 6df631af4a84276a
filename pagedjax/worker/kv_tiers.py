"""KVTierCopier: the device <-> host copies of the KV tiers (owned by the engine, called by the
ModelRunner's `dispatch`, the one place, right before the copy-on-write copies).

Each step's SchedulerOutput names the blocks to move (core/kv_offload.py decides which):
`saves` (device block, key): prefix blocks the device pool evicted, gathered before the step
that rewrites them; `loads` (key, device block): host hits, scattered in before the step that
reads them. One jitted gather and one jitted, donated scatter per step at most, over every
layer at once, their block counts padded to powers of two so the compiled shapes stay few.
A gather's result starts its copy to the host at once and is stored in the HostKVPool at the
next step's dispatch (the device has run it by then); until then its keys count as missing.

The device pool is `[Hkv, L * NB, BS, D]` per K and V (an 8-bit pool: pages and float16
scales `[Hkv, L * NB, BS]`), layer l's block b at `l * NB + b`; a host block is the gather of
those rows for every l: `[Hkv, L, BS, D]` (scales `[Hkv, L, BS]`), see kv_block_spec.py. Under
tensor parallelism the gather and scatter run on the sharded pool (XLA moves each head shard);
the host holds every head.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.kv_offload import KVOffloadPolicy
from pagedjax.pallas_kernels.paged_attention import cpu_native
from pagedjax.parallel.distributed import is_multiprocess
from pagedjax.pallas_kernels.paged_attention.ops import write_kv
from pagedjax.worker.kv_host_pool import HostKVPool


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
    """Owns the host tier (HostKVPool of `kv_offload_gb` GiB) and moves blocks to and from the
    device pool `kv` (the runner's, for its layout: the arrays it gets later are the runner's own)."""

    def __init__(self, kv, num_layers: int, kv_offload_gb: float, num_ranks: int = 1):
        """num_ranks: data-parallel ranks, each its own pool of NB blocks (their host tier is shared:
        keys are content keys)."""
        self.num_layers = num_layers
        self.names, leaves = pool_leaves(kv)
        self.num_blocks = leaves[0].shape[1] // (num_layers * num_ranks)  # NB, per rank
        self.num_ranks = num_ranks
        self.host = HostKVPool.from_gb(block_spec(kv, num_layers), kv_offload_gb)
        self._treedef = jax.tree.structure(tuple(kv))
        shardings = [x.sharding for x in leaves]
        self._gather = jax.jit(lambda leaves, blocks: gather_blocks(leaves, blocks, num_layers, num_ranks))
        # bf16 on the CPU, one device: the native in-place write (a plain scatter copies the pool)
        native = (len(leaves) == 2 and cpu_native.native_write_supported(leaves[0].dtype)
                  and len(leaves[0].sharding.device_set) == 1)
        scatter = scatter_blocks_native if native else scatter_blocks
        self._scatter = jax.jit(lambda leaves, blocks, values: scatter(leaves, blocks, values, num_layers, num_ranks),
                                donate_argnums=(0,), out_shardings=shardings)
        self._pending: list[tuple[list[bytes], int, list]] = []  # (keys, n, gathered [n_pad, ...] on device)
        self._shapes: set[tuple[str, int]] = set()  # (gather / scatter, padded n) compiled so far
        self.num_saves = self.num_loads = 0  # batched copies run
        self.bytes_saved = self.bytes_loaded = 0
        self.copy_seconds = 0.0  # host time in this object: reading back, host pool copies, launches

    def in_host(self, key: bytes) -> bool:
        """Whether the host tier holds this key (a hit becomes most recently used there)."""
        return self.host.touch(key)

    def policy(self, pool) -> KVOffloadPolicy:
        """The scheduler's policy over `pool` (a BlockPool), reading this host tier."""
        return KVOffloadPolicy(pool, self.in_host)

    def apply(self, kv, outs) -> tuple[object, bool]:
        """Runs the step's saves and loads on the pool `kv` (before its copy-on-write copies
        and the step); returns (the new pool, whether a copy compiled now). outs: the step's
        SchedulerOutputs (one per data rank; None: idle)."""
        nb = self.num_blocks  # rank r's block b is r * NB + b below
        saves = [(r * nb + b, key) for r, out in enumerate(outs) if out is not None for b, key in out.saves]
        loads = [(key, r * nb + b) for r, out in enumerate(outs) if out is not None for key, b in out.loads]
        if not (saves or loads or self._pending):
            return kv, False
        began = time.perf_counter()
        compiled = False
        values = None
        if loads:  # read before the puts below, which could evict the keys to load
            found, stacked = self.host.get_many([key for key, _ in loads])
            if not found.all():
                raise RuntimeError(f"{int((~found).sum())} KV blocks planned for loading left the host tier")
            n = padded(len(loads))
            values = [np.concatenate([stacked[name], np.zeros((n - len(loads), *stacked[name].shape[1:]),
                                                              stacked[name].dtype)]) for name in self.names]
        self._store_pending()
        _, leaves = pool_leaves(kv)
        if saves:  # before the loads: a load's block may be one this step evicted
            n = padded(len(saves))
            blocks = np.zeros(n, np.int32)
            blocks[:len(saves)] = [b for b, _ in saves]
            compiled |= self._compiling("gather", n)
            gathered = self._gather(leaves, blocks)
            for x in gathered:
                x.copy_to_host_async()
            self._pending.append(([key for _, key in saves], len(saves), gathered))
            self.num_saves += 1
        if loads:
            n = padded(len(loads))
            blocks = np.full(n, self.num_ranks * nb, np.int32)  # padding: dropped
            blocks[:len(loads)] = [b for _, b in loads]
            compiled |= self._compiling("scatter", n)
            leaves = self._scatter(leaves, blocks, values)
            kv = jax.tree.unflatten(self._treedef, leaves)
            self.num_loads += 1
            self.bytes_loaded += len(loads) * self.host.spec.block_bytes
        self.copy_seconds += time.perf_counter() - began
        return kv, compiled

    def _compiling(self, kind: str, n: int) -> bool:
        new = (kind, n) not in self._shapes
        self._shapes.add((kind, n))
        return new

    def _store_pending(self) -> None:
        """Stores the gathers of earlier steps in the host pool (waits for them if need be)."""
        for keys, n, gathered in self._pending:
            self.host.put_many(keys, {name: np.asarray(x)[:n] for name, x in zip(self.names, gathered)})
            self.bytes_saved += n * self.host.spec.block_bytes
        self._pending = []

    def flush(self) -> None:
        """Stores every save still in flight in the host pool now."""
        began = time.perf_counter()
        self._store_pending()
        self.copy_seconds += time.perf_counter() - began

    def clear(self) -> None:
        """Forgets every host block and drops the saves in flight (new weights: stale KV)."""
        self._pending = []
        self.host.clear()

    def stats(self) -> dict:
        return {**self.host.stats(), "kv_offload_save_copies": self.num_saves,
                "kv_offload_load_copies": self.num_loads, "kv_offload_bytes_saved": self.bytes_saved,
                "kv_offload_bytes_loaded": self.bytes_loaded, "kv_offload_copy_seconds": self.copy_seconds,
                "kv_offload_saves_in_flight": sum(n for _, n, _ in self._pending)}


def attach_kv_tiers(kv_offload_gb: float | None, runner, schedulers) -> KVTierCopier | None:
    """The engine's host tier: a KVTierCopier on the runner's pool, the runner calling it at
    dispatch and each scheduler a KVOffloadPolicy over its pool; None (nothing attached) when
    kv_offload_gb is None."""
    if kv_offload_gb is None:
        return None
    if is_multiprocess():
        raise ValueError("kv_offload_gb is not supported across processes yet (each would hold only its own shards)")
    if any(s.window is not None for s in schedulers):
        raise ValueError("kv_offload_gb is not supported with sliding-window block release yet; "
                         "add --keep-window-blocks (release_window_blocks=False)")
    copier = KVTierCopier(runner.kv, runner.num_layers, kv_offload_gb, runner.dp)
    runner.kv_tiers = copier
    for sched in schedulers:
        sched.offload = copier.policy(sched.pool)
    return copier
