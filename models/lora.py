"""LoRA adapters (PEFT format) on top of a loaded CausalLM, many in one batch.

An adapter adds to a projection y = x W^T the low-rank term s * (x A^T) B^T, A [r, in],
B [out, r], s = lora_alpha / r (rsLoRA: / sqrt r). The engine keeps up to S adapters
in device memory, per layer and target projection (with a leading layer axis [L, ...] when
the layers run under scan):

    a [S, max_rank, in]    b [out, S, max_rank]   (s folded into b)

Adapter slot k (1..S) is index k - 1; slot 0 is the base model (no index: a zero term). A
smaller rank is padded with zeros. Each token of a packed step carries its slot
(`LoRABatch.slots`), so one compiled step serves a batch in which every row has its own
adapter, and swapping adapters only rewrites a slot's arrays (`write_slot`, the slot index
traced: nothing recompiles).

The term is two plain matmuls over every slot at once (`lora_delta`): x [T, in] times all
of a, seen as [S r, in], gives [T, S r]; each token keeps its own slot's r columns (a mask);
times b, seen as [out, S r], gives [T, out]. Both are the layout of a weight [out, in], so
they take the same matmul as the base weights (on a CPU the native kernels for decode-sized
steps). A per-token gather of each token's a and b reads only the slots in use but runs as
T small batched dots: measured in SmolLM2's decode step (16 rows, 16 slots of rank 16, 7
targets, bf16) it added ~110 ms to a 31 ms step.

Under tensor parallelism the stacks are cut like their base weights (models.sharding):
column-parallel targets (q, k, v, gate, up) split b's output rows, row-parallel ones (o,
down) split a's input columns; KV heads repeated for tp > KV heads are repeated in b too.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from pagedjax.models.config import ModelConfig
from pagedjax.platforms import current_platform
from pagedjax.models.sharding import MODEL_AXIS, TPLayout

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_MODULE = {t: ("self_attn." if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + t for t in TARGETS}
_ROW_PARALLEL = ("o_proj", "down_proj")  # their input columns are split over "model"
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


def target_dims(cfg: ModelConfig, layout: TPLayout | None = None) -> dict[str, tuple[int, int]]:
    """target -> (in, out) as the engine stores it (k/v: the stored KV heads, see TPLayout)."""
    e, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    hkv = cfg.num_kv_heads if layout is None else layout.num_kv_heads
    return {"q_proj": (e, cfg.num_heads * d), "k_proj": (e, hkv * d), "v_proj": (e, hkv * d),
            "o_proj": (cfg.num_heads * d, e), "gate_proj": (e, i), "up_proj": (e, i), "down_proj": (i, e)}


@dataclass
class LoRAAdapter:
    """An adapter read into host memory: per (layer, target), A [r, in] and s * B [out, r]
    (float32, the checkpoint's KV heads)."""

    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    fingerprint: str  # sha256 of its config and weights: the prefix-cache key of its KV

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def load_peft_adapter(path: str | Path, cfg: ModelConfig, max_rank: int, targets=TARGETS) -> LoRAAdapter:
    """Reads a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for a
    model of config `cfg`; raises ValueError saying what is wrong (missing files, an
    unsupported kind of adapter, a projection outside `targets`, a rank above max_rank,
    shapes that do not fit the model)."""
    from safetensors.numpy import load_file

    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    if not config_file.is_file():
        raise ValueError(f"{path} is not a PEFT LoRA adapter: no adapter_config.json")
    if not weights_file.is_file():
        raise ValueError(f"{path} has no adapter_model.safetensors (.bin adapters are not read: save with "
                         "safe_serialization=True)")
    conf = json.loads(config_file.read_text())
    if conf.get("peft_type", "LORA").upper() != "LORA":
        raise ValueError(f"{path}: peft_type {conf.get('peft_type')!r} is not LORA")
    for flag in ("use_dora", "fan_in_fan_out"):
        if conf.get(flag):
            raise ValueError(f"{path}: {flag}=true adapters are not supported")
    if conf.get("modules_to_save"):
        raise ValueError(f"{path}: modules_to_save ({conf['modules_to_save']}) is not supported: only LoRA "
                         "matrices on the attention and MLP projections")
    alpha, alpha_pattern = float(conf.get("lora_alpha", 8)), conf.get("alpha_pattern") or {}
    try:
        raw = load_file(str(weights_file))
    except Exception as e:  # safetensors' own error types: a truncated or foreign file
        raise ValueError(f"{path}: adapter_model.safetensors cannot be read ({e})") from None
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for key, value in raw.items():
        m = _KEY.match(key)
        if m is None or m.group(3) not in TARGETS or _MODULE[m.group(3)] != f"{m.group(2)}.{m.group(3)}":
            raise ValueError(f"{path}: tensor {key!r} is not a LoRA matrix of a supported projection "
                             f"({', '.join(TARGETS)})")
        layer = int(m.group(1))
        if layer >= cfg.num_layers:
            raise ValueError(f"{path}: tensor {key!r} is for layer {layer}; the model has {cfg.num_layers}")
        pairs.setdefault((layer, m.group(3)), {})[m.group(4)] = np.asarray(value, np.float32)
    if not pairs:
        raise ValueError(f"{path}: adapter_model.safetensors holds no LoRA matrices")
    dims = target_dims(cfg)
    extra = sorted({t for _, t in pairs} - set(targets))
    if extra:
        raise ValueError(f"{path}: the adapter has LoRA matrices on {', '.join(extra)}; this engine serves adapters "
                         f"on {', '.join(targets)} only (lora_target_modules)")
    weights, rank = {}, 0
    for (layer, target), ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{path}: layer {layer} {target} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        n_in, n_out = dims[target]
        r = a.shape[0]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != n_in or b.shape != (n_out, r):
            raise ValueError(f"{path}: layer {layer} {target}: lora_A {a.shape} and lora_B {b.shape} do not fit the "
                             f"model's [{n_out}, {n_in}] projection (expected A [r, {n_in}], B [{n_out}, r]): an "
                             "adapter for another base model?")
        if r > max_rank:
            raise ValueError(f"{path}: rank {r} (layer {layer} {target}) exceeds max_lora_rank={max_rank}")
        a_alpha = _pattern_value(alpha_pattern, f"model.layers.{layer}.{_MODULE[target]}", alpha)
        scale = a_alpha / (np.sqrt(r) if conf.get("use_rslora") else r)
        weights[(layer, target)] = (a, (b * scale).astype(np.float32))
        rank = max(rank, r)
    digest = hashlib.sha256(config_file.read_bytes() + weights_file.read_bytes()).hexdigest()
    return LoRAAdapter(str(path), rank, weights, digest)


def _pattern_value(pattern: dict, module: str, default: float) -> float:
    """PEFT's alpha_pattern: the value of the first key that matches the end of `module`."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?{key}$", module):
            return float(value)
    return default


# -- device stacks ---------------------------------------------------------------------
def stack_shape(max_loras: int, max_rank: int) -> tuple[int, int]:
    """(slots, rank) of the stacks: the smallest slots >= max_loras and rank >= max_rank whose
    product is a multiple of the platform's lora_width (on a CPU 32, the native kernels' bf16
    contraction width; what is added stays zero), elsewhere (max_loras, max_rank)."""
    width = current_platform().lora_width
    if width == 1:
        return max_loras, max_rank
    shapes = [(s, r) for s in range(max_loras, max_loras + width) for r in range(max_rank, max_rank + width)
              if s * r % width == 0]
    return min(shapes, key=lambda sr: (sr[0] * sr[1], sr[0]))


def stack_specs(layout: TPLayout, stacked: bool = True) -> dict[str, tuple[P, P]]:
    """target -> (PartitionSpec of a, of b); stacked: with their leading layer axis."""
    if layout.tp == 1:
        return {t: (P(), P()) for t in TARGETS}
    lead = (None,) if stacked else ()
    row_a, col_b = P(*lead, None, None, MODEL_AXIS), P(*lead, MODEL_AXIS, None, None)
    return {t: (row_a, P()) if t in _ROW_PARALLEL else (P(), col_b) for t in TARGETS}


def init_stacks(cfg: ModelConfig, layout: TPLayout, num_slots: int, max_rank: int, dtype, mesh=None,
                stacked: bool = True, targets=TARGETS) -> dict:
    """Zero stacks: target -> (a [L, S, max_rank, in], b [L, out, S, max_rank]) with S =
    num_slots, for each of `targets` (the projections adapters may change: each costs every
    step that has adapters). stacked=False: a tuple of L arrays each instead (unrolled layers:
    XLA:CPU would copy each layer's slice out of a stack before its matmuls)."""
    specs = stack_specs(layout, stacked)
    out = {}
    for t, (n_in, n_out) in target_dims(cfg, layout).items():
        if t not in targets:
            continue
        shapes = ((num_slots, max_rank, n_in), (n_out, num_slots, max_rank))
        if stacked:
            out[t] = tuple(_zeros((cfg.num_layers, *shape), dtype, mesh, spec) for shape, spec in zip(shapes, specs[t]))
        else:
            out[t] = tuple(tuple(_zeros(shape, dtype, mesh, spec) for _ in range(cfg.num_layers))
                           for shape, spec in zip(shapes, specs[t]))
    return out


def _zeros(shape, dtype, mesh, spec):
    if mesh is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=NamedSharding(mesh, spec))()


