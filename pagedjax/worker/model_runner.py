"""ModelRunner: the model's parameters, the device KV cache and the one step on the device.

A step is a packed token axis (see core/buckets.py): InputBatch lays the scheduled requests'
tokens end to end in numpy, padded to the step's bucket, and `dispatch` runs the compiled
executables of that bucket (worker/compilation.py): the forward pass (model, KV writes, the
logits of each sequence's last token), then the sampler. Between the two the host fills the
token masks of constrained sequences while the device computes the forward pass; `fetch`
reads the sampled tokens back.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from pagedjax.models import lora as lora_lib
from pagedjax.models.kv_cache import copy_blocks_sharded, init_kv_cache
from pagedjax.models.sharding import DATA_AXIS, MODEL_AXIS
from pagedjax.core.buckets import Buckets
from pagedjax.parallel.distributed import to_host
from pagedjax.parallel.mesh import make_mesh, replicated
from pagedjax.worker import host_buffer
from pagedjax.sample import penalties, prompt_logprobs
from pagedjax.sample.penalties import PenaltySlots, init_penalty_state
from pagedjax.sample.sampler import SamplingInputs, sample_step
from pagedjax.sample.token_mask import bitmask_words
from pagedjax.core.sched.output import SchedulerOutput
from pagedjax.worker.input_batch import InputBatch, StepInputs
from pagedjax.worker.compilation import CompiledSteps
from pagedjax.worker.warmup import BackgroundWarmup


@dataclass
class PendingStep:
    """A dispatched step whose results are still on the device (`ModelRunner.fetch` reads them)."""

    t: int  # the step's bucket
    out: object  # SamplerOutput, on the device
    tokens: jax.Array  # [dp * R_max] int32: the sampled tokens, each rank's rows padded to R_max (the next step's input)
    wanted: list[str]  # the SamplerOutput fields to read back
    prompt: object  # PromptLogprobs on the device, or None when no position asked
    began: float  # time.perf_counter() at dispatch
    first_run: bool = False  # the bucket's first run: it compiled or loaded, its time is not a step's cost
    pooled: object = None  # the pooling hook's result on the device (embeddings), None: the step pools nothing


class ModelRunner(CompiledSteps):
    """Owns the model parameters, the device KV cache and the compiled step executables."""

    def __init__(self, model, buckets: Buckets, cache, max_blocks_per_seq: int, kv_dtype, mesh: Mesh | None = None,
                 lora_slots: tuple[int, int, tuple[str, ...]] | None = None):
        """lora_slots: (max_loras, max rank, target projections) of the LoRA stacks
        (models.lora) the step takes; None: no LoRA."""
        cfg = model.config
        self.num_layers = cfg.num_layers
        self.hidden_size = cfg.hidden_size
        self.buckets = buckets
        self.cache = cache
        self.block_size = cache.block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.mesh = mesh or make_mesh()
        self.dp = self.mesh.shape[DATA_AXIS]
        self._replicated = replicated(self.mesh)
        self._by_rank = NamedSharding(self.mesh, P(DATA_AXIS))  # step inputs: each rank its rows
        self._rows_by_rank = NamedSharding(self.mesh, P(DATA_AXIS, None))  # logits: whole vocabulary per rank
        self.graphdef, state = nnx.split(model)
        # tensor-parallel weights stay where the loader put their shards; the rest is replicated
        self.state = jax.tree.map(lambda x: x if _placed_on(x, self.mesh) else jax.device_put(x, self._replicated),
                                  state)
        # KV heads split over "model"; each data rank its own pool (rank-major on the block axis)
        kv_sharding = NamedSharding(self.mesh, P(MODEL_AXIS, DATA_AXIS))
        self.kv = init_kv_cache(cache, cfg.num_layers, model.num_kv_heads, cfg.head_dim, kv_dtype, kv_sharding,
                                data_parallel=self.dp)
        self.kv_dtype, self.kv_sharding = kv_dtype, kv_sharding  # a wake-up (worker/weight_sync.py) remakes the pool
        # the weights travel to each step as a flat list: flattening the nnx state (a Python
        # pytree of ~180 variables) cost ~0.5 ms a call
        self._weights, self._weights_tree = jax.tree.flatten(self.state)
        # LoRA: every slot's adapter matrices per target, [L, slots, ...] (models.lora)
        self.lora_stacks = None if lora_slots is None else lora_lib.init_stacks(
            cfg, model.tp_layout, *lora_lib.stack_shape(*lora_slots[:2]), model.dtype, self.mesh,
            stacked=model.scan_layers, targets=lora_slots[2])
        self._lora_rank = None if lora_slots is None else lora_slots[1]  # of the slot writes' arrays
        self._write_lora = jax.jit(lora_lib.write_slot, donate_argnums=(0,))
        self._write_lora_executable = None
        self._specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                   (self._weights, self.kv, self.lora_stacks))
        # logit processors: penalty slots (per rank) and the all-allowed token mask per S
        self.vocab_size = _logits_width(model)
        self.penalty_slots = [PenaltySlots(buckets.max_num_seqs) for _ in range(self.dp)]
        self.penalties = init_penalty_state(self.dp * buckets.max_num_seqs, self.vocab_size, self._rows_by_rank)
        self._pending_loads: list[tuple] = []  # load_slot calls to run before the next sampler
        self._all_allowed: dict[int, jax.Array] = {}  # R -> [dp * R, W] int32 of ones, on device
        self.max_rows = buckets.num_rows(buckets.max_num_batched_tokens)  # R_max: sampled rows of the largest step
        self._no_prev = None  # [dp * R_max] int32 zeros on the device: the previous tokens of a step that reads none
        # the step's and the sampler's host inputs each travel packed in one buffer (host_buffer),
        # whose layout (fixed by the bucket) is a static argument
        self._step = jax.jit(self._forward_packed, donate_argnums=(1,), static_argnums=(5,))
        self._sample = jax.jit(self._sample_packed, donate_argnums=(3,), static_argnums=(4,))
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn)
        self._copy_blocks = jax.jit(self._copy_blocks_fn, donate_argnums=(0,))
        self._copy_executable = None  # compiled copy-on-write, [dp * max_num_seqs] (src, dst)
        self.kv_tiers = None  # the host KV tier's KVTierCopier (worker/kv_tiers.py; None: off)
        self._executables: dict[int, object] = {}  # T bucket -> compiled forward pass
        self._prompt_executables: dict[int, object] = {}  # T bucket -> compiled prompt logprobs
        self._hidden_specs: dict[int, jax.ShapeDtypeStruct] = {}  # T bucket -> the step's hidden output
        self._primed: set[int] = set()  # T buckets that have run once (the warm-up's prime_bucket, or a step)
        self.compile_seconds: dict[int, float] = {}  # T bucket -> seconds its compile took
        self.step_seconds: dict[int, float] = {}  # T bucket -> seconds of its latest timed step
        self._samplers: dict[int, object] = {}  # R (sampled rows) -> compiled sampler
        self._step_layouts: dict[int, host_buffer.BufferLayout] = {}  # T -> its StepInputs buffer's layout
        self._sample_layouts: dict[int, host_buffer.BufferLayout] = {}  # R -> its SamplingInputs buffer's layout
        self._compile_lock = threading.Lock()
        self._state_lock = threading.Lock()  # a dispatch and a warm-up's first run replace kv / penalties one at a time
        self.background_warmup = BackgroundWarmup()
        self.input_batch = InputBatch(buckets, self.block_size, max_blocks_per_seq, cache.num_blocks, self._penalty_slot,
                                      self.step_rung, lora=lora_slots is not None)
        self.last_wait_s = 0.0  # seconds the last step's host waited for the device result
        self._last_fetch_end = 0.0  # time.perf_counter() when the last step's result was read

    def _forward(self, weights, kv, inputs: StepInputs, prev_tokens, lora_stacks=None):
        """-> (kv, logits [dp * S, V] of each sequence's last token, hidden [dp * T, E] for
        prompt logprobs). weights: the model state's leaves; prev_tokens [dp * R_max]: the
        previous step's sampled tokens (see prev_rows); lora_stacks: the LoRA slots' matrices
        (None: LoRA off), each token through its slot `inputs.lora_slots`."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_tree, weights))
        tokens = jnp.where(inputs.prev_rows >= 0, prev_tokens[jnp.maximum(inputs.prev_rows, 0)], inputs.tokens)
        lora = None if lora_stacks is None else lora_lib.LoRABatch(inputs.lora_slots, lora_stacks)
        hidden, kv = model(tokens, inputs.md, kv, self.cache, lora)  # [dp * T, E]
        # each data rank takes its own sequences' last tokens (no gather across ranks)
        h = hidden.reshape(self.dp, -1, hidden.shape[-1])  # [dp, T, E]
        idx = inputs.logits_indices.reshape(self.dp, -1, 1)  # [dp, S, 1]
        rows = jnp.take_along_axis(h, idx, axis=1).reshape(-1, h.shape[-1])  # [dp * S, E]
        # vocabulary-split logits are gathered over "model" on device (not to the host), so
        # sampling sees exactly what one device sees
        logits = jax.lax.with_sharding_constraint(model.logits(rows), self._rows_by_rank)
        return kv, logits, jax.lax.with_sharding_constraint(hidden, self._rows_by_rank)

    def _forward_packed(self, weights, kv, buf, prev_tokens, lora_stacks, layout: host_buffer.BufferLayout):
        """_forward on StepInputs packed in buf [dp, N] int32."""
        return self._forward(weights, kv, host_buffer.unpack(buf, layout), prev_tokens, lora_stacks)

    def load_lora_slot(self, slot: int, arrays: dict) -> None:
        """Writes adapter slot `slot` (1..max_loras; arrays: models.lora.slot_arrays) into
        the stacks; the next step reads it. One compiled write serves every slot."""
        self._compile_lora_write()
        arrays = jax.device_put(arrays, self._replicated)
        with self._state_lock:
            self.lora_stacks = self._write_lora_executable(self.lora_stacks, np.int32(slot), arrays)

    def _compile_lora_write(self) -> None:
        """Compiles the slot write (the slot index traced), once."""
        if self.lora_stacks is None or self._write_lora_executable is not None:
            return
        with self._compile_lock:
            if self._write_lora_executable is None:
                arrays = {t: tuple(jax.ShapeDtypeStruct(shape, np.float32, sharding=self._replicated) for shape in ab)
                          for t, ab in lora_lib.slot_shapes(self.lora_stacks, self._lora_rank).items()}
                slot = jax.ShapeDtypeStruct((), np.int32, sharding=self._replicated)
                self._write_lora_executable = self._write_lora.lower(self._specs[2], slot, arrays).compile()

    def _sample_packed(self, logits, buf, bitmask, pstate, layout: host_buffer.BufferLayout):
        """_sample_fn on SamplingInputs packed in buf [dp, N] int32."""
        return self._sample_fn(logits, host_buffer.unpack(buf, layout), bitmask, pstate)

    def _copy_blocks_fn(self, kv, src, dst):
        """Copy-on-write of blocks src -> dst [dp * max_num_seqs] (padding: dst = num_blocks),
        run before a step only when it has copies (few steps do: a fork, or a shared block
        about to be written), so a step without pays nothing on any backend."""
        return copy_blocks_sharded(kv, self.num_layers, src, dst, self.mesh)

    def _prompt_logprobs_fn(self, weights, hidden, prompt_next):
        """PromptLogprobs [dp * T] of a step's positions from its hidden [dp * T, E]; run only
        when some position asks (prompt_next [dp * T] >= 0)."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_tree, weights))
        return prompt_logprobs.compute(model.logits, hidden, prompt_next, self.dp)

    def _sample_fn(self, logits, sampling: SamplingInputs, bitmask, pstate):
        """-> (penalty state with the kept tokens counted, SamplerOutput, its tokens padded
        to [dp * R_max] for the next step)."""
        pstate, out = sample_step(logits, sampling, bitmask, pstate, self.dp)
        r = out.tokens.shape[0] // self.dp
        padded = jnp.pad(out.tokens.reshape(self.dp, r), ((0, 0), (0, self.max_rows - r))).reshape(-1)
        return pstate, out, padded

    def _to_device(self, t: int, inputs: StepInputs, sampling: SamplingInputs) -> tuple[jax.Array, jax.Array]:
        """The step's and the sampler's host inputs, each packed in one buffer [dp, N], put on
        the device in one call (two transfers instead of ~25). Their layouts must be those the
        step of T = t and its sampler were compiled for (a buffer of the same width but another
        layout would be misread, not refused)."""
        (step_buf, step_layout), (sample_buf, sample_layout) = (host_buffer.pack(inputs, self.dp),
                                                                host_buffer.pack(sampling, self.dp))
        if step_layout != self._step_layouts[t] or sample_layout != self._sample_layouts[self.buckets.num_rows(t)]:
            raise RuntimeError(f"the inputs of a step of {t} tokens are not laid out as its executables expect")
        return jax.device_put((step_buf, sample_buf), self._by_rank)

    def _prev_tokens(self, prev: PendingStep | None, host: bool = False):
        """The previous step's padded tokens, or zeros when the step reads none."""
        if prev is not None:
            return prev.tokens
        if host:
            return np.zeros(self.dp * self.max_rows, np.int32)
        if self._no_prev is None:
            self._no_prev = jax.device_put(self._prev_tokens(None, host=True), self._by_rank)
        return self._no_prev

    def _bitmask_ones(self, s: int, host: bool = False):
        """The all-allowed token mask [dp * S, W] (numpy, or kept on the device: built once)."""
        if host:
            return np.full((self.dp * s, bitmask_words(self.vocab_size)), -1, np.int32)
        if s not in self._all_allowed:
            self._all_allowed[s] = jax.device_put(self._bitmask_ones(s, host=True), self._rows_by_rank)
        return self._all_allowed[s]

    # -- host side ------------------------------------------------------------------------
    def step_shape(self, outs: list[SchedulerOutput | None]) -> tuple[int, int]:
        """(T, S) of the step running `outs` (InputBatch.step_shape)."""
        return self.input_batch.step_shape(outs)

    def prepare(self, outs: list[SchedulerOutput | None], t: int | None = None):
        """Numpy inputs of one step (InputBatch.prepare): (T, StepInputs, SamplingInputs,
        copy-on-write arrays)."""
        return self.input_batch.prepare(outs, t)

    def _penalty_slot(self, rank: int, req) -> int:
        """The request's penalty slot on its rank; a new one is loaded before the sampler runs."""
        slot, load = self.penalty_slots[rank].get(req)
        if load:
            local_slot = rank * self.buckets.max_num_seqs + slot
            self._pending_loads += penalties.load_slot_args(local_slot, req.all_token_ids, req.num_prompt_tokens,
                                                            req.params.logit_bias)
        return slot

    def hidden_specs(self, t: int) -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
        """What an executable reading a step's hidden states compiles for (pooling): the
        hidden output of the step of T = t, [dp * T, E] float32 after the final norm (each data
        rank its rows), and a per-token int32 input [dp * T] split like the step's tokens."""
        hidden = self._hidden_specs.get(t) or jax.ShapeDtypeStruct((self.dp * t, self.hidden_size), jnp.float32,
                                                                   sharding=self._rows_by_rank)
        return hidden, jax.ShapeDtypeStruct((self.dp * t,), jnp.int32, sharding=self._by_rank)

    def release_penalty_slot(self, req) -> None:
        """Gives back a finished request's penalty slot (if it holds one)."""
        self.penalty_slots[req.dp_rank].release(req)

    def _idle_inputs(self, t: int):
        """Inputs of a step of t tokens (per data rank) that computes nothing anyone reads
        (compiling, tests)."""
        return self.prepare([None] * self.dp, t)[1:]

    def execute(self, outs: list[SchedulerOutput | None], fill_masks=None):
        """Runs one step and waits for its result: `fetch(dispatch(outs, fill_masks))`."""
        return self.fetch(self.dispatch(outs, fill_masks))

    def dispatch(self, outs: list[SchedulerOutput | None], fill_masks=None, prev: PendingStep | None = None,
                 pool=None) -> PendingStep:
        """Starts one step (one SchedulerOutput per data rank) on the device and returns at
        once. prev: the step dispatched just before, whose sampled tokens this one reads where
        a request's `pending_row` says so (they never travel through the host).

        fill_masks(bitmask [dp * S, W] int32 all ones, S): writes the token masks of the
        constrained rows; called while the device runs the forward pass.

        pool(hidden [dp * T, E], T) -> a device array read back by `fetch` as `.pooled`: what
        the step's hidden states give embedding requests (pooling.Pooler.hook), None: nothing."""
        began = time.perf_counter()
        t, inputs, sampling, copies = self.prepare(outs)
        first_run = t not in self._primed
        step = self.compile_bucket(t)
        s = self.buckets.num_rows(t)
        step_buf, sample_buf = self._to_device(t, inputs, sampling)
        with self._state_lock:
            if self.kv_tiers is not None:  # the host tier's saves, then loads (before the copies: fresh blocks)
                self.kv, compiled = self.kv_tiers.apply(self.kv, outs)
                first_run |= compiled
            if (copies[1] < self.cache.num_blocks).any():  # copy-on-write before the step writes
                first_run |= self._copy_executable is None  # compiles now (no warm-up ran)
                self._compile_copy_blocks()
                self.kv = self._copy_executable(self.kv, *copies)
            self.kv, logits, hidden = step(self._weights, self.kv, step_buf, self._prev_tokens(prev),
                                           self.lora_stacks)  # runs async
            pooled = pool(hidden, t) if pool is not None else None
            for args in self._pending_loads:
                self.penalties = penalties.load_slot(self.penalties, *args)
            self._pending_loads = []
            bitmask = self._bitmask_ones(s)
            if fill_masks is not None and sampling.constrained.any():
                host = self._bitmask_ones(s, host=True)
                fill_masks(host, s)
                bitmask = host
            self.penalties, out, padded = self._samplers[s](logits, sample_buf, bitmask, self.penalties)
        wanted = ["tokens"] + (["logprobs", "top_ids", "top_logprobs"] if sampling.want_logprobs.any() else []) \
            + (["accepted", "resampled"] if (sampling.draft_next >= 0).any() else [])
        plp = None
        if (inputs.prompt_next >= 0).any():
            first_run |= t not in self._prompt_executables  # a compile here is no step's cost
            plp = self.prompt_executable(t)(self._weights, hidden, inputs.prompt_next)
        self._primed.add(t)
        return PendingStep(t, out, padded, wanted, plp, began, first_run, pooled)

    def fetch(self, pending: PendingStep):
        """Waits for a dispatched step and returns its sampler output (numpy): rank r's entry
        i in row r * R + out.row_offsets()[i] (R: sampled rows per rank, `buckets.num_rows`),
        with `.prompt` the PromptLogprobs of the step's tokens when some request asked for
        them (else None). Only the token ids come back to the host, plus log-probabilities
        when a request wants them."""
        wait = time.perf_counter()
        result = _Result(**{k: to_host(getattr(pending.out, k)) for k in pending.wanted})
        if pending.prompt is not None:
            result.prompt = jax.tree.map(to_host, pending.prompt)
        if pending.pooled is not None:
            result.pooled = to_host(pending.pooled)
        end = time.perf_counter()
        self.last_wait_s = end - wait  # host blocked on the device
        if not pending.first_run:  # from when the device could start it (the step before it ended)
            self.step_seconds[pending.t] = end - max(pending.began, self._last_fetch_end)
        self._last_fetch_end = end
        return result


def _placed_on(x, mesh: Mesh) -> bool:
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


@dataclass
class _Result:
    """A step's sampler output on the host (logprobs only when a row asked for them)."""

    tokens: np.ndarray  # [S]
    logprobs: np.ndarray | None = None  # [S]
    top_ids: np.ndarray | None = None  # [S, K]
    top_logprobs: np.ndarray | None = None  # [S, K]
    accepted: np.ndarray | None = None  # [S] bool, with drafts: the row's draft is accepted
    resampled: np.ndarray | None = None  # [S] int32, with drafts: the token emitted where it is not
    prompt: object = None  # PromptLogprobs (numpy) of the step's tokens, when asked
    pooled: np.ndarray | None = None  # [dp * S, E] float32: the pooling hook's sums, when the step pooled


def _logits_width(model) -> int:
    head = model.embed if model.lm_head is None else model.lm_head
    return int(head[...].shape[0])
