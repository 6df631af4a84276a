"""What `LLMEngine.stats()` reports, summed over the data-parallel ranks, and small naming helpers."""
from __future__ import annotations

from dataclasses import asdict, fields
from pathlib import Path

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.kv_memory import KVMemory, kv_memory as rank_kv_memory
from pagedjax.core.sched.scheduler import Scheduler
from pagedjax.models.hub import is_repo_id
from pagedjax.platforms import current_platform
from pagedjax.spec_decode.manager import spec_stats
from pagedjax.worker import compile_counter


def stats(engine) -> dict:
    """Totals over the data-parallel ranks; "data_parallel_ranks" has each rank's own."""
    mem = kv_memory(engine)
    ranks = [rank_stats(p, s) for p, s in zip(engine.pools, engine.schedulers)]
    totals = {k: sum(r[k] for r in ranks) for k in ranks[0]}
    cfg = engine.config
    return {
        **totals,
        "block_size": engine.pool.block_size,
        **compile_stats(engine),
        "num_steps": engine.num_steps,
        "num_generated_tokens": engine.num_generated_tokens,
        "num_computed_prompt_tokens": engine.num_computed_prompt_tokens,
        **spec_stats(engine.spec),
        "kv_cache": cfg.kv_cache,
        "kv_cache_dtype": engine.kv_dtype.name,
        "quantization": engine.model.quantization,  # the config's, or a pre-quantized checkpoint's
        "kv_bytes_per_token": engine.kv_bytes_per_token,
        **{f"kv_tokens_{k}": v for k, v in asdict(mem).items() if k != "num_requests"},
        "kv_utilization": mem.utilization,
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "data_parallel_size": cfg.data_parallel_size,
        "weight_bytes_per_device": engine.weight_bytes_per_device,
        "platform": current_platform().describe(),  # one line: the backend, its hardware, its choices
        "kv_pool_bytes_per_device": engine.kv_pool_bytes_per_device,
        **(engine.lora.stats() if engine.lora is not None else {}),
        **kv_offload_stats(engine),
        "data_parallel_ranks": ranks,
    }


def kv_offload_stats(engine) -> dict:
    """The host KV tier's counters (kv_offload_gb): the policies' (summed over ranks) and the
    copier's, with its HostKVPool's; {} when off."""
    tiers = getattr(engine, "kv_tiers", None)
    if tiers is None:
        return {}
    each = [s.offload.stats() for s in engine.schedulers]
    return {**{k: sum(e[k] for e in each) for k in each[0]}, **tiers.stats()}


def compile_stats(engine) -> dict:
    """The compile counts and warm-up state. Safe to read from any thread (the background
    warm-up changes them while the engine idles, so the server reads them live)."""
    runner, shapes = engine.runner, len(engine.buckets.token_buckets())
    compiled = runner.num_compiled_shapes
    return {
        "num_compilations": compile_counter.num_compilations(),
        "num_compiled_shapes": compiled,
        "num_step_shapes": shapes,
        "warmup_done": runner.warmup_done and compiled == shapes,
    }


def kv_memory(engine) -> KVMemory:
    """KV memory accounting from the block pools' state now (see core.kv_memory), summed
    over the data-parallel ranks."""
    each = [rank_kv_memory(p, s.running, engine.max_model_len, engine.kv_budget_tokens)
            for p, s in zip(engine.pools, engine.schedulers)]
    return KVMemory(**{f.name: sum(getattr(m, f.name) for m in each) for f in fields(KVMemory)})


def rank_stats(pool: BlockPool, s: Scheduler) -> dict:
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_free": pool.num_free,
        "kv_blocks_cached": pool.num_cached,
        "num_requests_running": len(s.running),
        "num_requests_waiting": len(s.waiting),
        "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
        "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
        "num_preemptions": s.num_preemptions,
        "num_forks": s.num_forks,
        "num_cow_copies": pool.num_cow_copies,
        # sliding-window models: blocks returned before their request ended (core/sched/window.py)
        "kv_blocks_released_outside_window": s.window.num_released if s.window is not None else 0,
    }


def model_name(model) -> str:
    """The default model's name, a Hugging Face id as given (`org/name`), else the dir's name."""
    if model is None:
        return "SmolLM2-135M-Instruct"
    if isinstance(model, str) and is_repo_id(model) and not Path(model).expanduser().exists():
        return model
    return Path(str(model)).name


def tokenizer_eos(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)
