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
from pagedjax.models.weight_update import WeightLayout, apply_plan, named_arrays


class WeightSync:
    def __init__(self, runner, model):
        self.runner, self.model = runner, model
        self.layout = WeightLayout(model)  # where each checkpoint row lands (traced once)
        self._paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(runner.state)[0]]
        self._index = {path: i for i, path in enumerate(self._paths)}
        self.sleep_level = 0  # 0: awake; 1: KV pool released; 2: the weights too (kept on the host)
        self._host_weights: list[np.ndarray] | None = None
        self._programs: dict = {}  # (names, transform) -> (the compiled update, its LeafPlans)
        self._transformed: dict = {}  # (transform, input structure and shapes) -> its outputs' shapes

    def update(self, weights, transform=None) -> int:
        """Replaces the given tensors (Hugging Face names; a mapping or (name, array) pairs;
        jax.Array or numpy, any subset) in the runner's weights, all or nothing, in one
        compiled program per set of names (compiled at its first use). transform: a jnp
        function of `weights` returning the Hugging Face-named arrays, traced into the same
        program (a trainer's own layout converted on the way, with no copy in between).
        Returns the number of engine parameters written."""
        if transform is None:
            weights = named_arrays(weights)
            if self.model.config.tie_word_embeddings:  # a tied model's state dict may list it: it is the embedding
                weights.pop("lm_head.weight", None)
            if not weights:
                raise ValueError("update_weights: no tensors given")
            hf_shapes = weights
        else:  # traced once per (transform, input shapes): a sync's host work stays small
            key = (transform, jax.tree.structure(weights),
                   tuple((x.shape, x.dtype) for x in jax.tree.leaves(weights)))
            if key not in self._transformed:
                self._transformed[key] = jax.eval_shape(transform, weights)
            hf_shapes = self._transformed[key]
        self.layout.check(hf_shapes)
        if self.sleep_level >= 2:
            raise RuntimeError("the weights are asleep (sleep(level=2)): call wake_up() before update_weights")
        names = tuple(sorted(hf_shapes))
        program, plans = self._program(names, transform)
        weights = jax.tree.map(self._onto_mesh, weights)
        touched = sorted({p.path for p in plans} | {p.scale_path for p in plans if p.scale_path})
        current = {path: self.runner._weights[self._index[path]] for path in touched}
        new = program(weights, current)  # every new array is built before any is swapped in
        leaves = list(self.runner._weights)
        for path, value in new.items():
            leaves[self._index[path]] = value
        self._install(leaves)
        return len(new)

    def _onto_mesh(self, x):
        """An array on other devices than the engine's mesh (a subset included: one jitted
        program takes inputs and outputs on one set of devices) is copied onto the mesh
        (replicated) first; numpy and arrays on the mesh's devices go as they are."""
        devices = set(self.runner.mesh.devices.flat)
        if isinstance(x, jax.Array) and x.sharding.device_set != devices:
            return jax.device_put(x, self.runner._replicated)
        return x

    def _program(self, names: tuple, transform):
        """The compiled update for this set of names (and transform), made once."""
        key = (names, transform)
        if key not in self._programs:
            scales = {p for p in self._index if p.endswith("_scale'].value") or p.endswith("_scale']")}
            plans = self.layout.plan(names, scales)
            quantization = self.layout.quantization
            shardings = {}
            for plan in plans:
                for path in (plan.path, plan.scale_path):
                    if path is not None:
                        shardings[path] = self.runner._weights[self._index[path]].sharding

            def run(weights, current):
                hf = weights if transform is None else transform(weights)
                return apply_plan(plans, [hf[n] for n in names], current, quantization)

            self._programs[key] = jax.jit(run, out_shardings=shardings), plans
        return self._programs[key]

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
