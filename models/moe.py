"""Mixture-of-experts feed-forward block (Mixtral, Qwen3-MoE, Qwen2-MoE's shared expert).

Routing: softmax over the router's logits in float32, the top k experts per token, their
weights renormalised to sum to 1 where the config says so (Mixtral always, Qwen norm_topk_prob).

Expert matmuls, computing only the experts each token chose (`impl`):
  "sorted"  the T * k (token, expert) assignments sorted by expert, then a loop over the
            experts that were chosen, each multiplying its own rows in tiles of `tile` rows
            (a loop whose trip counts are read on the device: empty experts cost nothing).
            XLA:CPU's default: `jax.lax.ragged_dot` there is a slow generic loop.
  "ragged"  the same sorted rows through `jax.lax.ragged_dot_general` (one grouped matmul:
            the accelerators' default, where XLA has a grouped GEMM).
  "dense"   every expert on every token, unchosen ones weighted 0: the reference and the
            baseline of scripts/bench_moe.py.

Parallelism on the ("data", "model") mesh, under shard_map: tokens split over "data" as
elsewhere; over "model" either each expert's matrices are split like a dense MLP's (tensor
parallel: gate/up rows, down columns) or, with expert_parallel, whole experts are split
(device r holds experts [r E/n, (r + 1) E/n)). Every device routes its tokens (the router is
replicated), computes what its slice of the experts owes them and a sum over "model" gives
each token its output: the all-reduce the tensor-parallel MLP needs anyway stands in for the
dispatch / combine all-to-all, with no capacity limit and no dropped token.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pagedjax.models.sharding import DATA_AXIS, MODEL_AXIS
from pagedjax.platforms import current_platform

IMPLS = ("auto", "sorted", "ragged", "dense")


def resolve_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"unknown MoE impl {impl!r}; expected one of {IMPLS}")
    if impl == "auto":
        return current_platform().moe_impl  # "sorted" on XLA:CPU, "ragged" elsewhere
    return impl


def route(x, router, top_k: int, normalize: bool):
    """x [T, E] f32, router [X, E] -> (expert ids [T, k] int32, weights [T, k] f32)."""
    logits = jnp.einsum("th,xh->tx", x, router.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def gated(gu, act):
    """[..., 2 I] (gate | up) -> act(gate) * up [..., I]."""
    gate, up = jnp.split(gu, 2, axis=-1)
    return act(gate) * up


def _dot(x, w):
    """x [N, in] @ w [out, in].T -> [N, out] float32 (x rounded to w's dtype)."""
    return jnp.einsum("ni,oi->no", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


def tile_rows(num_assignments: int, num_experts: int) -> int:
    """Rows per tile of the sorted loop: about half an expert's fair share, a power of two
    from 8 (padding each chosen expert costs at most one tile)."""
    share = max(1, -(-num_assignments // (2 * num_experts)))
    return max(8, 1 << (share - 1).bit_length())


def experts_sorted(x, ids, weights, w_gate_up, w_down, act, tile: int | None = None):
    """x [T, E]; ids, weights [T, k] (ids outside [0, X) dropped); w_gate_up [X, 2 I, E],
    w_down [X, E, I] -> sum over each token's experts of weight * expert(x) [T, E] float32."""
    t, k = ids.shape
    n = t * k
    num_experts = w_gate_up.shape[0]
    tile = tile or tile_rows(n, num_experts)
    flat = ids.reshape(n)
    mine = (flat >= 0) & (flat < num_experts)
    flat = jnp.where(mine, flat, num_experts)  # another device's experts: sorted last, never computed
    order = jnp.argsort(flat, stable=True)  # [N]: the assignments grouped by expert
    token = order // k  # [N] token of each sorted assignment
    rows = jnp.pad(x[token], ((0, tile), (0, 0)))  # [N + tile, E]: a last tile may run past N
    counts = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype), axis=0)  # [X]
    starts = jnp.cumsum(counts) - counts

    def expert(e, out):
        def one_tile(j, out):
            start = starts[e] + j * tile
            h = gated(_dot(jax.lax.dynamic_slice_in_dim(rows, start, tile), w_gate_up[e]), act)  # [tile, I]
            # rows past this expert's belong to the next experts, which overwrite them after
            return jax.lax.dynamic_update_slice_in_dim(out, _dot(h, w_down[e]), start, 0)

        return jax.lax.fori_loop(0, (counts[e] + tile - 1) // tile, one_tile, out)

    out = jax.lax.fori_loop(0, num_experts, expert, jnp.zeros(rows.shape, jnp.float32))[:n]
    scaled = out * jnp.where(mine[order], weights.reshape(n)[order], 0.0)[:, None]
    return jnp.zeros(x.shape, jnp.float32).at[token].add(scaled)


def experts_ragged(x, ids, weights, w_gate_up, w_down, act):
    """experts_sorted's result through two grouped matmuls (`jax.lax.ragged_dot_general`)."""
    t, k = ids.shape
    n = t * k
    num_experts = w_gate_up.shape[0]
    flat = ids.reshape(n)
    mine = (flat >= 0) & (flat < num_experts)
    order = jnp.argsort(jnp.where(mine, flat, num_experts), stable=True)  # dropped ones last
    token = order // k
    counts = jnp.sum(flat[:, None] == jnp.arange(num_experts, dtype=flat.dtype), axis=0)  # [X]
    # lhs [N, in] ragged on rows, rhs [X, out, in] contracted on its last axis
    dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (2,)), ((), ())),
                                             lhs_ragged_dimensions=(0,), rhs_group_dimensions=(0,))

    def grouped(lhs, w):
        return jax.lax.ragged_dot_general(lhs.astype(w.dtype), w, counts, dims, preferred_element_type=jnp.float32)

    out = grouped(gated(grouped(x[token], w_gate_up), act), w_down)  # [N, E]
    # rows past sum(counts) (other devices' experts) are not defined by ragged_dot: selected away, not scaled by 0
    scaled = jnp.where(mine[order][:, None], out * weights.reshape(n)[order][:, None], 0.0)
    return jnp.zeros(x.shape, jnp.float32).at[token].add(scaled)


