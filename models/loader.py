"""Loads a checkpoint directory into a CausalLM plus its config and tokenizer (no engine needed)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from pagedjax.models import compressed_tensors
from pagedjax.models.config import GEMMA, ModelConfig, load_config
from pagedjax.models.dtypes import resolve_dtype, resolve_kv_cache_dtype  # noqa: F401  (re-exported)
from pagedjax.models.hub import resolve_model_dir  # noqa: F401  (re-exported)
from pagedjax.models.llama import CausalLM
from pagedjax.models.quantization import check_quantization
from pagedjax.models.sharding import MODEL_AXIS, check_tp

_LAYER_NAMES = {  # our name -> HF suffix under model.layers.{i}.
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "bq": "self_attn.q_proj.bias",
    "bk": "self_attn.k_proj.bias",
    "bv": "self_attn.v_proj.bias",
    "bo": "self_attn.o_proj.bias",
    "q_norm": "self_attn.q_norm.weight",
    "k_norm": "self_attn.k_norm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
    "input_norm": "input_layernorm.weight",
    "post_attention_norm": "post_attention_layernorm.weight",
}
_OPTIONAL = {"bq", "bk", "bv", "bo", "q_norm", "k_norm"}
_GEMMA_NORMS = {  # Gemma's sandwich norms (ours -> HF), replacing post_attention_norm's source
    "attn_out_norm": "post_attention_layernorm.weight",
    "post_attention_norm": "pre_feedforward_layernorm.weight",  # the pre-MLP norm, as in Llama
    "mlp_out_norm": "post_feedforward_layernorm.weight",
}
_MOE = {  # family -> (the block's HF prefix, router, expert gate / up / down)
    "mixtral": ("block_sparse_moe", "gate.weight", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", "gate.weight", ("gate_proj", "up_proj", "down_proj")),
}


def convert_hf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray], gemma_offset: bool = True) -> dict:
    """HF-named tensors -> the nested arrays CausalLM takes (weights stay [out, in]).
    A base-model checkpoint (saved as Qwen3Model etc., as embedding models such as
    Qwen3-Embedding are: no "model." prefix, no lm_head) loads too; with no lm_head the output
    layer is the embedding matrix (generation then means little; embeddings are exact)."""
    if "model.embed_tokens.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors = {k if k.startswith("lm_head.") else "model." + k: v for k, v in tensors.items()}

    def take(name: str) -> np.ndarray:
        if name not in tensors:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return tensors[name]

    names = dict(_LAYER_NAMES, **(_GEMMA_NORMS if cfg.sandwich_norms else {}))
    layers = []
    for i in range(cfg.num_layers):
        layer = {}
        for ours, suffix in names.items():
            name = f"model.layers.{i}.{suffix}"
            if ours in _OPTIONAL:
                wanted = (ours in ("bq", "bk", "bv") and cfg.attention_bias) or (ours == "bo" and cfg.o_bias) \
                    or (ours in ("q_norm", "k_norm") and cfg.qk_norm)
                if not wanted:
                    continue
            if ours in ("w_gate", "w_up", "w_down") and cfg.is_moe(i):
                continue
            layer[ours] = take(name)
        if cfg.is_moe(i):
            layer.update(_experts(cfg, i, take))
        layers.append(_fuse(layer))
    arrays = {"embed": take("model.embed_tokens.weight"), "norm": take("model.norm.weight"), "layers": layers}
    if not cfg.tie_word_embeddings:
        arrays["lm_head"] = tensors.get("lm_head.weight")
        if arrays["lm_head"] is None:
            logging.getLogger(__name__).warning("the checkpoint has no lm_head.weight (a base model): the output "
                                                "layer is the embedding matrix; embeddings are exact, generation "
                                                "is not")
            arrays["lm_head"] = arrays["embed"]
    if cfg.family in GEMMA and gemma_offset:  # Gemma's RMSNorm scales by 1 + weight: stored here as that sum
        # summed in float32 (a bf16 checkpoint's 1 + w would round to bf16; transformers adds in float32)
        arrays["norm"] = np.asarray(arrays["norm"], np.float32) + 1.0
        for layer in layers:
            for name in [n for n in layer if n.endswith("norm")]:
                layer[name] = np.asarray(layer[name], np.float32) + 1.0
    return arrays


def _experts(cfg: ModelConfig, i: int, take) -> dict:
    """Layer i's router and experts stacked: experts_gate_up [X, 2 I, E] (each expert's gate
    then up rows), experts_down [X, E, I]; Qwen2-MoE's shared expert beside them."""
    block, router, (gate, up, down) = _MOE[cfg.family]
    prefix = f"model.layers.{i}.{block}"
    expert = lambda e, w: take(f"{prefix}.experts.{e}.{w}.weight")
    out = {"router": take(f"{prefix}.{router}"),
           "experts_gate_up": np.stack([np.concatenate([expert(e, gate), expert(e, up)]) for e in range(cfg.num_experts)]),
           "experts_down": np.stack([expert(e, down) for e in range(cfg.num_experts)])}
    if cfg.shared_expert_intermediate_size:
        shared = lambda w: take(f"{prefix}.shared_expert.{w}.weight")
        out.update(shared_gate_up=np.concatenate([shared("gate_proj"), shared("up_proj")]),
                   shared_down=shared("down_proj"), shared_gate=take(f"{prefix}.shared_expert_gate.weight"))
    return out


