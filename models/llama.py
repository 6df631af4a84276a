"""Flax NNX definition of the decoder families: Llama / Mistral / Qwen2 / Qwen3, Gemma 2 / 3,
and the mixture-of-experts Mixtral / Qwen3-MoE / Qwen2-MoE (their MLP is models.moe.MoE).

The families differ only in switches read from ModelConfig: q/k/v bias (Qwen2), q/k RMSNorm
(Qwen3, Gemma 3), tied embeddings, GQA ratio and explicit head_dim; Gemma's per-layer sliding
windows, attention and final-logit soft-capping, norms on the attention and MLP outputs,
query scale, scaled embeddings, GELU MLP and the sliding layers' own RoPE (Gemma 3). Weights keep Hugging Face's
[out, in] layout; `linear` contracts their last axis (on XLA:CPU about 10% faster than
[in, out] for decode-sized batches).

Precision: the matrices (embedding, q/k/v/o, gate/up/down, lm_head) are stored in the model
dtype; everything else (norm weights, biases) in float32. The residual stream, norms, rope,
attention softmax and logits run in float32; with bfloat16 matrices only the matmul inputs are
rounded to bfloat16, accumulated in float32 (`linear`), the standard mixed-precision recipe:
half the weight bytes, and on CPUs with AVX512-BF16/AMX, GPUs and TPUs the native bf16 dots.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax.sharding import NamedSharding, PartitionSpec as P

from pagedjax.models.config import ModelConfig
from pagedjax.models.kv_cache import AttentionMetadata, KVCache
from pagedjax.models.lora import LoRABatch
from pagedjax.models.moe import MoE
from pagedjax.models.quantization import QUANTIZED, quantize_weight
from pagedjax.models.sharding import TPLayout, param_spec, regroup_layer, tp_layout
from pagedjax.pallas_kernels import cpu_matmul
from pagedjax.platforms import current_platform, get_platform


def rms_norm(x, weight, eps):
    """HF-style RMSNorm: normalise in float32, cast back, then scale."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * x32.astype(x.dtype)


# Prompt-sized bf16 matmuls on a CPU without bf16 arithmetic (AVX2 only) take XLA's float32 dot
# on the weights widened to f32, not XLA's bf16 dot: on a 2-core AMD EPYC, SmolLM2-135M's 30
# layers at 256 rows 483 against 544 ms, at 512 rows 808 against 1068; at 128 rows the bf16
# dot still wins, 292 against 351 (scripts/bench_matmul.py --dtype bfloat16, "xla-f32", "xla").
WIDEN_BF16_MIN_ROWS = 256


def _cpu_lacks_bf16() -> bool:
    return not get_platform("cpu").fast_bf16  # read once: the CPU flags are cached


def linear(x, w, native: bool = False, scale=None, compute_dtype=jnp.bfloat16):
    """x [..., in] @ w[out, in].T -> [..., out] in float32. A narrower w (bf16) takes x
    rounded to its dtype and accumulates in float32; w is not widened to x's dtype (that
    converts the whole weight every step), except on a CPU without bf16 arithmetic from
    WIDEN_BF16_MIN_ROWS rows, where that pays. native: decode-sized x [M, in] goes to the CPU
    kernel (pallas_kernels.cpu_matmul) where one serves the shape and w's dtype; same result
    up to float32 rounding. scale [out]: w is quantized (int8 / float8, models.quantization),
    the real matrix w * scale[:, None]; see `quantized_linear`."""
    if scale is not None:
        return quantized_linear(x, w, scale, native, compute_dtype)
    if native and x.ndim == 2 and cpu_matmul.supported(x.shape[0], w.shape[1], w.shape[0], w.dtype):
        return cpu_matmul.matmul(x, w)
    if native and w.dtype == jnp.bfloat16 and x.size // x.shape[-1] >= WIDEN_BF16_MIN_ROWS and _cpu_lacks_bf16():
        # bf16 x bf16 products are exact in float32: the same sums as the bf16 dot below
        return jnp.einsum("...i,oi->...o", x.astype(w.dtype).astype(jnp.float32), w.astype(jnp.float32))
    return jnp.einsum("...i,oi->...o", x.astype(w.dtype), w, preferred_element_type=jnp.float32,
                      precision=_f32_precision(w.dtype))


