"""Engine settings, validated up front, with defaults derived from the model."""
from __future__ import annotations

from dataclasses import dataclass

from models.dtypes import check_dtype, check_kv_cache_dtype

from pagedjax.spec_decode.config import SpeculativeConfig

KV_CACHE_KINDS = ("paged", "dense")
CPU_KV_BUDGET_BYTES = 2 << 30  # default KV memory on the CPU backend
ACCELERATOR_KV_FRACTION = 0.8  # of the device memory left after weights


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default model
    block_size: int = 16
    num_blocks: int | None = None  # None: from the KV memory budget; dense: the number of slots
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_batched_tokens: int | None = None  # None: 2048 (tokens of one step, padding included)
    enable_prefix_caching: bool = True
    kv_cache: str = "paged"  # "dense": one max_model_len slot per request, block_size unused
    dtype: str = "auto"  # the model's matrices: "auto" (bf16 where the hardware has fast bf16), "bfloat16", "float32"
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "bfloat16" or "float32"
    seed: int = 0
    kv_cache_memory_gb: float | None = None  # per data-parallel rank (split over its tp devices)
    attention_impl: str = "auto"
    scan_layers: bool | None = None  # None: scan on accelerators, unrolled on CPU (models.loader)
    tensor_parallel_size: int = 1  # devices the weights and KV heads are split over ("model" axis)
    data_parallel_size: int = 1  # ranks with their own block pool and rows ("data" axis); num_blocks, max_num_seqs per rank
    # {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b}
    speculative_config: dict | SpeculativeConfig | None = None
    async_scheduling: bool = True  # schedule and dispatch step t + 1 before reading step t's tokens

    def __post_init__(self) -> None:
        def positive(name, value):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "num_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "tensor_parallel_size", "data_parallel_size"):
            positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens must be at least 16, got {self.max_num_batched_tokens}")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")

    def resolve(self, model_cfg) -> None:
        """Fills the defaults that depend on the model."""
        limit = model_cfg.max_position_embeddings
        if model_cfg.sliding_window:
            limit = min(limit, model_cfg.sliding_window)  # no sliding-window attention: stay inside it
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds what the model supports ({limit})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048

    def default_num_blocks(self, bytes_per_block: int, weight_bytes: int, block_size: int | None = None,
                           reserved_bytes: int = 0) -> int:
        """Blocks that fit the KV budget, capped at what max_num_seqs full-length requests need.

        block_size defaults to self.block_size; the dense backend passes max_model_len (a block
        is one request's slot), so the same budget gives its number of slots. weight_bytes:
        what one device holds of the weights. reserved_bytes: taken from the budget first (a
        draft model's pool beyond its share per block).
        """
        import jax

        if self.kv_cache_memory_gb is not None:
            budget = int(self.kv_cache_memory_gb * (1 << 30))
        elif jax.default_backend() == "cpu":
            budget = CPU_KV_BUDGET_BYTES
        else:
            # per device (weight_bytes: one device's share); the pool is split over tp devices
            stats = jax.devices()[0].memory_stats() or {}
            free = stats.get("bytes_limit", 16 << 30) - stats.get("bytes_in_use", 0) - weight_bytes
            budget = int(max(free, 0) * ACCELERATOR_KV_FRACTION) * self.tensor_parallel_size
        if reserved_bytes >= budget:
            raise ValueError(f"the KV budget ({budget} bytes) does not hold the draft model's fixed share "
                             f"({reserved_bytes} bytes: k + 1 tokens and a block per sequence); raise "
                             "kv_cache_memory_gb or lower max_num_seqs")
        budget -= reserved_bytes
        per_seq = -(-self.max_model_len // (block_size or self.block_size))
        return max(1, min(budget // bytes_per_block, self.max_num_seqs * per_seq))
