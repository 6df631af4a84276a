"""Pre-quantized checkpoints in the compressed-tensors format (what llm-compressor writes).

config.json carries `quantization_config` with quant_method "compressed-tensors"; each quantized
Linear stores `<name>.weight` (int8, or float8_e4m3fn) beside `<name>.weight_scale` (per tensor
[1], per channel [O, 1] or per group [O, I / G]) and, for asymmetric int schemes,
`<name>.weight_zero_point`. Served here: 8-bit weights ("int-quantized", "float-quantized",
"naive-quantized" formats), symmetric or not, tensor / channel / group strategies. Activation
quantization in the config is ignored (the engine's quantization is weight-only). Packed 4-bit
formats are refused with a clear error.

`scheme(config)` names the engine quantization a checkpoint implies ("int8" / "fp8"), and
`dequantize_tensors` turns its weights into float32 matrices; the loader then quantizes them
again per output channel (models.quantization). For the common per-channel symmetric
checkpoints that gives back the stored int8 / e4m3 values and scales (up to float32 rounding
of the scale): the checkpoint's own numbers, not a second rounding.
"""
from __future__ import annotations

import numpy as np

FORMATS = ("int-quantized", "float-quantized", "naive-quantized")
_SUFFIXES = (".weight_scale", ".weight_zero_point", ".weight_g_idx", ".input_scale", ".input_zero_point",
             ".output_scale", ".output_zero_point", ".weight_shape")


def scheme(config: dict) -> str | None:
    """"int8" / "fp8" for a compressed-tensors config.json dict with 8-bit weights, None when
    the checkpoint is not compressed-tensors; ValueError for schemes this engine cannot read."""
    qc = config.get("quantization_config") or config.get("compression_config")
    if not qc or qc.get("quant_method") != "compressed-tensors":
        return None
    found = set()
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} (group {name!r}) is not supported; "
                             f"supported: {FORMATS} (8-bit weights)")
        if weights.get("num_bits") != 8 or weights.get("type") not in ("int", "float"):
            raise ValueError(f"compressed-tensors group {name!r}: {weights.get('num_bits')}-bit "
                             f"{weights.get('type')} weights are not supported (8-bit int or float only)")
        if weights.get("strategy") not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors group {name!r}: strategy {weights.get('strategy')!r} is not "
                             "supported (tensor, channel or group)")
        found.add("int8" if weights["type"] == "int" else "fp8")
    if len(found) != 1:
        raise ValueError(f"compressed-tensors checkpoint with weight schemes {sorted(found) or 'none'}: one 8-bit "
                         "scheme expected")
    return found.pop()


def dequantize_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every `X.weight` with an `X.weight_scale` as float32 (q - zero_point) * scale; the scale,
    zero-point and activation-scale tensors dropped; the rest as they are."""
    out = {}
    for name, array in tensors.items():
        if name.endswith(_SUFFIXES):
            continue
        scale = tensors.get(f"{name}_scale") if name.endswith(".weight") else None
        if scale is None:
            out[name] = array
            continue
        q = np.asarray(array).astype(np.float32)
        if f"{name}_zero_point" in tensors:
            q = q - _per_column(np.asarray(tensors[f"{name}_zero_point"]).astype(np.float32), q.shape, name)
        out[name] = q * _per_column(np.asarray(scale).astype(np.float32), q.shape, name)
    return out


def _per_column(x: np.ndarray, shape: tuple[int, int], name: str) -> np.ndarray:
    """A scale or zero point ([1], [O, 1] or [O, I / G]) broadcast to the weight's [O, I]."""
    o, i = shape
    x = x.reshape(1, 1) if x.size == 1 else x.reshape(x.shape[0], -1)
    if x.shape[0] not in (1, o) or i % x.shape[1]:
        raise ValueError(f"{name}: quantization parameters of shape {x.shape} do not fit a weight of shape {shape}")
    return np.repeat(x, i // x.shape[1], axis=1)