def slot_arrays(adapter: LoRAAdapter, cfg: ModelConfig, layout: TPLayout, max_rank: int, targets=TARGETS) -> dict:
    """An adapter as one slot of the stacks (numpy float32): target -> (a [L, max_rank, in],
    b [L, out, max_rank]) for each of `targets`; targets and layers it lacks are zeros."""
    out = {}
    rep = layout.num_kv_heads // cfg.num_kv_heads
    for t, (n_in, n_out) in target_dims(cfg, layout).items():
        if t not in targets:
            continue
        a = np.zeros((cfg.num_layers, max_rank, n_in), np.float32)
        b = np.zeros((cfg.num_layers, n_out, max_rank), np.float32)
        for layer in range(cfg.num_layers):
            if (layer, t) not in adapter.weights:
                continue
            la, lb = adapter.weights[(layer, t)]
            if rep > 1 and t in ("k_proj", "v_proj"):  # stored head j is checkpoint head j // rep
                lb = np.repeat(lb.reshape(cfg.num_kv_heads, cfg.head_dim, -1), rep, axis=0).reshape(n_out, -1)
            a[layer, :la.shape[0]], b[layer, :, :lb.shape[1]] = la, lb
        out[t] = (a, b)
    return out


def slot_shapes(stacks: dict, rank: int) -> dict:
    """target -> (shape of a, of b) of one slot's arrays for `stacks` (slot_arrays of that rank)."""
    def layer0(x):  # (L, one layer's shape)
        return (len(x), x[0].shape) if isinstance(x, tuple) else (x.shape[0], x.shape[1:])

    out = {}
    for t, (a, b) in stacks.items():
        (n, (_, _, n_in)), (_, (n_out, _, _)) = layer0(a), layer0(b)  # a [S, R, in], b [out, S, R]
        out[t] = ((n, rank, n_in), (n, n_out, rank))
    return out