def quantized_linear(x, w_q, scale, native: bool, compute_dtype):
    """x [..., in] @ (w_q [out, in] * scale [out, None]).T -> [..., out] float32. Decode-sized
    x on the CPU: a native kernel (pallas_kernels.cpu_matmul.matmul_quantized: bf16 models
    widen the 8-bit weights to bf16 in registers for bf16 dots, x rounded to bf16 as below;
    float32 models with int8 weights quantize x per row to int16 for exact integer sums). Else
    x and w_q in compute_dtype (the model dtype: int8 and e4m3 values are exact in bf16),
    float32 accumulation, the scale applied to the output columns."""
    if native and x.ndim == 2 and cpu_matmul.supported(x.shape[0], w_q.shape[1], w_q.shape[0], w_q.dtype):
        return cpu_matmul.matmul_quantized(x, w_q, scale, x_dtype=compute_dtype)
    y = jnp.einsum("...i,oi->...o", x.astype(compute_dtype), w_q.astype(compute_dtype),
                   preferred_element_type=jnp.float32, precision=_f32_precision(compute_dtype))
    return y * scale


def _f32_precision(dtype):
    """float32 weights on a GPU/TPU: full float32 passes (their default precision rounds f32
    matmul inputs to TF32 / bf16, which float32 users, and parity with transformers, do not
    expect). XLA:CPU always computes f32 dots in f32; its programs stay as they were."""
    return jax.lax.Precision.HIGHEST if dtype == jnp.float32 and current_platform().precise_f32_dots else None


