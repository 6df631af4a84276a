"""Tensor-parallel layout of the model's weights on a device mesh with axes ("data", "model").

Megatron layout: the fused qkv and gate/up projections are column-parallel (their output
rows split over "model"), o and down row-parallel (their input columns split; XLA inserts
the sum), the embedding and lm_head split on the vocabulary, norms replicated. Nothing is
split over "data": data-parallel ranks hold whole copies.

A fused projection is split in contiguous row ranges, so before placing it the rows are
regrouped per shard: shard g holds [q heads of g | k heads of g | v heads of g] (and
[gate_g | up_g]). With tp = 1 that is exactly the checkpoint's own layout. When tp exceeds
the KV heads, each KV head is repeated so that every shard holds the one KV head its query
heads read (done once here, at load time, never per step).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
from jax.sharding import PartitionSpec as P

MODEL_AXIS = "model"
DATA_AXIS = "data"


@dataclass(frozen=True, slots=True)
class TPLayout:
    """How one model is cut over `tp` shards."""

    tp: int
    num_heads: int
    num_kv_heads: int  # KV heads stored: the checkpoint's, or tp when they are replicated
    head_dim: int
    split_vocab: bool  # embedding / lm_head split on the vocabulary (vocab divisible by tp)
    expert_parallel: bool = False  # MoE: whole experts split over "model" (else each expert's matrices)


def check_tp(cfg, tp: int, expert_parallel: bool = False) -> None:
    """Raises ValueError, saying what would work, when `cfg` cannot be split `tp` ways."""
    if tp < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
    if expert_parallel and not cfg.num_experts:
        raise ValueError("expert_parallel needs a mixture-of-experts model; this one has no experts")
    if tp == 1:
        if expert_parallel:
            logging.getLogger(__name__).warning("expert_parallel with tensor_parallel_size=1: every expert stays "
                                                "on the one device (set tensor_parallel_size to split them)")
        return
    ok = [d for d in range(1, cfg.num_heads + 1) if _splits(cfg, d, expert_parallel)]
    if not _splits(cfg, tp, expert_parallel):
        experts = f", {cfg.num_experts} experts of size {cfg.moe_intermediate_size}" if cfg.num_experts else ""
        raise ValueError(f"tensor_parallel_size={tp} does not split this model ({cfg.num_heads} query heads, "
                         f"{cfg.num_kv_heads} KV heads, intermediate size {cfg.intermediate_size}{experts}"
                         f"{', expert parallel' if expert_parallel else ''}); sizes that work: {ok}")


def _splits(cfg, tp: int, expert_parallel: bool = False) -> bool:
    heads_ok = cfg.num_heads % tp == 0
    kv_ok = cfg.num_kv_heads % tp == 0 or tp % cfg.num_kv_heads == 0
    has_dense = not cfg.moe_layers or not all(cfg.moe_layers)  # layers with a dense MLP
    dense_ok = not has_dense or cfg.intermediate_size % tp == 0
    experts_ok = not cfg.num_experts or (cfg.num_experts % tp == 0 if expert_parallel
                                         else cfg.moe_intermediate_size % tp == 0)
    shared_ok = cfg.shared_expert_intermediate_size % tp == 0
    return heads_ok and kv_ok and dense_ok and experts_ok and shared_ok


def tp_layout(cfg, tp: int, expert_parallel: bool = False) -> TPLayout:
    check_tp(cfg, tp, expert_parallel)
    kv = cfg.num_kv_heads if cfg.num_kv_heads % tp == 0 else tp  # replicated up to one per shard
    return TPLayout(tp, cfg.num_heads, kv, cfg.head_dim, cfg.vocab_size % tp == 0, expert_parallel)


def regroup_layer(layer: dict, cfg, layout: TPLayout) -> dict:
    """A layer's fused arrays (numpy) in per-shard order, KV heads repeated if needed."""
    if layout.tp == 1 and layout.num_kv_heads == cfg.num_kv_heads:
        return layer
    out = dict(layer)
    out["wqkv"] = _regroup_qkv(layer["wqkv"], cfg, layout)
    if "bqkv" in layer:
        out["bqkv"] = _regroup_qkv(layer["bqkv"], cfg, layout)
    for name, axis in (("w_gate_up", 0), ("shared_gate_up", 0), ("experts_gate_up", 1)):
        if name in layer and not (name == "experts_gate_up" and layout.expert_parallel):
            out[name] = _regroup_gate_up(layer[name], layout.tp, axis)
    return out


def _regroup_gate_up(w: np.ndarray, tp: int, axis: int) -> np.ndarray:
    """[.., 2 I, ..] (gate | up on `axis`) -> tp groups [gate_g | up_g]."""
    gate, up = np.split(w, 2, axis=axis)
    return np.concatenate([np.concatenate(pair, axis=axis) for pair in
                           zip(np.split(gate, tp, axis=axis), np.split(up, tp, axis=axis))], axis=axis)


def _regroup_qkv(w: np.ndarray, cfg, layout: TPLayout) -> np.ndarray:
    """[(H + 2 Hkv) D, ...] -> [(H + 2 Hkv') D, ...] as tp groups [q_g | k_g | v_g]."""
    h, hkv, d, tp = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, layout.tp
    q, k, v = np.split(w, [h * d, (h + hkv) * d], axis=0)
    rep = layout.num_kv_heads // hkv
    if rep > 1:  # head j of the stored set is checkpoint head j // rep
        k = np.repeat(k.reshape(hkv, d, *k.shape[1:]), rep, axis=0).reshape(-1, *k.shape[1:])
        v = np.repeat(v.reshape(hkv, d, *v.shape[1:]), rep, axis=0).reshape(-1, *v.shape[1:])
    groups = zip(np.split(q, tp), np.split(k, tp), np.split(v, tp))
    return np.concatenate([np.concatenate(g, axis=0) for g in groups], axis=0)


_COLUMN = {"wqkv", "bqkv", "w_gate_up"}  # output rows split
_ROW = {"wo", "w_down"}  # input columns split
_VOCAB = {"embed", "lm_head"}
_EXPERTS = {"experts_gate_up": 1, "experts_down": 2}  # [X, out, in]: the axis tensor parallelism splits


def param_spec(name: str, ndim: int, stacked: bool, layout: TPLayout) -> P:
    """PartitionSpec of parameter `name` (a leading layer axis when `stacked`)."""
    lead = (None,) if stacked else ()
    rest = ndim - len(lead)
    if layout.tp == 1:
        return P()
    if name in _EXPERTS:  # expert parallel: whole experts split, else each expert's matrices
        axis = 0 if layout.expert_parallel else _EXPERTS[name]
        return P(*lead, *[MODEL_AXIS if i == axis else None for i in range(rest)])
    if name in _COLUMN:
        return P(*lead, MODEL_AXIS, *([None] * (rest - 1)))
    if name in _ROW:
        return P(*lead, None, MODEL_AXIS)
    if name in _VOCAB and layout.split_vocab:
        return P(MODEL_AXIS, None)
    return P()