def write_slot(stacks: dict, slot, arrays: dict) -> dict:
    """The stacks with adapter slot `slot` (1..S, a traced int32) replaced by `arrays`
    (slot_arrays: a [L, r, in], b [L, out, r], r up to the stacks' rank)."""
    def update(stack, x, axis):  # x: stack's shape without the slot axis `axis` (rank axis <= the stack's)
        start = [0] * stack.ndim
        start[axis] = slot - 1
        return jax.lax.dynamic_update_slice(stack, jnp.expand_dims(x.astype(stack.dtype), axis), start)

    def put(stack, x, axis):  # axis: the slot axis of one layer's array
        if isinstance(stack, tuple):  # one array per layer
            return tuple(update(s, x[i], axis) for i, s in enumerate(stack))
        return update(stack, x, axis + 1)

    return {t: (put(a, arrays[t][0], 0), put(b, arrays[t][1], 1)) for t, (a, b) in stacks.items()}


def _einsum_matmul(x, w):
    """x [T, K] @ w [N, K]^T -> [T, N] float32, x rounded to w's dtype."""
    return jnp.einsum("tk,nk->tn", x.astype(w.dtype), w, preferred_element_type=jnp.float32)


# -- the step ----------------------------------------------------------------------------
def lora_delta(x, a, b, slots, matmul=_einsum_matmul):
    """x [T, in] (float32), a [S, r, in], b [out, S, r], slots [T] int32 (0: none) -> the
    adapters' term [T, out] float32, each token through its own slot's matrices.
    matmul(x [T, K], w [N, K]) -> [T, N] float32: the model's (native kernels where they serve)."""
    s, r, n_in = a.shape
    xa = matmul(x, a.reshape(s * r, n_in)).reshape(-1, s, r)  # [T, S, r]: x through every slot
    mine = slots[:, None] - 1 == jnp.arange(s, dtype=slots.dtype)  # [T, S]
    xa = jnp.where(mine[:, :, None], xa, 0.0).reshape(-1, s * r)
    return matmul(xa, b.reshape(b.shape[0], s * r))


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LoRABatch:
    """The adapters of one step: each token's slot and the stacks (one layer's, or all
    layers': arrays with a leading L axis, or tuples of L arrays)."""

    slots: jax.Array  # [T] int32: adapter slot 1..S, 0: the base model
    stacks: dict  # target -> (a, b)

    def layer(self, i) -> "LoRABatch":
        """Layer i's matrices (a static or traced layer index)."""
        return LoRABatch(self.slots, {t: (a[i], b[i]) for t, (a, b) in self.stacks.items()})

    def add(self, target: str, y, x, matmul=_einsum_matmul):
        """y (projection `target`'s output for input x [T, in], any shape of T * out
        values) plus the adapters' term; y itself when no slot adapts that projection (self:
        one layer's stacks; matmul: see lora_delta)."""
        if target not in self.stacks:
            return y
        return y + self.delta(target, x, matmul).reshape(y.shape)

    def delta(self, target: str, x, matmul=_einsum_matmul):
        """The adapters' term of projection `target` for input x [T, in] -> [T, out] float32
        (self: one layer's stacks; matmul: see lora_delta)."""
        a, b = self.stacks[target]
        if not current_platform().skip_by_conditional:  # a conditional would sync a GPU with its host
            return lora_delta(x, a, b, self.slots, matmul)
        # XLA:CPU: a step with no adapter skips the terms (SmolLM2 decode at 16 rows, 16 slots
        # of rank 16: 33 ms a step against 45 computing zeros, and 28 without LoRA)
        return jax.lax.cond(jnp.any(self.slots > 0), lambda: lora_delta(x, a, b, self.slots, matmul),
                            lambda: jnp.zeros((x.shape[0], b.shape[0]), jnp.float32))