def rope_cos_sin(positions, inv_freq):
    """positions [T] -> cos, sin [T, D] (HF's non-interleaved layout)."""
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [T, D/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def rope_table_once(positions, inv_freq):
    """rope_cos_sin, computed once per step into buffers of its own. Fused into each layer's
    rope instead, XLA computes cos and sin again for every head of every layer: on XLA:CPU
    2-5 ms of a 16-32 token decode step with SmolLM2 (scripts/trace_steps.py), a quarter of a
    2048-token prefill's elementwise time. XLA:CPU removes optimization barriers before it
    fuses, so there the table comes out of a conditional (whose results are buffers) with
    the same computation in both branches: the predicate, on a parameter XLA cannot fold,
    does not matter. Elsewhere an optimization barrier does it (a conditional would sync a GPU)."""
    if current_platform().fusion_barrier != "conditional":
        return jax.lax.optimization_barrier(rope_cos_sin(positions, inv_freq))
    table = lambda: rope_cos_sin(positions, inv_freq)
    return jax.lax.cond(inv_freq[0] >= 0, table, table)  # inv_freq: replicated wherever positions are sharded


def apply_rope(x, cos, sin):
    """x [T, N, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    x32 = x.astype(jnp.float32)
    return (x32 * cos[:, None] + rotated.astype(jnp.float32) * sin[:, None]).astype(x.dtype)


MATRICES = frozenset({"embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down", "experts_gate_up",
                      "experts_down"})  # stored in the model dtype
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_pytorch_tanh": lambda x: jax.nn.gelu(x, approximate=True),
               "gelu": lambda x: jax.nn.gelu(x, approximate=False)}


def soft_cap(x, cap):
    """cap * tanh(x / cap) (Gemma's logit soft-capping); x itself when cap is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _value(param):
    return None if param is None else param[...]


class Placement:
    """Where parameters go: the default device (mesh None), or each array's shards straight
    to their devices on `mesh` (models.sharding), so no device ever holds a whole split weight.
    The matrices (MATRICES) in `dtype`, the small vectors (norms, biases) in float32;
    with `quantization` the matrices in 8 bits with a scale per output row (`matrix`)."""

    def __init__(self, dtype, mesh=None, layout: TPLayout | None = None, stacked: bool = False,
                 quantization: str | None = None):
        self.dtype, self.mesh, self.layout, self.stacked = dtype, mesh, layout, stacked
        self.quantization = quantization
        # one CPU device: decode-sized matmuls may take a native kernel wherever one serves the
        # shape (cpu_matmul.supported), the vocab head too (platforms/cpu.py)
        platform = current_platform()
        self.native_matmul = (mesh is None or mesh.devices.size == 1) and platform.native_matmul(dtype)
        self.native_head = self.native_matmul and platform.native_head(dtype)

    def __call__(self, arrays: dict, name: str) -> nnx.Param:
        dtype = self.dtype if name in MATRICES else jnp.float32
        return self._put(np.asarray(arrays[name], dtype=dtype), param_spec(name, np.ndim(arrays[name]), self.stacked,
                                                                            self.layout))

    def matrix(self, arrays: dict, name: str) -> tuple[nnx.Param, nnx.Param | None]:
        """(weight, scale): matrix `name` in the model dtype and None, or quantized
        (models.quantization) and its float32 scale per output row, sharded with those rows."""
        if self.quantization is None or name not in QUANTIZED:
            return self(arrays, name), None
        w_q, scale = quantize_weight(arrays[name], self.quantization)
        spec = param_spec(name, w_q.ndim, self.stacked, self.layout)
        return self._put(w_q, spec), self._put(scale, P(*spec[:scale.ndim]))

    def _put(self, x: np.ndarray, spec: P) -> nnx.Param:
        if self.mesh is None:
            return nnx.Param(jnp.asarray(x))
        return nnx.Param(jax.device_put(x, NamedSharding(self.mesh, spec)))


class _LoRAMatmul:
    def lora_matmul(self, x, w):
        """The LoRA terms' two matmuls (models.lora.lora_delta) take the weights' path."""
        return linear(x, w, self.native)


class Attention(_LoRAMatmul, nnx.Module):
    def __init__(self, cfg: ModelConfig, arrays: dict, place: Placement, layout: TPLayout, window: int | None):
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, layout.num_kv_heads, cfg.head_dim
        self.num_shards = layout.tp
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        self.window, self.soft_cap = window, cfg.attn_soft_cap  # static: each layer's own
        # [(H + 2 Hkv) D, E]: q, k, v projections fused, as num_shards groups [q_g | k_g | v_g]
        self.wqkv, self.wqkv_scale = place.matrix(arrays, "wqkv")  # scale [(H + 2 Hkv) D] when quantized
        self.wo, self.wo_scale = place.matrix(arrays, "wo")  # [E, H D]
        self.native, self.compute_dtype = place.native_matmul, place.dtype
        for name in ("bqkv", "bo", "q_norm", "k_norm"):
            setattr(self, name, place(arrays, name) if name in arrays else None)

    def __call__(self, x, cos, sin, kv: KVCache, layer, md: AttentionMetadata, cache, lora: LoRABatch | None = None):
        """x [T,E] (the step's packed tokens) -> (new kv, out [T,E]). lora: this layer's
        adapters (models.lora), each token's term added to its q, k, v and o projections."""
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(x, self.wqkv[...], self.native, _value(self.wqkv_scale), self.compute_dtype)
        if self.bqkv is not None:
            qkv = qkv + self.bqkv[...]
        g = self.num_shards
        hq, hk = h // g, hkv // g
        qkv = qkv.reshape(t, g, hq + 2 * hk, d)  # each shard's [q_g | k_g | v_g] heads
        q = qkv[:, :, :hq].reshape(t, h, d)  # [T, H, D]
        k = qkv[:, :, hq:hq + hk].reshape(t, hkv, d)  # [T, Hkv, D]
        v = qkv[:, :, hq + hk:].reshape(t, hkv, d)
        if lora is not None:
            q = lora.add("q_proj", q, x, self.lora_matmul)
            k = lora.add("k_proj", k, x, self.lora_matmul)
            v = lora.add("v_proj", v, x, self.lora_matmul)
        if self.q_norm is not None:
            q = rms_norm(q, self.q_norm[...], self.eps)
            k = rms_norm(k, self.k_norm[...], self.eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        kv, o = cache.update_and_attend(kv, layer, q, k, v, md, scale=self.scale, sliding_window=self.window,
                                        soft_cap=self.soft_cap)  # o [T, H, D]
        o = o.reshape(t, h * d)
        out = linear(o, self.wo[...], self.native, _value(self.wo_scale), self.compute_dtype)
        if lora is not None:
            out = lora.add("o_proj", out, o, self.lora_matmul)
        if self.bo is not None:
            out = out + self.bo[...]
        return kv, out


class MLP(_LoRAMatmul, nnx.Module):
    def __init__(self, arrays: dict, place: Placement, layout: TPLayout, act=jax.nn.silu):
        self.act = act
        # [2 I, E]: gate and up fused, as shards [gate_g | up_g]; scales [2 I], [E] when quantized
        self.w_gate_up, self.w_gate_up_scale = place.matrix(arrays, "w_gate_up")
        self.w_down, self.w_down_scale = place.matrix(arrays, "w_down")  # [E, I]
        self.num_shards = layout.tp
        self.native, self.compute_dtype = place.native_matmul, place.dtype

    def __call__(self, x, lora: LoRABatch | None = None):
        """x [T, E] -> [T, E]; lora: this layer's adapters on gate, up and down."""
        gu = linear(x, self.w_gate_up[...], self.native, _value(self.w_gate_up_scale), self.compute_dtype)  # [T, 2 I]
        i = gu.shape[-1] // 2
        gu = gu.reshape(*gu.shape[:-1], self.num_shards, 2, i // self.num_shards)
        gate, up = gu[..., 0, :].reshape(*gu.shape[:-3], i), gu[..., 1, :].reshape(*gu.shape[:-3], i)
        if lora is not None:
            gate = lora.add("gate_proj", gate, x, self.lora_matmul)
            up = lora.add("up_proj", up, x, self.lora_matmul)
        act = self.act(gate) * up
        out = linear(act, self.w_down[...], self.native, _value(self.w_down_scale), self.compute_dtype)
        return out if lora is None else lora.add("down_proj", out, act, self.lora_matmul)


class DecoderLayer(nnx.Module):
    """Layer `index` of the model (under scan: any layer, all alike: ModelConfig.uniform_layers)."""

    def __init__(self, cfg: ModelConfig, arrays: dict, place: Placement, layout: TPLayout, index: int = 0,
                 moe_impl: str = "auto"):
        self.eps = cfg.rms_norm_eps
        self.local_rope = cfg.window(index) is not None and cfg.local_rope is not None
        self.input_norm = place(arrays, "input_norm")
        self.post_attention_norm = place(arrays, "post_attention_norm")  # before the MLP
        # Gemma: norms on the attention's and the MLP's outputs too
        self.attn_out_norm = place(arrays, "attn_out_norm") if cfg.sandwich_norms else None
        self.mlp_out_norm = place(arrays, "mlp_out_norm") if cfg.sandwich_norms else None
        self.attn = Attention(cfg, arrays, place, layout, cfg.window(index))
        act = ACTIVATIONS[cfg.hidden_act]
        if cfg.is_moe(index):
            shared = None
            if "shared_gate_up" in arrays:  # Qwen2-MoE
                shared = MLP({"w_gate_up": arrays["shared_gate_up"], "w_down": arrays["shared_down"]}, place, layout, act)
            self.mlp = MoE(cfg, arrays, place, layout, act, moe_impl, shared)
        else:
            self.mlp = MLP(arrays, place, layout, act)

    def __call__(self, x, rope, kv, layer, md, cache, lora: LoRABatch | None = None):
        """rope: {"global": (cos, sin), "local": ...} (models.llama.rope_table_once)."""
        cos, sin = rope["local" if self.local_rope else "global"]
        kv, h = self.attn(rms_norm(x, self.input_norm[...], self.eps), cos, sin, kv, layer, md, cache, lora)
        x = x + self._norm(h, self.attn_out_norm)
        h = self.mlp(rms_norm(x, self.post_attention_norm[...], self.eps), lora)
        return kv, x + self._norm(h, self.mlp_out_norm)

    def _norm(self, h, weight):
        return h if weight is None else rms_norm(h, weight[...], self.eps)


class CausalLM(nnx.Module):
    """Decoder-only LM. Build it from converted arrays with `models.load_model`.

    scan_layers=True stores the decoder layers stacked, one DecoderLayer whose parameters
    carry a leading layer axis [L, ...], run under `jax.lax.scan`: one layer body to compile
    whatever L (compiles several times faster). False keeps a list of layers, unrolled:
    XLA:CPU copies each layer's weights out of the stack before its matmuls (no fusion of a
    dynamic slice into a dot there), which costs a full extra pass over the weights per step.
    """

    def __init__(self, cfg: ModelConfig, arrays: dict[str, np.ndarray], dtype=jnp.float32, scan_layers: bool = False,
                 mesh=None, quantization: str | None = None, expert_parallel: bool = False, moe_impl: str = "auto",
                 placement: type = Placement, tp: int | None = None):
        """placement: what makes the parameters (models.weight_update traces the layout with its
        own); tp: the tensor-parallel layout without a mesh (default: the mesh's "model" axis)."""
        self.config = cfg
        self.scan_layers = scan_layers and cfg.uniform_layers  # Gemma's local/global layers: unrolled
        self.dtype = jnp.dtype(dtype)  # of the matrices (quantized: of their dots); activations are float32
        self.quantization = quantization  # None, "int8" or "fp8" (models.quantization)
        layout = tp_layout(cfg, tp or (1 if mesh is None else mesh.shape["model"]), expert_parallel)
        self.num_kv_heads = layout.num_kv_heads  # stored (replicated up to tp when tp > the model's)
        self.tp_layout = layout
        place = placement(dtype, mesh, layout, quantization=quantization)
        self.native_head = place.native_head
        self.embed = place(arrays, "embed")  # [V, E], never quantized (models.quantization.QUANTIZED)
        layers = [regroup_layer(layer, cfg, layout) for layer in arrays["layers"]]
        if self.scan_layers:
            stacked = {name: np.stack([np.asarray(layer[name]) for layer in layers]) for name in layers[0]}
            # every parameter [L, ...]
            self.layers = DecoderLayer(cfg, stacked, placement(dtype, mesh, layout, stacked=True,
                                                               quantization=quantization), layout, 0, moe_impl)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, layer, place, layout, i, moe_impl)
                                    for i, layer in enumerate(layers)])
        self.norm = place(arrays, "norm")
        self.lm_head = None if cfg.tie_word_embeddings else place(arrays, "lm_head")  # [V, E]
        self.inv_freq = nnx.Variable(jnp.asarray(cfg.inv_freq(), jnp.float32))
        self.local_inv_freq = None if cfg.local_rope is None else nnx.Variable(
            jnp.asarray(cfg.inv_freq(local=True), jnp.float32))
        # Gemma: embeddings times sqrt(E), that factor rounded to the matrices' dtype as transformers does
        self.embed_scale = None if cfg.embed_scale is None else float(np.asarray(cfg.embed_scale, self.dtype))

    def __call__(self, tokens, md: AttentionMetadata, kv: KVCache, cache, lora: LoRABatch | None = None):
        """tokens [T] (a packed step) -> (hidden [T, E] after the final norm, new kv).
        lora: the step's LoRA adapters (models.lora; None: the base model alone)."""
        x = self.embed[...][tokens].astype(jnp.float32)  # [T, E]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = {"global": rope_table_once(md.positions, self.inv_freq[...])}  # cos, sin [T, D] each
        if self.local_inv_freq is not None:
            rope["local"] = rope_table_once(md.positions, self.local_inv_freq[...])
        kv = tuple(kv)
        if not self.scan_layers:
            for i, layer in enumerate(self.layers):
                kv, x = layer(x, rope, kv, i, md, cache, None if lora is None else lora.layer(i))
            return rms_norm(x, self.norm[...], self.config.rms_norm_eps), kv
        graphdef, stacked = nnx.split(self.layers)

        def body(carry, xs):
            x, kv = carry
            layer_state, i, stacks = xs
            layer_lora = None if lora is None else LoRABatch(lora.slots, stacks)
            kv, x = nnx.merge(graphdef, layer_state)(x, rope, kv, i, md, cache, layer_lora)
            return (x, kv), None

        layer_ids = jnp.arange(self.config.num_layers, dtype=jnp.int32)
        stacks = None if lora is None else lora.stacks  # [L, ...] each: scanned with the layers
        (x, kv), _ = jax.lax.scan(body, (x, kv), (stacked, layer_ids, stacks))
        return rms_norm(x, self.norm[...], self.config.rms_norm_eps), kv

    def logits(self, hidden):
        """hidden [..., E] -> float32 logits [..., V]."""
        head = self.embed[...] if self.lm_head is None else self.lm_head[...]
        # the native kernel for decode-sized heads only (scripts/bench_matmul.py)
        logits = linear(hidden, head, self.native_head and hidden.shape[0] <= cpu_matmul.head_max_rows(head.dtype))
        return soft_cap(logits, self.config.final_soft_cap)
