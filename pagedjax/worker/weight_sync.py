"""WeightSync: the runner's weights replaced from memory, and its device memory released and
restored (sleep / wake-up), between steps. Owned by the engine, made at first use.

Nothing here changes a parameter's shape, dtype or sharding, so the compiled steps run on as
they are: an update or a wake-up compiles no step (the per-shape gathers that assemble new
parameters compile once, at the first update of that shape).
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from pagedjax.models.kv_cache import init_kv_cache
from pagedjax.models.weight_update import WeightLayout, named_arrays


class WeightSync:
    def __init__(self, runner, model):
        self.runner, self.model = runner, model
        self.layout = WeightLayout(model)  # where each checkpoint row lands (traced once)
        self._paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(runner.state)[0]]
        self._index = {path: i for i, path in enumerate(self._paths)}
        self.sleep_level = 0  # 0: awake; 1: KV pool released; 2: the weights too (kept on the host)
        self._host_weights: list[np.ndarray] | None = None

    def update(self, weights) -> int:
        """Replaces the given tensors (Hugging Face names; a mapping or (name, array) pairs;
        jax.Array or numpy, any subset) in the runner's weights, all or nothing. Returns the
        number of engine parameters written."""
        weights = named_arrays(weights)
        if not weights:
            raise ValueError("update_weights: no tensors given")
        self.layout.check(weights)
        if self.sleep_level >= 2:
            raise RuntimeError("the weights are asleep (sleep(level=2)): call wake_up() before update_weights")
        current = {path: self.runner._weights[i] for path, i in self._index.items()}
        new = self.layout.assemble(current, weights)  # every new array is built before any is swapped in
        leaves = list(self.runner._weights)
        for path, value in new.items():
            leaves[self._index[path]] = value
        self._install(leaves)
        return len(new)

    def _install(self, leaves: list) -> None:
        """The runner steps with `leaves` from now on; the model object holds them too (no
        stale copy stays alive)."""
        r = self.runner
        r._weights = leaves
        r.state = jax.tree.unflatten(r._weights_tree, leaves)
        nnx.update(self.model, r.state)

    # -- sleep / wake-up ----------------------------------------------------------------------
    def sleep(self, level: int) -> None:
        """level 1: frees the KV pool's device memory; level 2: the weights too (copied to the
        host first, put back by wake_up)."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 (KV pool) or 2 (KV pool and weights), got {level!r}")
        r = self.runner
        if self.sleep_level == 0:
            self._kv_spec = [(x.shape, x.dtype, x.sharding) for x in jax.tree.leaves(r.kv)]
            for x in jax.tree.leaves(r.kv):
                x.delete()
            r.kv = None
        if level == 2 and self.sleep_level < 2:
            self._host_weights = [np.asarray(x) for x in r._weights]
            self._weight_shardings = [x.sharding for x in r._weights]
            for x in r._weights:
                if isinstance(x, jax.Array) and not x.is_deleted():
                    x.delete()
            r._weights = [None] * len(self._host_weights)
            r.state = None
        self.sleep_level = max(self.sleep_level, level)

    def wake_up(self) -> None:
        """Restores what sleep released: the weights (from the host) and a zeroed KV pool of
        the same shape (its contents are gone: the engine drops its prefix cache at sleep)."""
        r = self.runner
        if self.sleep_level >= 2:
            self._install([jax.device_put(x, s) for x, s in zip(self._host_weights, self._weight_shardings)])
            self._host_weights = None
        if self.sleep_level >= 1:
            r.kv = init_kv_cache(r.cache, r.num_layers, self.model.num_kv_heads, self.model.config.head_dim,
                                 r.kv_dtype, r.kv_sharding, data_parallel=r.dp)
        self.sleep_level = 0
