"""The device mesh the engine runs on: axes ("data", "model") over `jax.devices()`.

"model" carries tensor parallelism (models.sharding: Megatron weights, KV heads split);
"data" carries data-parallel ranks. One device: a 1 x 1 mesh, and nothing is split.
"""
from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pagedjax.models.sharding import DATA_AXIS, MODEL_AXIS, check_tp
from pagedjax.platforms import current_platform


def make_mesh(tensor_parallel_size: int = 1, data_parallel_size: int = 1, model_cfg=None) -> Mesh:
    """A ("data", "model") mesh of dp x tp devices, refused with a message that says what
    would work when the devices or the model do not allow it."""
    tp, dp = tensor_parallel_size, data_parallel_size
    for name, v in (("tensor_parallel_size", tp), ("data_parallel_size", dp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    devices = jax.devices()
    if tp * dp > len(devices):
        raise ValueError(f"tensor_parallel_size={tp} x data_parallel_size={dp} needs {tp * dp} devices, but "
                         f"{len(devices)} {current_platform().backend} device(s) are visible (on CPU, set "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count=N before jax is imported)")
    if jax.process_count() > 1 and tp * dp != len(devices):
        raise ValueError(f"with {jax.process_count()} processes the mesh must span all {len(devices)} devices: "
                         f"tensor_parallel_size x data_parallel_size is {tp * dp}")
    if model_cfg is not None:
        check_tp(model_cfg, tp)
    return Mesh(np.array(devices[:tp * dp]).reshape(dp, tp), (DATA_AXIS, MODEL_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def bytes_per_device(tree) -> dict[str, int]:
    """Bytes each device holds of the arrays in `tree`, read from their shards."""
    out: dict[str, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        for shard in getattr(x, "addressable_shards", ()):
            key = str(shard.device)
            out[key] = out.get(key, 0) + shard.data.nbytes
    return out
