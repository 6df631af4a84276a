"""Weights from memory: Hugging Face-named arrays into a built CausalLM's parameters.

The engine stores its own layout (q/k/v and gate/up fused, rows regrouped per tensor-parallel
shard with KV heads repeated, layers stacked under scan, experts stacked, Gemma's norms as
1 + w, 8-bit matrices with a scale per row); callers speak Hugging Face names. `WeightLayout`
learns where every row of every checkpoint tensor lands by running the loader's own
conversion (`convert_hf_tensors`, `regroup_layer`, `CausalLM`) once on *row-index* arrays:
each checkpoint tensor becomes a column of codes `tensor id << 32 | row`, and the parameter
the model builds from them says, row by row, which checkpoint row it holds. So the update
can never disagree with the loader about the layout.

`WeightLayout.assemble` then builds each affected parameter on the device: the rows of the
given tensors in the parameter's order (one jitted gather per parameter shape, compiled once
and reused by every layer), cast to the parameter's dtype (quantized with a fresh scale per
row when the model is), placed with the parameter's own sharding. A parameter only partly
covered by the given tensors keeps its other rows (a scatter of the new rows).
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.config import GEMMA, ModelConfig
from pagedjax.models.llama import CausalLM, Placement
from pagedjax.models.loader import convert_hf_tensors
from pagedjax.models.quantization import QUANTIZED, _FORMATS

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
            shape, dtype = tuple(np.shape(value)), getattr(value, "dtype", None)
            if shape != self.shapes[name]:
                problems.append(f"{name}: shape {shape}, expected {self.shapes[name]}")
            if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
                problems.append(f"{name}: dtype {dtype}, expected a floating-point array")
        if problems:
            known = ", ".join(self.names[:3])
            raise ValueError(f"update_weights: {len(problems)} problem(s), nothing was changed: "
                             + "; ".join(problems[:8]) + ("; ..." if len(problems) > 8 else "")
                             + f" (names are Hugging Face's, e.g. {known})")

    def assemble(self, current: dict[str, jax.Array], weights: Mapping[str, object]) -> dict[str, jax.Array]:
        """The new value of each parameter (path -> array) that `weights` touch; `current`:
        path -> the engine's parameter now (its dtype, sharding, and the rows kept)."""
        given = {self._ids[name]: value for name, value in weights.items()}
        new = {}
        for path, (codes, name, scale_path) in self.codes.items():
            ids = codes >> ROW_BITS
            touched = np.isin(ids, list(given))
            if not touched.any():
                continue
            old = current[path]
            quantized = self.quantization is not None and name in QUANTIZED
            flat_codes = codes.reshape(-1)
            if touched.all():
                runs = _runs(flat_codes)
                rows = tuple(given[i] for i in sorted({i for i, _, _ in runs}))
                order = {i: k for k, i in enumerate(sorted({i for i, _, _ in runs}))}
                runs = tuple((order[i], a, b) for i, a, b in runs)
                positions = None
            else:
                where = np.flatnonzero(touched.reshape(-1))
                runs = _runs(flat_codes[where])
                ids_used = sorted({i for i, _, _ in runs})
                rows = tuple(given[i] for i in ids_used)
                order = {i: k for k, i in enumerate(ids_used)}
                runs = tuple((order[i], a, b) for i, a, b in runs)
                positions = where
            gemma = self.gemma and name.endswith("norm")
            if quantized:
                w, s = _assemble_quantized(rows, runs, old, current[scale_path], positions, self.quantization)
                new[path], new[scale_path] = w, s
            else:
                new[path] = _assemble(rows, runs, old, positions, gemma)
        return new


_MATRIX_LEAVES = frozenset({"embed", "lm_head", "wqkv", "wo", "w_gate_up", "w_down", "experts_gate_up", "experts_down",
                            "router", "shared_gate"})


def _runs(codes: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Codes (flat) as runs (tensor id, first row, end row) of consecutive rows of one tensor."""
    ids, rows = codes >> ROW_BITS, codes & ((1 << ROW_BITS) - 1)
    breaks = np.flatnonzero((ids[1:] != ids[:-1]) | (rows[1:] != rows[:-1] + 1)) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(codes)]])
    return tuple((int(ids[a]), int(rows[a]), int(rows[a] + (b - a))) for a, b in zip(starts, ends))


def _gather(rows, runs):
    """The runs' rows of the given tensors, end to end: [n, ...] float32."""
    return jnp.concatenate([jnp.asarray(rows[k][a:b], jnp.float32) for k, a, b in runs])


@functools.partial(jax.jit, static_argnums=(1, 3, 4))
def _assemble_jit(rows, runs, old, positions_static, gemma, positions):
    flat = _gather(rows, runs)
    if gemma:
        flat = flat + 1.0
    if positions_static is None:
        return flat.reshape(old.shape).astype(old.dtype)
    tail = old.shape[-1:] if flat.ndim == 2 else ()
    return old.reshape(-1, *tail).at[positions].set(flat.astype(old.dtype)).reshape(old.shape)


def _assemble(rows, runs, old, positions, gemma):
    out = _assemble_jit(rows, runs, old, None if positions is None else len(positions), gemma,
                        None if positions is None else jnp.asarray(positions))
    return jax.device_put(out, old.sharding)


@functools.partial(jax.jit, static_argnums=(1, 4, 5))
def _assemble_quantized_jit(rows, runs, old, old_scale, positions_static, quantization, positions):
    dtype, qmax = _FORMATS[quantization]
    w = _gather(rows, runs)  # [n, in] float32, as quantize_weight does it
    amax = jnp.abs(w).max(axis=-1)
    scale = jnp.where(amax > 0, amax / qmax, 1.0).astype(jnp.float32)
    scaled = jnp.clip(w / scale[:, None], -qmax, qmax)
    q = jnp.rint(scaled).astype(jnp.int8) if quantization == "int8" else scaled.astype(dtype)
    if positions_static is None:
        return q.reshape(old.shape), scale.reshape(old_scale.shape)
    q = old.reshape(-1, old.shape[-1]).at[positions].set(q).reshape(old.shape)
    return q, old_scale.reshape(-1).at[positions].set(scale).reshape(old_scale.shape)


def _assemble_quantized(rows, runs, old, old_scale, positions, quantization):
    w, s = _assemble_quantized_jit(rows, runs, old, old_scale, None if positions is None else len(positions),
                                   quantization, None if positions is None else jnp.asarray(positions))
    return jax.device_put(w, old.sharding), jax.device_put(s, old_scale.sharding)


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
