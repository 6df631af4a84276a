"""Weights from memory: Hugging Face-named arrays into a built CausalLM's parameters.

The engine stores its own layout (q/k/v and gate/up fused, rows regrouped per tensor-parallel
shard with KV heads repeated, layers stacked under scan, experts stacked, Gemma's norms as
1 + w, 8-bit matrices with a scale per row); callers speak Hugging Face names. `WeightLayout`
learns where every row of every checkpoint tensor lands by running the loader's own
conversion (`convert_hf_tensors`, `regroup_layer`, `CausalLM`) once on *row-index* arrays:
each checkpoint tensor becomes a column of codes `tensor id << 32 | row`, and the parameter
the model builds from them says, row by row, which checkpoint row it holds. So the update
can never disagree with the loader about the layout.

`WeightLayout.plan` then says, per affected parameter, which rows of which given tensors
it takes, in order; `apply_plan` builds them (traced into one compiled update per set of
names, worker/weight_sync.py): the rows end to end, cast to the parameter's dtype (quantized
with a fresh scale per row when the model is). A parameter only partly covered by the given
tensors keeps its other rows (a scatter of the new rows).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import GEMMA, ModelConfig
from pagedjax.models.llama import CausalLM, Placement
from pagedjax.models.loader import convert_hf_tensors
from pagedjax.models.quantization import _FORMATS

ROW_BITS = 32  # a code is tensor_id << ROW_BITS | row


def hf_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """The shape of checkpoint tensor `name` (Hugging Face layout, [out, in]) for `cfg`."""
    e, d, h, hkv = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    module, kind = name.rsplit(".", 2)[-2:]
    mlp_size = (cfg.shared_expert_intermediate_size if ".shared_expert." in name else
                cfg.moe_intermediate_size if ".experts." in name else cfg.intermediate_size)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return cfg.vocab_size, e
    if module in ("q_norm", "k_norm"):
        return (d,)
    if module.endswith("norm"):
        return (e,)
    rows = {"q_proj": h * d, "k_proj": hkv * d, "v_proj": hkv * d, "o_proj": e, "gate_proj": mlp_size,
            "up_proj": mlp_size, "w1": mlp_size, "w3": mlp_size, "down_proj": e, "w2": e,
            "gate": cfg.num_experts, "shared_expert_gate": 1}[module]
    if kind == "bias":
        return (rows,)
    cols = {"o_proj": h * d, "down_proj": mlp_size, "w2": mlp_size}.get(module, e)
    return rows, cols


class _Checkpoint(dict):
    """A checkpoint whose tensors are made on first read by make(name, shape): what the
    loader reads of it is exactly the set of tensors the model needs."""

    def __init__(self, cfg: ModelConfig, make):
        super().__init__()
        self.cfg, self.make = cfg, make

    def __missing__(self, name):
        self[name] = value = self.make(name, hf_shape(self.cfg, name))
        return value

    def __contains__(self, name):
        return name != "lm_head.weight" or not self.cfg.tie_word_embeddings

    def get(self, name, default=None):
        return self[name] if name in self else default


def needed_tensors(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every checkpoint tensor the model reads (Hugging Face names)."""
    source = _Checkpoint(cfg, lambda name, shape: np.zeros(shape[:1] + (1,) * (len(shape) - 1), np.float32))
    convert_hf_tensors(cfg, source)
    return {name: hf_shape(cfg, name) for name in source}


def random_tensors(cfg: ModelConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor the model needs, random (load_format="dummy"): matrices ~ N(0, 0.02),
    norm weights 1 (0 for Gemma, whose norms scale by 1 + w), biases 0; float32."""
    rng = np.random.default_rng(seed)

    def make(name, shape):
        if name.endswith("norm.weight"):
            return np.full(shape, 0.0 if cfg.family in GEMMA else 1.0, np.float32)
        if name.endswith(".bias"):
            return np.zeros(shape, np.float32)
        return (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float32)

    return {name: make(name, shape) for name, shape in needed_tensors(cfg).items()}


class _RowPlacement(Placement):
    """Keeps the row-code arrays as they are (no dtype, no device, no quantization)."""

    def __call__(self, arrays: dict, name: str) -> nnx.Param:
        return nnx.Param(np.asarray(arrays[name]))

    def matrix(self, arrays: dict, name: str):
        return self(arrays, name), None


class WeightLayout:
    """Where each checkpoint row lands in `model`'s parameters (see the module doc)."""

    def __init__(self, model: CausalLM):
        cfg = model.config
        self.config, self.quantization = cfg, model.quantization
        self.shapes: dict[str, tuple[int, ...]] = {}

        def code(name, shape):
            self.shapes[name] = shape
            rows = (len(self.shapes) - 1) << ROW_BITS | np.arange(shape[0], dtype=np.int64)
            return rows if len(shape) == 1 else rows[:, None]  # a matrix: one code per row

        source = _Checkpoint(cfg, code)
        arrays = convert_hf_tensors(cfg, source, gemma_offset=False)
        self.names = list(self.shapes)  # tensor id -> name
        traced = CausalLM(cfg, arrays, scan_layers=model.scan_layers, placement=_RowPlacement,
                          expert_parallel=model.tp_layout.expert_parallel, tp=model.tp_layout.tp)
        # parameter path -> (codes, its name, its scale's path): codes [..., rows] for a matrix
        # [..., rows, cols], else of the parameter's shape
        self.codes = {}
        for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(traced, nnx.Param))[0]:
            name = path[-2].key  # [..., name].value
            codes = np.asarray(leaf)[..., 0] if name in _MATRIX_LEAVES else np.asarray(leaf)
            scale = jax.tree_util.keystr((*path[:-2], jax.tree_util.DictKey(name + "_scale"), path[-1]))
            self.codes[jax.tree_util.keystr(path)] = codes, name, scale
        self._ids = {name: i for i, name in enumerate(self.names)}
        self.gemma = cfg.family in GEMMA

    def check(self, weights: Mapping[str, object]) -> None:
        """ValueError naming every unknown name and every wrong shape or dtype (nothing applied)."""
        problems = []
        for name, value in weights.items():
            if name not in self._ids:
                problems.append(f"unknown tensor {name!r}")
                continue
            shape, dtype = tuple(getattr(value, "shape", None) or np.shape(value)), getattr(value, "dtype", None)
            if shape != self.shapes[name]:
                problems.append(f"{name}: shape {shape}, expected {self.shapes[name]}")
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                problems.append(f"{name}: dtype {dtype}, expected a floating-point array")
        if problems:
            known = ", ".join(self.names[:3])
            raise ValueError(f"update_weights: {len(problems)} problem(s), nothing was changed: "
                             + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
                             + f" (names are Hugging Face's, e.g. {known})")

    def plan(self, names, scale_paths: set[str]) -> tuple["LeafPlan", ...]:
        """How to write the parameters that the checkpoint tensors `names` touch (host work,
        done once per set of names): one LeafPlan per touched parameter. scale_paths: the
        paths of the engine's 8-bit scales (a quantized matrix takes a fresh one)."""
        ids = {self._ids[n]: k for k, n in enumerate(names)}  # tensor id -> its index in `names`
        plans = []
        for path, (codes, name, scale_path) in self.codes.items():
            touched = np.isin(codes >> ROW_BITS, list(ids))
            if not touched.any():
                continue
            flat = codes.reshape(-1)
            positions = None if touched.all() else np.flatnonzero(touched.reshape(-1))
            runs = tuple((ids[i], a, b) for i, a, b in _runs(flat if positions is None else flat[positions]))
            plans.append(LeafPlan(path, runs, positions, scale_path if scale_path in scale_paths else None,
                                  self.gemma and name.endswith("norm")))
        return tuple(plans)