def experts_dense(x, ids, weights, w_gate_up, w_down, act):
    """Every expert on every token, weighted by the routing (0 for experts not chosen)."""
    num_experts = w_gate_up.shape[0]
    combine = jnp.sum(jnp.where(ids[..., None] == jnp.arange(num_experts), weights[..., None], 0.0), axis=1)  # [T, X]
    h = gated(jnp.einsum("th,xoh->txo", x.astype(w_gate_up.dtype), w_gate_up, preferred_element_type=jnp.float32),
              act)  # [T, X, I]
    out = jnp.einsum("txi,xhi->txh", h.astype(w_down.dtype), w_down, preferred_element_type=jnp.float32)
    return jnp.einsum("txh,tx->th", out, combine)


EXPERTS = {"sorted": experts_sorted, "ragged": experts_ragged, "dense": experts_dense}


class MoE(nnx.Module):
    """Routed experts (+ Qwen2-MoE's gated shared expert). Parameters (models.loader names):
    router [X, E] f32; experts_gate_up [X, 2 I, E] (per expert gate | up, per tensor-parallel
    shard when split); experts_down [X, E, I]; shared_gate [1, E] beside `shared_expert`."""

    def __init__(self, cfg, arrays: dict, place, layout, act, impl: str = "auto", shared_expert=None):
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.num_experts = cfg.num_experts
        self.act = act
        self.impl = resolve_impl(impl)
        self.router = place(arrays, "router")
        self.experts_gate_up = place(arrays, "experts_gate_up")
        self.experts_down = place(arrays, "experts_down")
        self.shared_expert = shared_expert  # a dense MLP (models.llama.MLP), sharded like one
        self.shared_gate = place(arrays, "shared_gate") if shared_expert is not None else None
        mesh = place.mesh
        self.mesh = mesh if mesh is not None and mesh.size > 1 else None
        self.expert_parallel = layout.expert_parallel

    def __call__(self, x, lora=None):
        """x [T, E] f32 -> [T, E] f32."""
        if lora is not None and any(t in lora.stacks for t in ("gate_proj", "up_proj", "down_proj")):
            raise NotImplementedError("LoRA on the MLP of a mixture-of-experts layer is not supported; "
                                      "serve adapters on q/k/v/o only (lora_target_modules)")
        w_gu, w_d = self.experts_gate_up[...], self.experts_down[...]
        out = self._routed(x, w_gu, w_d)
        if self.shared_expert is not None:
            out = out + jax.nn.sigmoid(_dot(x, self.shared_gate[...])) * self.shared_expert(x)
        return out

    def _routed(self, x, w_gu, w_d):
        run = EXPERTS[self.impl]

        def local(x, router, w_gu, w_d):
            ids, weights = route(x, router, self.top_k, self.normalize)
            if self.expert_parallel and self.mesh is not None:  # my experts: [first, first + X/n)
                ids = ids - jax.lax.axis_index(MODEL_AXIS) * w_gu.shape[0]
            out = run(x, ids, weights, w_gu, w_d, self.act)
            return out if self.mesh is None else jax.lax.psum(out, MODEL_AXIS)

        if self.mesh is None:
            return local(x, self.router[...], w_gu, w_d)
        if self.expert_parallel:
            gu_spec = d_spec = P(MODEL_AXIS, None, None)
        else:
            gu_spec, d_spec = P(None, MODEL_AXIS, None), P(None, None, MODEL_AXIS)
        tokens = P(DATA_AXIS, None)
        return jax.shard_map(local, mesh=self.mesh, in_specs=(tokens, P(), gu_spec, d_spec), out_specs=tokens,
                             check_vma=False)(x, self.router[...], w_gu, w_d)
