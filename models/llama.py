"""Flax NNX definition of the Llama / Mistral / Qwen2 / Qwen3 decoder family.

The families differ only in switches read from ModelConfig: q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3), tied embeddings, GQA ratio and explicit head_dim. Weights keep Hugging Face's
[out, in] layout; `linear` contracts their last axis (on XLA:CPU about 10% faster than
[in, out] for decode-sized batches).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.config import ModelConfig
from models.kv_cache import AttentionMetadata, KVCache


def rms_norm(x, weight, eps):
    """HF-style RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


def linear(x, w):
    """x [..., in] @ w[out, in].T -> [..., out]."""
    return jnp.einsum("...i,oi->...o", x, w)


def rope_cos_sin(positions, inv_freq):
    """positions [T] -> cos, sin [T, D] (HF's non-interleaved layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [T, N, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    x32 = x.astype(jnp.float32)
    return (x32 * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]).astype(x.dtype)


def _param(arrays: dict, name: str, dtype):
    return nnx.Param(jnp.asarray(arrays[name], dtype=dtype))


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, arrays: dict, dtype):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.wqkv = _param(arrays, "wqkv", dtype)  # [(H + 2 Hkv) D, E]: q, k, v projections fused
        self.wo = _param(arrays, "wo", dtype)  # [E, H D]
        for name in ("bqkv", "bo", "q_norm", "k_norm"):
            setattr(self, name, _param(arrays, name, dtype) if name in arrays else None)

    def __call__(self, x, cos, sin, kv: KVCache, layer, md: AttentionMetadata, cache):
        """x [T,E] (the step's packed tokens) -> (new kv, out [T,E])."""
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.wqkv[...])
        if self.bqkv is not None:
            qkv = qkv + self.bqkv[...]
        q = qkv[:, :h * d].reshape(t, h, d)  # [T, H, D]
        k = qkv[:, h * d:(h + hkv) * d].reshape(t, hkv, d)  # [T, Hkv, D]
        v = qkv[:, (h + hkv) * d:].reshape(t, hkv, d)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv, o = cache.update_and_attend(kv, layer, q, k, v, md, scale=d ** -0.5)  # o [T, H, D]
        out = linear(o.reshape(t, h * d), self.wo[...])
        if self.bo is not None:
            out = out + self.bo[...]
        return kv, out


class MLP(nnx.Module):
    def __init__(self, arrays: dict, dtype):
        self.w_gate_up = _param(arrays, "w_gate_up", dtype)  # [2 I, E]: gate and up fused
        self.w_down = _param(arrays, "w_down", dtype)  # [E, I]

    def __call__(self, x):
        gate, up = jnp.split(linear(x, self.w_gate_up[...]), 2, axis=-1)
        return linear(jax.nn.silu(gate) * up, self.w_down[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, arrays: dict, dtype):
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param(arrays, "input_norm", dtype)
        self.post_attention_norm = _param(arrays, "post_attention_norm", dtype)
        self.attn = Attention(cfg, arrays, dtype)
        self.mlp = MLP(arrays, dtype)

    def __call__(self, x, cos, sin, kv, layer, md, cache):
        kv, h = self.attn(rms_norm(x, self.input_norm[...], self.eps), cos, sin, kv, layer, md, cache)
        x = x + h
        x = x + self.mlp(rms_norm(x, self.post_attention_norm[...], self.eps))
        return kv, x


class CausalLM(nnx.Module):
    """Decoder-only LM. Build it from converted arrays with `models.load_model`.

    scan_layers=True stores the decoder layers stacked, one DecoderLayer whose parameters
    carry a leading layer axis [L, ...], run under `jax.lax.scan`: one layer body to compile
    whatever L (compiles several times faster). False keeps a list of layers, unrolled:
    XLA:CPU copies each layer's weights out of the stack before its matmuls (no fusion of a
    dynamic slice into a dot there), which costs a full extra pass over the weights per step.
    """

    def __init__(self, cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype=jnp.float32, scan_layers: bool = False):
        self.config = cfg
        self.scan_layers = scan_layers
        self.embed = _param(arrays, "embed", dtype)  # [V, E]
        layers = arrays["layers"]
        if scan_layers:
            stacked = {name: np.stack([np.asarray(layer[name]) for layer in layers]) for name in layers[0]}
            self.layers = DecoderLayer(cfg, stacked, dtype)  # every parameter [L, ...]
        else:
            self.layers = nnx.List([DecoderLayer(cfg, layer, dtype) for layer in layers])
        self.norm = _param(arrays, "norm", dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(arrays, "lm_head", dtype)  # [V, E]
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.inv_freq(), jnp.float32))

    def __call__(self, tokens, md: AttentionMetadata, kv: KVCache, cache):
        """tokens [T] (a packed step) -> (hidden [T, E] after the final norm, new kv)."""
        x = self.embed[...][tokens]  # [T, E]
        cos, sin = rope_cos_sin(md.positions, self.inv_freq[...])
        kv = tuple(kv)
        if not self.scan_layers:
            for i, layer in enumerate(self.layers):
                kv, x = layer(x, cos, sin, kv, i, md, cache)
            return rms_norm(x, self.norm[...], self.config.rms_norm_eps), kv
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            x, kv = carry
            layer_state, i = xs
            kv, x = nnx.merge(graphdef, layer_state)(x, cos, sin, kv, i, md, cache)
            return (x, kv), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        (x, kv), _ = jax.lax.scan(body, (x, kv), (stacked, layer_ids))
        return rms_norm(x, self.norm[...], self.config.rms_norm_eps), kv

    def logits(self, hidden):
        """hidden [..., E] -> float32 logits [..., V]."""
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...e,ve->...v", hidden, head, preferred_element_type=jnp.float32)