class LeafPlan:
    """One parameter's update: its rows from runs (index into the given tensors, first row,
    end row), written whole (positions None) or at `positions` (flat row indices); scale_path:
    the parameter is 8-bit, quantized afresh with its scale there; gemma: stored as 1 + w."""

    __slots__ = ("path", "runs", "positions", "scale_path", "gemma")

    def __init__(self, path, runs, positions, scale_path, gemma):
        self.path, self.runs, self.positions, self.scale_path, self.gemma = path, runs, positions, scale_path, gemma


def apply_plan(plans, tensors: list, current: dict, quantization: str | None) -> dict:
    """The new parameters (path -> array) from `tensors` (in the plan's order of names) and
    the `current` parameters (path -> array: dtypes, shapes, and the rows kept). Pure jnp:
    traced into one compiled update (worker/weight_sync.py)."""
    new = {}
    for plan in plans:
        old = current[plan.path]
        flat = jnp.concatenate([jnp.asarray(tensors[k][a:b], jnp.float32) for k, a, b in plan.runs])
        if plan.gemma:
            flat = flat + 1.0
        if plan.scale_path is not None:
            q, scale = _quantize(flat, quantization)
            old_scale = current[plan.scale_path]
            if plan.positions is None:
                new[plan.path], new[plan.scale_path] = q.reshape(old.shape), scale.reshape(old_scale.shape)
            else:
                new[plan.path] = old.reshape(-1, old.shape[-1]).at[plan.positions].set(q).reshape(old.shape)
                new[plan.scale_path] = old_scale.reshape(-1).at[plan.positions].set(scale).reshape(old_scale.shape)
        elif plan.positions is None:
            new[plan.path] = flat.reshape(old.shape).astype(old.dtype)
        else:
            tail = old.shape[-1:] if flat.ndim == 2 else ()
            rows = old.reshape(-1, *tail).at[plan.positions].set(flat.astype(old.dtype))
            new[plan.path] = rows.reshape(old.shape)
    return new


def _quantize(w, quantization: str):
    """w [n, in] float32 -> (w_q [n, in], scale [n]) as models.quantization.quantize_weight."""
    dtype, qmax = _FORMATS[quantization]
    amax = jnp.abs(w).max(axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    scaled = jnp.clip(w / scale[:, None], -qmax, qmax)
    return (jnp.rint(scaled).astype(jnp.int8) if quantization == "int8" else scaled.astype(dtype)), scale


_MATRIX_LEAVES = frozenset({"embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down", "experts_gate_up", "experts_down",
                            "router", "shared_gate"})  # [..., rows, cols]: one code per row


def _runs(codes: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Codes (flat) as runs (tensor id, first row, end row) of consecutive rows of one tensor."""
    ids, rows = codes >> ROW_BITS, codes & ((1 << ROW_BITS) - 1)
    breaks = np.flatnonzero((ids[1:] != ids[:-1]) | (rows[1:] != rows[:-1] + 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(codes)]])
    return tuple((int(ids[a]), int(rows[a]), int(rows[a] + (b - a))) for a, b in zip(starts, ends))


def named_arrays(weights: Mapping[str, object] | Iterable[tuple[str, object]]) -> dict[str, object]:
    """A mapping, or an iterable of (name, array) pairs, as a dict (a name given twice: ValueError)."""
    if isinstance(weights, Mapping):
        return dict(weights)
    out = {}
    for item in weights:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise TypeError(f"weights must be a mapping or (name, array) pairs, got an item {type(item).__name__}")
        if item[0] in out:
            raise ValueError(f"tensor {item[0]!r} is given twice")
        out[item[0]] = item[1]
    return out
