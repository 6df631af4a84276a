"""A step's host inputs packed in int32 buffers: few host -> device transfers per step.

A step sends ~25 small numpy arrays (token ids, positions, block tables, per-row sampling
settings). Passed one by one, each was a transfer of its own: on an H200 the decode step's
two executable calls took ~2 ms of host time, against ~0.4 ms that the host then waited for
the device. `pack` lays a tree of such arrays side by side in one int32 array [dp, N] (row r:
data rank r's share of every leaf); the runner packs the step's and the sampler's inputs
apart and puts both buffers on the device in one call, and the compiled step and sampler
`unpack` theirs with static slices. float32 and uint32 travel bit for bit (a bitcast), bool
as 0/1.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = ("int32", "float32", "uint32", "bool")
_NAME_OF = {np.dtype(name): name for name in _DTYPES}  # dtype -> its name (dtype.name is slow to read)


@dataclass(frozen=True)
class BufferLayout:
    """Where each leaf lies in the buffer: static (hashable), fixed by the step's bucket."""

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], str], ...]  # (shape, dtype name) of each leaf, in order
    ranks: int  # rows of the buffer: data ranks; each leaf's first axis is rank-major


def _as_words(x: np.ndarray) -> np.ndarray:
    if x.dtype == np.int32:
        return x
    if x.dtype in (np.float32, np.uint32):
        return x.view(np.int32)
    if x.dtype == np.bool_:
        return x.astype(np.int32)
    raise TypeError(f"host_buffer packs {_DTYPES} arrays, got {x.dtype}")


def pack(tree, ranks: int = 1) -> tuple[np.ndarray, BufferLayout]:
    """tree of numpy arrays, each of first axis ranks * X (rank-major) -> (int32 [ranks, N], layout)."""
    leaves, treedef = jax.tree.flatten(tree)
    arrays = [np.asarray(x) for x in leaves]
    for x in arrays:
        if x.ndim == 0 or x.shape[0] % ranks:
            raise ValueError(f"a leaf of shape {x.shape} does not split over {ranks} data ranks")
    buf = np.concatenate([_as_words(x).reshape(ranks, -1) for x in arrays], axis=1)
    return buf, BufferLayout(treedef, tuple((x.shape, _NAME_OF[x.dtype]) for x in arrays), ranks)


def unpack(buf: jax.Array, layout: BufferLayout):
    """int32 [ranks, N] (on the device, inside a jitted function) -> the packed tree."""
    out, off = [], 0
    for shape, dtype in layout.leaves:
        n = int(np.prod(shape)) // layout.ranks
        words = buf[:, off:off + n].reshape(shape)
        off += n
        if dtype == "bool":
            out.append(words != 0)
        elif dtype == "int32":
            out.append(words)
        else:
            out.append(jax.lax.bitcast_convert_type(words, jnp.dtype(dtype)))
    return jax.tree.unflatten(layout.treedef, out)
