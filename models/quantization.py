"""Weight quantization: the model's matrices stored in 8 bits with per-output-channel scales.

`quantization` (LLM(quantization=...), --quantization):
  None     the matrices in the model dtype (bfloat16 or float32), as before
  "int8"   symmetric int8, w ~ w_q[o, i] * scale[o], scale = max_i |w[o, i]| / 127
  "fp8"    float8 e4m3 (e4m3fn), w ~ w_q[o, i] * scale[o], scale = max_i |w[o, i]| / 448

Computed at load from the bf16 / float32 checkpoint (numpy, before the arrays go to their
devices), for the matrices in QUANTIZED: the fused q/k/v, o, gate/up and down projections
(90% of a small model's decode matmul work beside its head). The embedding and the lm_head
stay in the model dtype (the logits are where 8-bit error shows most), norms and biases in
float32.

The matmul (`models.llama.linear`) takes (w_q, scale): x and w_q go to the model dtype's dot
(int8 and e4m3 values are exact in bfloat16) accumulating in float32, and the scale multiplies
the output columns; on a CPU, decode-sized batches may take a native kernel instead
(`quantized_linear`). Tensor parallelism shards a scale with its matrix's output rows
(models.sharding.param_spec).
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

QUANTIZATIONS = ("int8", "fp8")
QUANTIZED = frozenset({"wqkv", "wo", "w_gate_up", "w_down"})
_FORMATS = {"int8": (jnp.int8, 127.0), "fp8": (jnp.float8_e4m3fn, 448.0)}  # storage dtype, largest value


def check_quantization(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be None or one of {QUANTIZATIONS}, got {quantization!r}")


def quantize_weight(w: np.ndarray, quantization: str) -> tuple[np.ndarray, np.ndarray]:
    """w [..., O, I] -> (w_q [..., O, I] in the storage dtype, scale [..., O] float32), one
    scale per output row (a leading layer axis, if any, kept); all-zero rows get scale 1."""
    check_quantization(quantization)
    dtype, qmax = _FORMATS[quantization]
    w = np.asarray(w, dtype=np.float32)
    amax = np.abs(w).max(axis=-1)
    scale = np.where(amax > 0, amax / qmax, 1.0).astype(np.float32)
    scaled = np.clip(w / scale[..., None], -qmax, qmax)
    q = np.rint(scaled).astype(np.int8) if quantization == "int8" else scaled.astype(jnp.float8_e4m3fn)
    return q, scale


def dequantize_weight(w_q, scale):
    """The float32 matrix w_q * scale[..., None] (tests, references)."""
    return w_q.astype(jnp.float32) * scale[..., None]
