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
from models.kv_cache import AttentionMetadata, LayerKV


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


Segment = tuple[jax.Array, AttentionMetadata]  # (tokens [S, Q], metadata): one padded grid of a step


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

    def __call__(self, x, cos, sin, layer_kv: LayerKV, segments: list[tuple[int, int, AttentionMetadata]], cache):
        """x [T,E] (the segments' tokens, flattened and concatenated) -> (new layer_kv, out [T,E])."""
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
        outs, off = [], 0
        for s, nq, md in segments:  # attention per padded grid (decode rows, prompt chunks)
            sl = slice(off, off + s * nq)
            layer_kv, o = cache.update_and_attend(layer_kv, q[sl].reshape(s, nq, h, d), k[sl].reshape(s, nq, hkv, d),
                                                  v[sl].reshape(s, nq, hkv, d), md, scale=d ** -0.5)
            outs.append(o.reshape(s * nq, h * d))
            off += s * nq
        out = linear(jnp.concatenate(outs), self.wo[...])
        if self.bo is not None:
            out = out + self.bo[...]
        return layer_kv, out


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

    def __call__(self, x, cos, sin, layer_kv, segments, cache):
        layer_kv, h = self.attn(rms_norm(x, self.input_norm[...], self.eps), cos, sin, layer_kv, segments, cache)
        x = x + h
        x = x + self.mlp(rms_norm(x, self.post_attention_norm[...], self.eps))
        return layer_kv, x


class CausalLM(nnx.Module):
    """Decoder-only LM. Build it from converted arrays with `models.load_model`."""

    def __init__(self, cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype=jnp.float32):
        self.config = cfg
        self.embed = _param(arrays, "embed", dtype)  # [V, E]
        self.layers = nnx.List([DecoderLayer(cfg, layer, dtype) for layer in arrays["layers"]])
        self.norm = _param(arrays, "norm", dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _param(arrays, "lm_head", dtype)  # [V, E]
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.inv_freq(), jnp.float32))

    def __call__(self, tokens, md: AttentionMetadata, kv_caches: list[LayerKV], cache):
        """tokens [S,Q] -> (hidden [S,Q,E] after the final norm, new kv_caches)."""
        hidden, kv_caches = self.forward_segments([(tokens, md)], kv_caches, cache)
        return hidden.reshape(*tokens.shape, -1), kv_caches

    def forward_segments(self, segments: list[Segment], kv_caches: list[LayerKV], cache):
        """Several padded grids in one pass (e.g. decode rows [Sd, 1] and prompt chunks [Sp, Q]):
        matmuls run on all their tokens at once, attention per grid. Returns (hidden [T, E]
        for the flattened, concatenated tokens after the final norm, new kv_caches)."""
        tokens = jnp.concatenate([t.reshape(-1) for t, _ in segments])  # [T]
        positions = jnp.concatenate([md.positions.reshape(-1) for _, md in segments])
        shapes = [(t.shape[0], t.shape[1], md) for t, md in segments]
        x = self.embed[...][tokens]  # [T, E]
        cos, sin = rope_cos_sin(positions, self.inv_freq[...])
        new_caches = []
        for layer, layer_kv in zip(self.layers, kv_caches):
            layer_kv, x = layer(x, cos, sin, layer_kv, shapes, cache)
            new_caches.append(layer_kv)
        return rms_norm(x, self.norm[...], self.config.rms_norm_eps), new_caches

    def logits(self, hidden):
        """hidden [..., E] -> float32 logits [..., V]."""
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        return jnp.einsum("...e,ve->...v", hidden, head, preferred_element_type=jnp.float32)
