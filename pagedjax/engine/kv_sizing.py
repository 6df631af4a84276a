"""How big the KV pool is: bytes per token, block size, and the number of blocks the memory
budget holds (beside the weights, the penalty slots and a draft model's own pool)."""
from __future__ import annotations

from dataclasses import dataclass

from flax import nnx

from pagedjax.models.kv_cache import kv_bytes_per_token
from pagedjax.models.loader import resolve_kv_cache_dtype
from pagedjax.config import EngineConfig
from pagedjax.parallel.mesh import bytes_per_device


@dataclass(frozen=True)
class KVPlan:
    kv_dtype: object  # numpy dtype of the KV pages
    kv_bytes_per_token: int  # K and V of every layer, KV heads as stored (replicated up to tp)
    block_size: int  # tokens per block; dense: a block is one request's whole max_model_len slot
    budget_tokens: int | None  # kv_cache_memory_gb in tokens (target and draft KV together), None: unset
    max_num_seqs: int  # rows of a step: dense caps them at its slots


def plan_kv(cfg: EngineConfig, model, draft=None) -> KVPlan:
    """Sizes the pool for `model` (and a speculative draft model, whose KV pool shares the
    budget); fills cfg.num_blocks when it is unset."""
    mc = model.config
    kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, model.dtype)
    kv_bytes = kv_bytes_per_token(mc.num_layers, model.num_kv_heads, mc.head_dim, kv_dtype)
    dense = cfg.kv_cache == "dense"
    block_size = cfg.max_model_len if dense else cfg.block_size
    weight_bytes = max(bytes_per_device(nnx.state(model)).values())  # one device's share
    k = cfg.speculative_config.num_speculative_tokens if cfg.speculative_config else 0
    draft_token_bytes = 0
    if draft is not None:
        from pagedjax.spec_decode.draft_model import DRAFT_BLOCK_SIZE

        # its pool holds every rank's tokens (plus k + 1 and a block per sequence: reserved below)
        draft_token_bytes = draft.kv_bytes_per_token * cfg.data_parallel_size
        weight_bytes += max(bytes_per_device(nnx.state(draft.model)).values())
    if cfg.num_blocks is None:
        # the penalty slots (counts int32, prompt flags, bias f32 per vocabulary entry) sit beside the pool
        penalty_bytes = cfg.max_num_seqs * mc.vocab_size * 9
        reserved = 0  # the draft's k + 1 tokens and a block per sequence, and its blocks' rounding
        if draft is not None:
            bs = DRAFT_BLOCK_SIZE
            reserved = draft_token_bytes * (cfg.max_num_seqs * (k + 1 + bs) + bs)
        cfg.num_blocks = cfg.default_num_blocks((kv_bytes + draft_token_bytes) * block_size,
                                                weight_bytes + penalty_bytes, block_size, reserved)
    budget = (None if cfg.kv_cache_memory_gb is None else
              int(cfg.kv_cache_memory_gb * (1 << 30)) // (kv_bytes + draft_token_bytes))
    max_seqs = min(cfg.max_num_seqs, cfg.num_blocks) if dense else cfg.max_num_seqs  # dense: batch <= slots
    return KVPlan(kv_dtype, kv_bytes, block_size, budget, max_seqs)
