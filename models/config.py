"""Model configuration parsed from a Hugging Face `config.json`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model definition needs, in one flat record."""

    family: str  # llama | mistral | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: tuple[tuple[str, Any], ...] | None  # llama3 parameters, or None for default RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v (and o for llama) projections carry a bias
    o_bias: bool
    qk_norm: bool  # Qwen3: RMSNorm on each head of q and k before RoPE
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str

    def inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] (float64), scaling applied."""
        d = self.head_dim
        inv = 1.0 / (self.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if self.rope_scaling is None:
            return inv
        p = dict(self.rope_scaling)
        factor = float(p["factor"])
        low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
        old_len = float(p.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled)


def _rope(cfg: dict) -> tuple[float, tuple | None]:
    """Reads RoPE settings from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in merged]
        if missing:
            raise ValueError(f"llama3 RoPE scaling is missing {missing} in config.json")
        return float(theta), tuple((k, merged[k]) for k in keys)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: 'default', 'llama3'")


def parse_config(cfg: dict) -> ModelConfig:
    """Builds a ModelConfig from a config.json dict, with clear errors for what is missing."""
    archs = cfg.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(cfg.get("model_type", ""))
    if arch is None:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; "
            f"supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    family = SUPPORTED_ARCHITECTURES[arch]
    required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
    missing = [k for k in required if k not in cfg]
    if missing:
        raise ValueError(f"config.json lacks required fields {missing}")
    if cfg.get("mlp_bias"):
        raise ValueError("mlp_bias=True is not supported")
    num_heads = int(cfg["num_attention_heads"])
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    theta, scaling = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attn_bias = family == "qwen2" or bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if (family == "mistral" or cfg.get("use_sliding_window")) else None
    return ModelConfig(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=num_kv,
        head_dim=int(head_dim),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=attn_bias,
        o_bias=attn_bias and family in ("llama", "mistral"),
        qk_norm=family == "qwen3",
        sliding_window=int(window) if window else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
    )


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
    return parse_config(json.loads(path.read_text()))