def _fuse(layer: dict) -> dict:
    """Concatenates q/k/v (weights and biases) and gate/up so each runs as one matmul."""
    layer["wqkv"] = np.concatenate([layer.pop("wq"), layer.pop("wk"), layer.pop("wv")], axis=0)
    if "bq" in layer:
        layer["bqkv"] = np.concatenate([layer.pop("bq"), layer.pop("bk"), layer.pop("bv")])
    if "w_gate" in layer:
        layer["w_gate_up"] = np.concatenate([layer.pop("w_gate"), layer.pop("w_up")], axis=0)
    return layer


def load_tokenizer(model_dir: str | Path):
    """The directory's HF tokenizer, or None when it ships none (token-id prompts only)."""
    model_dir = Path(model_dir)
    if (model_dir / "tokenizer.json").is_file():  # the fast path; AutoTokenizer would import torch
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir))
    names = ("tokenizer.model", "vocab.json", "tokenizer_config.json")
    if not any((model_dir / n).is_file() for n in names):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def default_scan_layers() -> bool:
    """Layers under scan (fast compiles) except on XLA:CPU, where the unrolled model steps
    faster (see CausalLM): the platform's answer."""
    from pagedjax.platforms import current_platform

    return current_platform().scan_layers


LOAD_FORMATS = ("auto", "dummy")


def load_model(model: str | Path | None = None, dtype: str = "auto", scan_layers: bool | None = None, mesh=None,
               quantization: str | None = None, expert_parallel: bool = False, moe_impl: str = "auto",
               load_format: str = "auto", weights=None):
    """Returns (CausalLM, ModelConfig, tokenizer) for a local HF dir, or the default model.
    scan_layers: None picks `default_scan_layers()`. mesh: a ("data", "model") Mesh to split
    the weights over "model" (models.sharding); each device receives only its shards.
    quantization: None, "int8" or "fp8": the matrices quantized as they load (models.quantization);
    None on a compressed-tensors checkpoint: its own scheme (models.compressed_tensors).
    expert_parallel, moe_impl: a mixture-of-experts model's layout and expert matmuls (models.moe).
    load_format: "auto" reads the directory's weights; "dummy" reads only its config and
    tokenizer and makes random weights of the right shapes (to receive real ones later,
    LLM.update_weights). weights: Hugging Face-named arrays (a mapping or (name, array)
    pairs, numpy or jax) used instead of the directory's weight files."""
    from pagedjax.models.weights import load_tensors_from_dir
    from pagedjax.models import weight_update

    check_quantization(quantization)
    model_dir = resolve_model_dir(model)
    cfg = load_config(model_dir)
    check_tp(cfg, 1 if mesh is None else mesh.shape[MODEL_AXIS], expert_parallel)  # before reading any weights
    if moe_impl != "auto" and not cfg.num_experts:
        raise ValueError(f"moe_impl={moe_impl!r} applies to mixture-of-experts models; this one has no experts "
                         f"(leave it at 'auto')")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {load_format!r}")
    stored = compressed_tensors.scheme(json.loads((model_dir / "config.json").read_text()))
    if weights is not None:
        tensors = _given_tensors(cfg, weight_update.named_arrays(weights))
        stored = None
    elif load_format == "dummy":
        tensors, stored = weight_update.random_tensors(cfg), None
    else:
        tensors = load_tensors_from_dir(model_dir)
    if stored is not None:  # a pre-quantized checkpoint: served in its own 8-bit scheme unless told otherwise
        tensors = compressed_tensors.dequantize_tensors(tensors)
        quantization = quantization or stored
    arrays = convert_hf_tensors(cfg, tensors)
    scan = default_scan_layers() if scan_layers is None else scan_layers
    model = CausalLM(cfg, arrays, resolve_dtype(dtype, cfg), scan_layers=scan, mesh=mesh, quantization=quantization,
                     expert_parallel=expert_parallel, moe_impl=moe_impl)
    return model, cfg, load_tokenizer(model_dir)


def _given_tensors(cfg: ModelConfig, weights: dict) -> dict:
    """weights (HF names) checked against what the model needs: every tensor, no other, each
    of its shape (ValueError naming what is wrong)."""
    from pagedjax.models.weight_update import needed_tensors

    wanted = needed_tensors(cfg)
    missing = sorted(set(wanted) - set(weights))
    unknown = sorted(set(weights) - set(wanted) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set()))
    wrong = [f"{n}: {tuple(np.shape(weights[n]))} != {wanted[n]}" for n in wanted
             if n in weights and tuple(np.shape(weights[n])) != wanted[n]]
    if missing or unknown or wrong:
        raise ValueError(f"weights do not fit the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                         f"unknown {unknown[:5]}{'...' if len(unknown) > 5 else ''}, wrong shapes {wrong[:5]}")
    return {n: weights[n] for n in wanted}
