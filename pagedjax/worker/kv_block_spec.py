"""What one offloaded KV block is made of, independent of the model code.

A *block spec* names the arrays that hold one device block across all layers, each with its
shape and dtype, e.g. for a bf16 pool of L layers, Hkv heads, block size BS and head dim D:
    {"k": ((Hkv, L, BS, D), bfloat16), "v": ((Hkv, L, BS, D), bfloat16)}
and for an 8-bit pool the pages plus their float16 scales:
    {"k": ((Hkv, L, BS, D), int8), "k_scales": ((Hkv, L, BS), float16), "v": ..., "v_scales": ...}
The host pool and the disk store keep blocks of one spec, keyed by the block pool's chained
prefix key (`core.block_pool.hash_block`: 32 bytes) or a non-negative int.
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

BlockKey = bytes | int
SpecInput = Mapping[str, tuple[tuple[int, ...], object]]


def as_dtype(dtype) -> np.dtype:
    """A numpy dtype from a dtype, a type or a name ("bfloat16", "float8_e4m3fn" via ml_dtypes)."""
    if isinstance(dtype, str) and hasattr(ml_dtypes, dtype):
        dtype = getattr(ml_dtypes, dtype)
    try:
        return np.dtype(dtype)
    except TypeError as e:
        raise ValueError(f"not a dtype: {dtype!r}") from e


class BlockSpec:
    """A validated block spec: `fields` is ((name, shape, dtype), ...) in the given order."""

    __slots__ = ("fields", "block_bytes")

    def __init__(self, spec: SpecInput | BlockSpec):
        if isinstance(spec, BlockSpec):
            self.fields, self.block_bytes = spec.fields, spec.block_bytes
            return
        if not isinstance(spec, Mapping) or not spec:
            raise ValueError(f"block spec must be a non-empty dict name -> (shape, dtype), got {spec!r}")
        fields = []
        for name, entry in spec.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"block spec names must be non-empty strings, got {name!r}")
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise ValueError(f"block spec entry {name!r} must be (shape, dtype), got {entry!r}")
            shape, dtype = entry
            try:
                shape = tuple(int(d) for d in shape)
            except TypeError as e:
                raise ValueError(f"block spec entry {name!r}: shape must be a tuple of ints, got {shape!r}") from e
            if any(d < 1 for d in shape):
                raise ValueError(f"block spec entry {name!r}: dimensions must be >= 1, got {shape}")
            fields.append((name, shape, as_dtype(dtype)))
        self.fields: tuple[tuple[str, tuple[int, ...], np.dtype], ...] = tuple(fields)
        self.block_bytes = sum(int(np.prod(s)) * d.itemsize for _, s, d in self.fields)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _, _ in self.fields)

    def describe(self) -> list[list]:
        """JSON-able [[name, [shape], dtype name], ...] (the disk header and namespace key)."""
        return [[name, list(shape), dtype.name] for name, shape, dtype in self.fields]

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockSpec) and self.fields == other.fields

    def __hash__(self) -> int:
        return hash(self.fields)

    def __repr__(self) -> str:
        return f"BlockSpec({self.describe()}, {self.block_bytes} bytes/block)"

    def check(self, arrays: Mapping[str, np.ndarray], batch: int | None = None) -> dict[str, np.ndarray]:
        """Validates one block's arrays (batch None) or a batch stacked [batch, ...]; returns
        them as numpy arrays by name. Raises ValueError naming the array that does not fit."""
        if not isinstance(arrays, Mapping):
            raise ValueError(f"expected a dict name -> array, got {type(arrays).__name__}")
        missing = [n for n in self.names if n not in arrays]
        extra = [n for n in arrays if n not in self.names]
        if missing or extra:
            raise ValueError(f"block arrays do not match the spec {list(self.names)}: "
                             f"missing {missing}, unexpected {extra}")
        out = {}
        for name, shape, dtype in self.fields:
            a = np.asarray(arrays[name])
            want = shape if batch is None else (batch, *shape)
            if a.shape != want:
                raise ValueError(f"block array {name!r}: shape {a.shape}, expected {want}")
            if a.dtype != dtype:
                raise ValueError(f"block array {name!r}: dtype {a.dtype}, expected {dtype}")
            out[name] = a
        return out


def check_key(key) -> BlockKey:
    """A block key as given (bytes, or an int >= 0); anything else is a TypeError."""
    if isinstance(key, (bytes, bytearray)):
        if not key:
            raise ValueError("block key must not be empty bytes")
        return bytes(key)
    if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        if key < 0:
            raise ValueError(f"block key must be >= 0, got {key}")
        return int(key)
    raise TypeError(f"block key must be bytes (a prefix hash) or an int, got {type(key).__name__}")
