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
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
}
GEMMA = ("gemma2", "gemma3_text")
MOE = ("mixtral", "qwen3_moe", "qwen2_moe")
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the model definition needs, in one flat record."""

    family: str  # a value of SUPPORTED_ARCHITECTURES
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
    # Gemma 2 / 3 (defaults: the Llama family)
    layer_windows: tuple[int | None, ...] = ()  # each layer's sliding window (None: full attention); () all None
    local_rope: tuple[float, tuple | None] | None = None  # (theta, scaling) of sliding layers when they differ
    attn_scale: float | None = None  # q.k multiplier (query_pre_attn_scalar ** -0.5); None: head_dim ** -0.5
    attn_soft_cap: float | None = None  # attention scores -> cap * tanh(scores / cap)
    final_soft_cap: float | None = None  # logits -> cap * tanh(logits / cap)
    embed_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden_size))
    sandwich_norms: bool = False  # Gemma: norms on the attention and MLP outputs too
    hidden_act: str = "silu"  # of the gated MLP: silu | gelu_pytorch_tanh
    # mixture of experts (num_experts 0: every layer a dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    moe_layers: tuple[bool, ...] = ()  # which layers are sparse (the rest dense MLPs)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: a gated shared expert beside the routed ones

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def is_moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

    @property
    def uniform_layers(self) -> bool:
        """Every layer the same computation (one body can run them all under scan)."""
        return len(set(self.layer_windows)) <= 1 and len(set(self.moe_layers)) <= 1

    def inv_freq(self, local: bool = False) -> np.ndarray:
        """RoPE inverse frequencies [head_dim // 2] (float64), scaling applied; local: of the
        sliding-window layers (Gemma 3 gives them their own theta)."""
        theta, scaling = self.local_rope if (local and self.local_rope) else (self.rope_theta, self.rope_scaling)
        d = self.head_dim
        inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        if scaling is None:
            return inv
        p = dict(scaling)
        if p.get("rope_type") == "linear":
            return inv / float(p["factor"])
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


def _rope(cfg: dict, layer_type: str | None = None, default_theta: float = 10000.0) -> tuple[float, tuple | None]:
    """Reads RoPE settings from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`;
    layer_type: the entry of a per-layer-type `rope_parameters` (Gemma 3)."""
    params = cfg.get("rope_parameters") or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    scaling = cfg.get("rope_scaling") or {}
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), (("rope_type", "linear"), ("factor", float(merged["factor"])))
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        missing = [k for k in keys if k not in merged]
        if missing:
            raise ValueError(f"llama3 RoPE scaling is missing {missing} in config.json")
        return float(theta), tuple((k, merged[k]) for k in keys)
    raise ValueError(f"unsupported RoPE scaling type {rope_type!r}; supported: 'default', 'linear', 'llama3'")


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
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True (an encoder-style Gemma) is not supported")
    num_heads = int(cfg["num_attention_heads"])
    num_kv = int(cfg.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv}")
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    num_layers = int(cfg["num_hidden_layers"])
    extra = _gemma(cfg, family, num_layers, int(head_dim)) if family in GEMMA else {}
    if family in MOE:
        extra.update(_moe(cfg, family, num_layers))
    theta, scaling = _rope(cfg, FULL if family == "gemma3_text" else None,
                           1e6 if family == "gemma3_text" else 10000.0)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    attn_bias = family in ("qwen2", "qwen2_moe") or bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window") if (family in ("mistral", "mixtral") or cfg.get("use_sliding_window")) else None
    if window and family not in GEMMA:
        extra["layer_windows"] = _qwen_windows(cfg, family, num_layers, int(window))
    return ModelConfig(
        family=family,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=num_layers,
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
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        sliding_window=int(window) if window else extra.pop("sliding_window", None),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=eos_ids,
        torch_dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "float32"),
        **extra,
    )


def _qwen_windows(cfg: dict, family: str, num_layers: int, window: int) -> tuple:
    """Mistral/Mixtral: every layer slides. Qwen2/3 (use_sliding_window): the layers from
    max_window_layers on slide, the first ones attend fully."""
    if family in ("mistral", "mixtral"):
        return (window,) * num_layers
    first = int(cfg.get("max_window_layers", num_layers))
    types = cfg.get("layer_types")
    if types:
        return tuple(window if t == SLIDING else None for t in types)
    return tuple(window if i >= first else None for i in range(num_layers))


def _gemma(cfg: dict, family: str, num_layers: int, head_dim: int) -> dict:
    """Gemma 2 / 3: interleaved sliding and full layers, soft-capping, sandwich norms, scaled
    embeddings and queries (transformers' Gemma2/Gemma3TextConfig defaults when absent)."""
    window = int(cfg.get("sliding_window") or 4096)
    types = cfg.get("layer_types")
    if not types:
        pattern = 2 if family == "gemma2" else int(cfg.get("sliding_window_pattern", 6))
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must give {num_layers} entries of {SLIDING!r} / {FULL!r}, got {types}")
    gemma2 = family == "gemma2"
    local = None
    if not gemma2:  # Gemma 3: the sliding layers' own RoPE (old configs: rope_local_base_freq, no scaling)
        params = (cfg.get("rope_parameters") or {}).get(SLIDING)
        local = _rope({"rope_parameters": params}) if params else (float(cfg.get("rope_local_base_freq", 10000.0)), None)
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ValueError(f"unsupported Gemma hidden_activation {act!r}")
    return dict(
        layer_windows=tuple(window if t == SLIDING else None for t in types),
        sliding_window=window,
        local_rope=local,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attn_soft_cap=cfg.get("attn_logit_softcapping", 50.0 if gemma2 else None),
        final_soft_cap=cfg.get("final_logit_softcapping", 30.0 if gemma2 else None),
        embed_scale=float(cfg["hidden_size"]) ** 0.5,
        sandwich_norms=True,
        hidden_act=act,  # "gelu": exact (erf), as transformers' ACT2FN
    )


def _moe(cfg: dict, family: str, num_layers: int) -> dict:
    """Mixtral / Qwen3-MoE / Qwen2-MoE routing and expert sizes."""
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(f"a {family} config needs num_experts >= 1 and 1 <= num_experts_per_tok <= num_experts, "
                         f"got {experts} and {top_k}")
    if family == "mixtral":
        return dict(num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=int(cfg["intermediate_size"]),
                    norm_topk_prob=True, moe_layers=(True,) * num_layers)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense = set(cfg.get("mlp_only_layers") or [])
    return dict(num_experts=experts, num_experts_per_tok=top_k,
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # transformers' default
                moe_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                if family == "qwen2_moe" else 0)


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no config.json; expected a Hugging Face model directory")
    return parse_config(json.loads(path.read_text()))
