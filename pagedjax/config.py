"""Engine settings, validated up front, with defaults derived from the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from pagedjax.models.dtypes import DTYPES, KV_CACHE_DTYPES, check_dtype, check_kv_cache_dtype
from pagedjax.models.lora import TARGETS as LORA_TARGETS
from pagedjax.models.quantization import QUANTIZATIONS, check_quantization

from pagedjax.spec_decode.config import SpeculativeConfig

KV_CACHE_KINDS = ("paged", "dense")


def _json_object(text: str) -> dict:
    """A command-line JSON object (argparse type)."""
    import argparse
    import json

    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _name_list(text: str) -> list[str]:
    """A command-line comma-separated list (argparse type)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def option(default, help: str, type=None, **cli):
    """An EngineConfig field with what its command-line flag needs: help, the argparse type
    (int, float, str, bool or a parser), and optionally choices, flags (extra option strings),
    negative (an extra flag that turns a bool off), metavar."""
    return field(default=default, metadata={"help": help, "type": type, **cli})


@dataclass(slots=True)
class EngineConfig:
    """Every engine option. `LLM(...)` takes them as keyword arguments and the command line
    as flags (`--` and the name with dashes, generated from these fields)."""

    model: str | None = option(None, "local Hugging Face model dir, or a Hugging Face model id (org/name) from the "
                               "local Hugging Face cache, downloaded into it where the network allows (default: the "
                               "embedded SmolLM2-135M-Instruct)")
    load_format: str = option("auto", "auto: read the model's weight files; dummy: config and tokenizer only, random "
                              "weights of the right shapes (real ones arrive later through LLM.update_weights)", str,
                              choices=("auto", "dummy"))
    block_size: int = option(16, "tokens per KV block (a power of two)", int)
    num_blocks: int | None = option(None, "KV blocks in the pool (default: from the KV memory budget; dense: the "
                                    "number of slots)", int)
    max_num_seqs: int = option(64, "most requests running at once (per data-parallel rank)", int)
    max_model_len: int | None = option(None, "prompt + output token limit (default: the model's "
                                       "max_position_embeddings)", int)
    max_num_batched_tokens: int | None = option(None, "tokens per step, decode and prompt chunks together, padding "
                                                "included (default: 2048)", int)
    min_step_tokens: int | None = option(None, "the smallest compiled step, in tokens (a power of two; default: the "
                                         "platform's: 1 on CPU for bf16 weights, where a step's cost follows its padded "
                                         "rows, 8 for float32 and on GPU/TPU)", int)
    enable_prefix_caching: bool = option(True, "share identical prompt prefixes (blocks by reference count)", bool,
                                         negative="--no-prefix-caching")
    release_window_blocks: bool = option(True, "models whose every layer has a sliding window (Mistral, Mixtral): "
                                         "a request's KV blocks go back to the pool once no query can see them "
                                         "(paged cache; not with a draft model, which reads them)", bool,
                                         negative="--keep-window-blocks")
    kv_cache: str = option("paged", "paged: fixed-size blocks in one pool; dense: one contiguous max_model_len slot "
                           "per request (block_size unused)", str, choices=KV_CACHE_KINDS)
    dtype: str = option("auto", "the model's matrices (activations stay float32); auto: bfloat16 where the hardware "
                        "has fast bf16 (TPU, GPU, CPU with AVX512-BF16/AMX), else float32", str,
                        choices=("auto", *DTYPES))
    kv_cache_dtype: str = option("auto", "KV cache dtype (auto: the model dtype; int8 / fp8: 8-bit pages with a "
                                 "float16 scale per token and KV head, ~2x the tokens in the same memory)", str,
                                 choices=KV_CACHE_DTYPES)
    quantization: str | None = option(None, "weights in 8 bits, quantized at load with a scale per output channel: "
                                      "int8 or fp8 (e4m3); default: the model dtype", str, choices=QUANTIZATIONS)
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) on the base model, a different one per "
                               "request if need be (LLM.generate(lora_request=...), serve --lora-modules)", bool)
    max_loras: int = option(4, "LoRA adapters held in device memory at once (the slots one step may mix)", int)
    max_lora_rank: int = option(16, "the largest LoRA rank served (slots are sized for it)", int)
    max_cpu_loras: int | None = option(None, "LoRA adapters kept in host memory (LRU; default: max_loras)", int)
    lora_target_modules: list[str] | None = option(
        None, "the projections LoRA adapters may change, comma-separated (default: all of " + ",".join(LORA_TARGETS)
        + "); each one costs every step with adapters, an adapter on others is refused", _name_list,
        metavar="NAMES")
    seed: int = option(0, "engine seed (requests without a seed of their own draw theirs from it)", int)
    kv_cache_memory_gb: float | None = option(None, "KV memory per data-parallel rank, split over its tensor-parallel "
                                              "devices (default: 2 GiB on CPU, 0.8 of the free device memory "
                                              "on accelerators)", float)
    kv_offload_gb: float | None = option(None, "host-memory KV tier in GiB (per engine): prefix blocks the device "
                                         "pool evicts are kept there and copied back on a later prefix hit instead "
                                         "of recomputed (paged cache with prefix caching; default: off)", float)
    kv_offload_dir: str | None = option(None, "disk KV tier: a folder where full prefix blocks are written as they "
                                        "are computed (in the background) and read back on a later prefix hit, "
                                        "also after a restart (one subfolder per model, dtype and block size; "
                                        "default: off)", str, metavar="DIR")
    kv_offload_disk_gb: float = option(16.0, "size bound of the disk KV tier's folder in GiB (--kv-offload-dir; "
                                       "least recently used blocks go first)", float)
    attention_impl: str = option("auto", "paged attention kernel: auto, reference, chunked, ragged, native, "
                                 "pallas_tpu, pallas_gpu (see pallas_kernels/paged_attention/ops.py)", str)
    scan_layers: bool | None = option(None, "run the layers as one lax.scan (default: on accelerators; unrolled "
                                      "on CPU)", bool)
    tensor_parallel_size: int = option(1, "devices the weights and KV heads are split over (the mesh's model axis)",
                                       int, flags=("-tp",))
    data_parallel_size: int = option(1, "ranks with their own block pool and rows (the mesh's data axis); "
                                     "num_blocks and max_num_seqs are per rank", int, flags=("-dp",))
    expert_parallel: bool = option(False, "mixture-of-experts models: whole experts split over the "
                                   "tensor_parallel_size devices (expert parallelism) instead of each expert's "
                                   "matrices", bool, flags=("-ep",))
    moe_impl: str = option("auto", "expert matmuls of a mixture-of-experts model: sorted (a loop over the chosen "
                           "experts' rows), ragged (jax.lax.ragged_dot), dense (every expert on every token); "
                           "auto: sorted on CPU, ragged on accelerators (models/moe.py)", str,
                           choices=("auto", "sorted", "ragged", "dense"))
    speculative_config: dict | SpeculativeConfig | None = option(
        None, 'speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}\' '
        '(prompt lookup) or \'{"model": "DRAFT_DIR", "num_speculative_tokens": 4}\' (a draft model with the same '
        'vocabulary; it drafts fewer or none while they do not pay, "adaptive": false keeps k)',
        _json_object, metavar="JSON")
    pooling_type: str | None = option(None, "embeddings (LLM.embed, /v1/embeddings): last (the last prompt token's "
                                      "final hidden state) or mean (over the prompt's tokens); default: the "
                                      "checkpoint's sentence-transformers pooling config, else last", str,
                                      choices=("last", "mean"))
    generation_config: str = option(
        "auto", "sampling defaults of requests that leave them unset: auto: the model's generation_config.json "
        "(its temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); vllm: none, the engine's own; "
        "or a folder holding a generation_config.json", str, metavar="auto|vllm|DIR")
    async_scheduling: bool = option(True, "schedule and dispatch step t + 1 before reading step t's tokens (the host "
                                    "prepares the next step while the device runs this one)", bool)

    def __post_init__(self) -> None:
        def positive(name, value):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

        for name in ("block_size", "num_blocks", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
                     "tensor_parallel_size", "data_parallel_size", "max_loras", "max_lora_rank", "max_cpu_loras"):
            positive(name, getattr(self, name))
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.min_step_tokens is not None and (not isinstance(self.min_step_tokens, int) or self.min_step_tokens < 1
                                                 or self.min_step_tokens & (self.min_step_tokens - 1)
                                                 or self.min_step_tokens > 16):
            raise ValueError(f"min_step_tokens must be a power of two from 1 to 16, got {self.min_step_tokens!r}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError(f"max_num_batched_tokens must be at least 16, got {self.max_num_batched_tokens}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_cache not in KV_CACHE_KINDS:
            raise ValueError(f"kv_cache must be one of {KV_CACHE_KINDS}, got {self.kv_cache!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        check_dtype(self.dtype)
        check_kv_cache_dtype(self.kv_cache_dtype)
        check_quantization(self.quantization)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        elif self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        unknown = sorted(set(self.lora_target_modules or LORA_TARGETS) - set(LORA_TARGETS))
        if unknown or self.lora_target_modules == []:
            raise ValueError(f"lora_target_modules must name some of {', '.join(LORA_TARGETS)}, got "
                             f"{self.lora_target_modules!r}")
        if self.pooling_type not in (None, "last", "mean"):
            raise ValueError(f"pooling_type must be 'last', 'mean' or None (auto), got {self.pooling_type!r}")
        self._check_generation_config()
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        self._check_kv_offload()

    def _check_kv_offload(self) -> None:
        gb, folder, disk_gb = self.kv_offload_gb, self.kv_offload_dir, self.kv_offload_disk_gb
        if not isinstance(disk_gb, (int, float)) or isinstance(disk_gb, bool) or not disk_gb > 0:
            raise ValueError(f"kv_offload_disk_gb must be a number > 0 (GiB), got {disk_gb!r}")
        if gb is None and folder is None:
            return
        if gb is not None and (not isinstance(gb, (int, float)) or isinstance(gb, bool) or not gb > 0):
            raise ValueError(f"kv_offload_gb must be a number > 0 (GiB), got {gb!r}")
        if folder is not None:
            if not isinstance(folder, str) or not folder.strip():
                raise ValueError(f"kv_offload_dir must be a folder path, got {folder!r}")
            if Path(folder).expanduser().exists() and not Path(folder).expanduser().is_dir():
                raise ValueError(f"kv_offload_dir {folder!r} exists and is not a folder")
        name = "kv_offload_gb" if gb is not None else "kv_offload_dir"
        if self.kv_cache != "paged":
            raise ValueError(f"{name} needs kv_cache='paged' (a dense slot is not a prefix block)")
        if not self.enable_prefix_caching:
            raise ValueError(f"{name} needs prefix caching (the KV tiers keep prefix-cache blocks); "
                             "drop --no-prefix-caching")
        if self.speculative_config is not None and self.speculative_config.method == "draft_model":
            raise ValueError(f"{name} is not supported with a draft model (its own KV pool is not offloaded)")

    def _check_generation_config(self) -> None:
        source = self.generation_config
        if not isinstance(source, str) or not source:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json, "
                             f"got {source!r}")
        if source not in ("auto", "vllm") and not (Path(source).expanduser() / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json; "
                             f"{str(Path(source).expanduser() / 'generation_config.json')!r} does not exist")

    def resolve(self, model_cfg) -> None:
        """Fills the defaults that depend on the model."""
        limit = model_cfg.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds what the model supports ({limit})")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 2048
        mlp = ("gate_proj", "up_proj", "down_proj")
        if self.lora_target_modules is None:  # a mixture-of-experts model's MLPs take no adapters
            self.lora_target_modules = [t for t in LORA_TARGETS if not (model_cfg.num_experts and t in mlp)]
        elif model_cfg.num_experts and self.enable_lora and set(mlp) & set(self.lora_target_modules):
            raise ValueError(f"LoRA on the MLP of a mixture-of-experts model is not supported; lora_target_modules "
                             f"may name q_proj, k_proj, v_proj, o_proj, got {self.lora_target_modules!r}")

    def default_num_blocks(self, bytes_per_block: int, weight_bytes: int, block_size: int | None = None,
                           reserved_bytes: int = 0) -> int:
        """Blocks that fit the KV budget, capped at what max_num_seqs full-length requests need.

        block_size defaults to self.block_size; the dense backend passes max_model_len (a block
        is one request's slot), so the same budget gives its number of slots. weight_bytes:
        what one device holds of the weights. reserved_bytes: taken from the budget first (a
        draft model's pool beyond its share per block).
        """
        from pagedjax.platforms import current_platform

        if self.kv_cache_memory_gb is not None:
            budget = int(self.kv_cache_memory_gb * (1 << 30))
        else:  # weight_bytes: one device's share; the pool is split over tp devices
            budget = current_platform().kv_budget_bytes(weight_bytes, self.tensor_parallel_size)
        if reserved_bytes >= budget:
            raise ValueError(f"the KV budget ({budget} bytes) does not hold the draft model's fixed share "
                             f"({reserved_bytes} bytes: k + 1 tokens and a block per sequence); raise "
                             "kv_cache_memory_gb or lower max_num_seqs")
        budget -= reserved_bytes
        per_seq = -(-self.max_model_len // (block_size or self.block_size))
        return max(1, min(budget // bytes_per_block, self.max_num_seqs * per_seq))
