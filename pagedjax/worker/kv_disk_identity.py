"""The disk KV tier's namespace: what must be equal for a block written by one engine to be
valid in another (after a restart, or in another process). DiskKVStore hashes these fields,
with the block spec (shapes, dtypes) and its FORMAT_VERSION, into the folder it uses, so an
engine with another model, weights, dtype or block size never reads these blocks."""
from __future__ import annotations

import hashlib
from pathlib import Path

from pagedjax.platforms import current_platform


# the prefix-cache key chain (core.block_pool.hash_block); bump when its definition changes
KEY_CHAIN_VERSION = 1
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".npz", ".msgpack")


def weights_fingerprint(model_dir: str | Path) -> dict:
    """The model folder's identity: a digest of its config.json and the names, sizes and
    mtimes (ns) of its weight files (a rewritten checkpoint gets a new namespace)."""
    root = Path(model_dir)
    config = root / "config.json"
    files = sorted(p for p in root.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    return {
        "config": hashlib.blake2b(config.read_bytes(), digest_size=16).hexdigest() if config.is_file() else None,
        "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in files],
    }


def disk_key_fields(model_dir: str | Path, cfg, block_size: int, tp_rank: int = 0) -> dict:
    """The key fields of the engine's disk tier (JSON values): model folder and fingerprint,
    the options that change the KV bytes (dtype, weight quantization, KV dtype, block size,
    tensor-parallel size and rank), the backend and the key chain's version. `cfg`: the
    resolved EngineConfig."""
    return {
        "model": str(Path(model_dir).resolve()),
        **weights_fingerprint(model_dir),
        "dtype": str(cfg.dtype),
        "quantization": cfg.quantization,
        "kv_cache_dtype": str(cfg.kv_cache_dtype),
        "block_size": int(block_size),
        "tensor_parallel_size": int(cfg.tensor_parallel_size),
        "tp_rank": int(tp_rank),
        "backend": current_platform().backend,
        "key_chain_version": KEY_CHAIN_VERSION,
    }
