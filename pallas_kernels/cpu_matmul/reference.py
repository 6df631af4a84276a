"""What the native CPU matmul kernels compute, in jnp: the oracles their tests compare with
(pallas_kernels/cpu_matmul/__init__.py re-exports them)."""
from __future__ import annotations

import jax.numpy as jnp


def _check_act_bits(act_bits, who: str) -> int:
    if act_bits not in (8, 16) or isinstance(act_bits, bool):
        raise ValueError(f"{who}: act_bits must be 8 or 16, got {act_bits!r}")
    return int(act_bits)


def _bf16_dot_reference(x, w_q, w_scale):
    dot = jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w_q.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return dot * w_scale.astype(jnp.float32)[None, :]


def matmul_fp8_reference(x, w_q, w_scale):
    """What matmul_fp8 computes, in jnp: x and w_q in bf16 (w_q exactly), the dot in f32, then w_scale."""
    return _bf16_dot_reference(x, w_q, w_scale)


def matmul_int8_bf16_reference(x, w_q, w_scale):
    """What matmul_int8_bf16 computes, in jnp: x and w_q in bf16 (w_q exactly), the dot in f32, then w_scale."""
    return _bf16_dot_reference(x, w_q, w_scale)


def matmul_int8_reference(x, w_q, w_scale, act_bits: int = 8):
    """What matmul_int8 computes, in jnp: x [M, I] quantized per row (symmetric, 127 steps, or
    32767 with act_bits=16; an all-zero row gives zeros), the integer dot summed in int32, then
    both scales. act_bits=16: the dot's total may pass int32 (I * 32767 * 128), so it is summed
    as the kernel does: in 16 int32 lanes (lane l of each 32-wide chunk of I takes elements
    2l, 2l + 1), converted to float32 and added by the kernel's tree."""
    act_bits = _check_act_bits(act_bits, "matmul_int8_reference")
    x = x.astype(jnp.float32)
    steps = 127 if act_bits == 8 else 32767
    # the divisions as multiplications by reciprocals, as XLA compiles `/ 127` and `x / x_scale`
    # anyway (written out so that the kernel can do the same, bit for bit)
    x_scale = jnp.max(jnp.abs(x), axis=1) * jnp.float32(1 / steps)  # [M]
    inv = 1 / jnp.where(x_scale > 0, x_scale, 1)  # [M]
    x_q = jnp.where(x_scale[:, None] > 0, jnp.clip(jnp.round(x * inv[:, None]), -steps, steps), 0)
    if act_bits == 8:
        acc = jnp.einsum("mi,oi->mo", x_q.astype(jnp.int8), w_q, preferred_element_type=jnp.int32)  # [M, O]
        dot = acc.astype(jnp.float32)
    else:
        (m, i), o = x.shape, w_q.shape[0]
        # [.., I / 32 chunks, 4 128-bit blocks, 4 lanes, 2 of a pair] -> int32 lanes [M, O, 4, 4]
        lanes = jnp.einsum("mkbjp,okbjp->mobj", x_q.astype(jnp.int32).reshape(m, i // 32, 4, 4, 2),
                           w_q.astype(jnp.int32).reshape(o, i // 32, 4, 4, 2)).astype(jnp.float32)
        s = (lanes[..., 0] + lanes[..., 2]) + (lanes[..., 1] + lanes[..., 3])  # [M, O, 4]
        dot = (s[..., 0] + s[..., 1]) + (s[..., 2] + s[..., 3])
    return dot * x_scale[:, None] * w_scale.astype(jnp.float32)[None, :]


def matmul_bf16_reference(x, w):
    """What matmul_bf16 computes, in jnp."""
    return jnp.einsum("mi,oi->mo", x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32)
