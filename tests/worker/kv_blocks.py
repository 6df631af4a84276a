"""Tiny block specs and random blocks for the KV tier tests (bf16, float32, int8 + float16 scales)."""
import ml_dtypes
import numpy as np

HKV, L, BS, D = 2, 3, 4, 8


def block_spec(kind: str) -> dict:
    pages = (HKV, L, BS, D)
    if kind == "bf16":
        return {"k": (pages, ml_dtypes.bfloat16), "v": (pages, ml_dtypes.bfloat16)}
    if kind == "f32":
        return {"k": (pages, np.float32), "v": (pages, np.float32)}
    if kind == "int8":
        scales = (HKV, L, BS)
        return {"k": (pages, np.int8), "k_scales": (scales, np.float16),
                "v": (pages, np.int8), "v_scales": (scales, np.float16)}
    raise ValueError(kind)


def random_block(spec: dict, rng: np.random.Generator, batch: int | None = None) -> dict:
    out = {}
    for name, (shape, dtype) in spec.items():
        shape = shape if batch is None else (batch, *shape)
        if np.dtype(dtype) == np.int8:
            out[name] = rng.integers(-127, 128, shape).astype(np.int8)
        else:
            out[name] = rng.standard_normal(shape).astype(dtype)
    return out


def key(i: int) -> bytes:
    """A 32-byte key like the block pool's sha256 chain keys."""
    return i.to_bytes(4, "little") * 8


def assert_block_equal(got: dict, want: dict) -> None:
    assert got is not None
    assert set(got) == set(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert got[name].tobytes() == a.tobytes(), name  # bit for bit (NaN-safe)
