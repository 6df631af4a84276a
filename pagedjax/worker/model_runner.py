"""Host batch preparation and the one jitted step (model forward + on-device sampling).

A step is a packed token axis (see buckets.py): ModelRunner.prepare lays the scheduled
requests' tokens end to end in numpy, padded to the step's bucket, and the step runs the
compiled executables of that bucket: the forward pass (model, KV writes, the logits of
each sequence's last token), then the sampler. Between the two the host fills the token
masks of constrained sequences (grammars) while the device computes the forward pass. Executables are compiled ahead of time per bucket
(`compile_bucket`) and run once (`prime_bucket`), in the foreground or by a background thread
(`start_background_warmup`);
`ready_tokens` tells the scheduler the largest step it may build without compiling.
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.kv_cache import AttentionMetadata, copy_blocks_sharded, init_kv_cache
from models.sharding import DATA_AXIS, MODEL_AXIS
from pagedjax.core.buckets import Buckets
from pagedjax.parallel.distributed import to_host
from pagedjax.parallel.mesh import make_mesh, replicated
from pagedjax.worker import host_buffer
from pagedjax.sample import penalties, prompt_logprobs
from pagedjax.sample.penalties import PenaltySlots, init_penalty_state
from pagedjax.sample.sampler import SamplingInputs, sample_step
from pagedjax.sample.token_mask import bitmask_words, mask_needed
from pagedjax.core.sched.scheduler import SchedulerOutput


_warming_up: "weakref.WeakSet[ModelRunner]" = weakref.WeakSet()


@atexit.register
def _stop_background_warmups() -> None:
    """Never let the interpreter exit while XLA compiles on a warm-up thread (it aborts)."""
    for runner in list(_warming_up):
        runner.stop_warmup()


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """The model inputs of one packed step."""

    tokens: jax.Array  # [T] int32
    md: AttentionMetadata
    logits_indices: jax.Array  # [dp * S] int32: each sequence's last token within its rank's T (sampled)
    prompt_next: jax.Array  # [T] int32: the prompt token after each position, -1: no prompt logprobs asked
    prev_rows: jax.Array  # [T] int32: the previous step's sampled row whose token goes here (not yet on the host), -1: none


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


class ModelRunner:
    """Owns the model parameters, the device KV cache and the compiled step executables."""

    def __init__(self, model, buckets: Buckets, cache, max_blocks_per_seq: int, kv_dtype, mesh: Mesh | None = None):
        cfg = model.config
        self.num_layers = cfg.num_layers
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
        # the weights travel to each step as a flat list: flattening the nnx state (a Python
        # pytree of ~180 variables) cost ~0.5 ms a call
        self._weights, self._weights_tree = jax.tree.flatten(self.state)
        self._specs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                   (self._weights, self.kv))
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
        self._step = jax.jit(self._forward_packed, donate_argnums=(1,), static_argnums=(4,))
        self._sample = jax.jit(self._sample_packed, donate_argnums=(3,), static_argnums=(4,))
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_fn)
        self._copy_blocks = jax.jit(self._copy_blocks_fn, donate_argnums=(0,))
        self._copy_executable = None  # compiled copy-on-write, [dp * max_num_seqs] (src, dst)
        self._executables: dict[int, object] = {}  # T bucket -> compiled forward pass
        self._prompt_executables: dict[int, object] = {}  # T bucket -> compiled prompt logprobs
        self._hidden_specs: dict[int, jax.ShapeDtypeStruct] = {}  # T bucket -> the step's hidden output
        self._primed: set[int] = set()  # T buckets that have run once (the warm-up's prime_bucket, or a step)
        self._samplers: dict[int, object] = {}  # R (sampled rows) -> compiled sampler
        self._step_layouts: dict[int, host_buffer.BufferLayout] = {}  # T -> its StepInputs buffer's layout
        self._sample_layouts: dict[int, host_buffer.BufferLayout] = {}  # R -> its SamplingInputs buffer's layout
        self._compile_lock = threading.Lock()
        self._state_lock = threading.Lock()  # a dispatch and a warm-up's first run replace kv / penalties one at a time
        self._warmup_thread: threading.Thread | None = None
        self._stop_warmup = threading.Event()
        self._warmup_go = threading.Event()  # set: the background warm-up may compile its next bucket
        self._warmup_go.set()
        self._warmup_forced = False
        self.warmup_error: BaseException | None = None
        self.last_wait_s = 0.0  # seconds the last step's host waited for the device result

    def _forward(self, weights, kv, inputs: StepInputs, prev_tokens):
        """-> (kv, logits [dp * S, V] of each sequence's last token, hidden [dp * T, E] for
        prompt logprobs). weights: the model state's leaves; prev_tokens [dp * R_max]: the
        previous step's sampled tokens (see prev_rows)."""
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_tree, weights))
        tokens = jnp.where(inputs.prev_rows >= 0, prev_tokens[jnp.maximum(inputs.prev_rows, 0)], inputs.tokens)
        hidden, kv = model(tokens, inputs.md, kv, self.cache)  # [dp * T, E]
        # each data rank takes its own sequences' last tokens (no gather across ranks)
        h = hidden.reshape(self.dp, -1, hidden.shape[-1])  # [dp, T, E]
        idx = inputs.logits_indices.reshape(self.dp, -1, 1)  # [dp, S, 1]
        rows = jnp.take_along_axis(h, idx, axis=1).reshape(-1, h.shape[-1])  # [dp * S, E]
        # vocabulary-split logits are gathered over "model" on device (not to the host), so
        # sampling sees exactly what one device sees
        logits = jax.lax.with_sharding_constraint(model.logits(rows), self._rows_by_rank)
        return kv, logits, jax.lax.with_sharding_constraint(hidden, self._rows_by_rank)

    def _forward_packed(self, weights, kv, buf, prev_tokens, layout: host_buffer.BufferLayout):
        """_forward on StepInputs packed in buf [dp, N] int32."""
        return self._forward(weights, kv, host_buffer.unpack(buf, layout), prev_tokens)

    def _sample_packed(self, logits, buf, bitmask, pstate, layout: host_buffer.BufferLayout):
        """_sample_fn on SamplingInputs packed in buf [dp, N] int32."""
        return self._sample_fn(logits, host_buffer.unpack(buf, layout), bitmask, pstate)

    def _copy_blocks_fn(self, kv, src, dst):
        """Copy-on-write of blocks src -> dst [dp * max_num_seqs] (padding: dst = num_blocks),
        run before a step only when it has copies (few steps do: a fork, or a shared block
        about to be written), so a step without pays nothing on any backend."""
        return copy_blocks_sharded(kv, self.num_layers, src, dst, self.mesh)

    def _compile_copy_blocks(self) -> None:
        if self._copy_executable is None:
            spec = jax.ShapeDtypeStruct((self.dp * self.buckets.max_num_seqs,), jnp.int32, sharding=self._by_rank)
            self._copy_executable = self._copy_blocks.lower(self._specs[1], spec, spec).compile()

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

    # -- compiled shapes ------------------------------------------------------------------
    @property
    def compiled_shapes(self) -> list[int]:
        """T of every compiled step, smallest first."""
        return sorted(self._executables)

    def compile_bucket(self, t: int):
        """The forward executable of the step of T = t tokens, compiled now (with the
        sampler of its S) if it is not yet."""
        exe = self._executables.get(t)
        if exe is not None:
            return exe
        with self._compile_lock:
            if t not in self._executables:
                (step_buf, step_layout), (sample_buf, sample_layout) = self.idle_buffers(t)
                spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self._by_rank)
                lowered = self._step.lower(*self._specs, spec(step_buf), spec(self._prev_tokens(None, host=True)),
                                           step_layout)
                s = self.buckets.num_rows(t)
                if s not in self._samplers:
                    logits = jax.ShapeDtypeStruct((self.dp * s, self.vocab_size), jnp.float32,
                                                  sharding=self._rows_by_rank)
                    pspec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                         self.penalties)
                    self._samplers[s] = self._sample.lower(logits, spec(sample_buf),
                                                           spec(self._bitmask_ones(s, host=True)), pspec,
                                                           sample_layout).compile()
                    self._sample_layouts[s] = sample_layout
                self._step_layouts[t] = step_layout
                self._executables[t] = lowered.compile()
                hidden = lowered.out_info[2]
                self._hidden_specs[t] = jax.ShapeDtypeStruct(hidden.shape, hidden.dtype, sharding=self._rows_by_rank)
            return self._executables[t]

    def prompt_executable(self, t: int):
        """The prompt-logprobs executable of the step of T = t tokens, compiled now if it is
        not yet (the warm-up compiles them after every step shape: few requests ask)."""
        exe = self._prompt_executables.get(t)
        if exe is not None:
            return exe
        self.compile_bucket(t)
        with self._compile_lock:
            if t not in self._prompt_executables:
                nxt = jax.ShapeDtypeStruct((self.dp * t,), jnp.int32, sharding=self._by_rank)
                self._prompt_executables[t] = self._prompt_logprobs.lower(self._specs[0], self._hidden_specs[t],
                                                                          nxt).compile()
            return self._prompt_executables[t]

    def prime_bucket(self, t: int) -> None:
        """Compiles the step of T = t and runs it once on inputs that write and keep nothing
        (no KV slot, no penalty row, nothing read back): on XLA:CPU an executable's first run
        costs 0.1-0.5 s more than the next ones (one-time loading), which a request would
        otherwise pay, and which would mislead the measured step costs (speculative drafts)."""
        if t in self._primed:
            return
        step = self.compile_bucket(t)
        inputs, sampling = self._to_device(t, *self._idle_inputs(t)[:2])
        s = self.buckets.num_rows(t)
        with self._state_lock:
            self.kv, logits, _ = step(self._weights, self.kv, inputs, self._prev_tokens(None))
            self.penalties, out, _ = self._samplers[s](logits, sampling, self._bitmask_ones(s), self.penalties)
        jax.block_until_ready(out.tokens)
        self._primed.add(t)

    def idle_buffers(self, t: int):
        """((StepInputs buffer, layout), (SamplingInputs buffer, layout)) of a step of T = t
        tokens that computes nothing anyone reads (host_buffer.pack; compiling, tests)."""
        inputs, sampling, _ = self._idle_inputs(t)
        return host_buffer.pack(inputs, self.dp), host_buffer.pack(sampling, self.dp)

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

    def _compile_load_slot(self) -> None:
        """Compiles load_slot by running it once as a no-op (slot 0, nothing added, no reset)."""
        (slot, ids, is_prompt, _, bias_ids, bias_vals), = penalties.load_slot_args(0, [], 0, None)
        self.penalties = penalties.load_slot(self.penalties, slot, ids, is_prompt, np.bool_(False), bias_ids, bias_vals)

    def ready_tokens(self) -> int | None:
        """While a background warm-up runs: the largest T such that every bucket up to it
        is compiled and has run once. None otherwise (no limit: a missing bucket compiles on
        first use)."""
        if self.warmup_done:
            return None
        ready = None
        for t in self.buckets.token_buckets():
            if t not in self._primed:
                break
            ready = t
        return ready

    def _warmup_jobs(self) -> list[tuple]:
        """Every compile of a warm-up, in order, after the fixed-shape helpers (compiled here):
        (prime_bucket, T) for each step shape smallest first, then (prompt_executable, T) for
        each (last: every step shape is ready first; few requests ask for prompt logprobs)."""
        self._compile_load_slot()
        self._compile_copy_blocks()
        ladder = self.buckets.token_buckets()
        return [(self.prime_bucket, t) for t in ladder] + [(self.prompt_executable, t) for t in ladder]

    def warmup(self, progress: bool = True) -> None:
        """Compiles every bucket now, smallest first."""
        from tqdm import tqdm

        for job, t in tqdm(self._warmup_jobs(), desc="compiling step shapes", disable=not progress, unit="shape"):
            job(t)

    def start_background_warmup(self, first: int = 1) -> None:
        """Compiles the `first` smallest buckets now and the rest on a background thread, so
        serving starts at once; the scheduler keeps each step within `ready_tokens()`. The
        thread compiles only while `allow_warmup` lets it (the engine pauses it while requests
        run in buckets already compiled: on a few cores a compile slows every step beside it)."""
        jobs = self._warmup_jobs()
        for job, t in jobs[:first]:  # the smallest step shapes
            job(t)
        jobs = jobs[first:]

        def run():
            try:
                for job, t in jobs:
                    self._warmup_go.wait()
                    if self._stop_warmup.is_set():
                        return
                    job(t)
            except BaseException as e:  # surfaced by wait_for_warmup and stats
                self.warmup_error = e

        self._warmup_thread = threading.Thread(target=run, name="pagedjax-warmup", daemon=True)
        self._warmup_thread.start()
        _warming_up.add(self)

    def allow_warmup(self, allowed: bool) -> None:
        """Lets the background warm-up compile its next bucket (True) or holds it before the
        next one (False); ignored once `wait_for_warmup` asked it to finish."""
        if allowed or self._warmup_forced:
            self._warmup_go.set()
        else:
            self._warmup_go.clear()

    def stop_warmup(self) -> None:
        """Stops a background warm-up after the bucket it is compiling (waits for that one)."""
        self._stop_warmup.set()
        self._warmup_go.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()

    def wait_for_warmup(self) -> None:
        """Blocks until the background warm-up is done; re-raises its error, if any."""
        self._warmup_forced = True
        self._warmup_go.set()
        if self._warmup_thread is not None:
            self._warmup_thread.join()
        if self.warmup_error is not None:
            raise RuntimeError("compiling the step buckets failed") from self.warmup_error

    @property
    def warmup_done(self) -> bool:
        return self._warmup_thread is None or not self._warmup_thread.is_alive()

    # -- host side ------------------------------------------------------------------------
    def step_shape(self, outs: list[SchedulerOutput | None]) -> tuple[int, int]:
        """(T, S) of the step running `outs` (one entry per data rank, None: idle): the bucket
        of the busiest rank; every rank gets T token and S sequence rows."""
        t = self.buckets.token_bucket(max(sum(out.q_lens) for out in outs if out is not None))
        return t, self.buckets.num_seqs(t)

    def prepare(self, outs: list[SchedulerOutput | None], t: int | None = None):
        """Numpy inputs of one step, packed and padded to its bucket: (T, StepInputs,
        SamplingInputs, copy-on-write arrays). outs has one entry per data rank; rank r owns
        tokens [r * T, (r + 1) * T), sequence rows [r * S, (r + 1) * S) and sampled rows
        [r * R, (r + 1) * R) (R = S plus the step's draft budget: an entry verifying drafts
        samples one row per position), with its own local offsets, slots and block ids (its
        own pool). t: the bucket (default: the smallest that fits)."""
        t, s = self.step_shape(outs) if t is None else (t, self.buckets.num_seqs(t))
        r = self.buckets.num_rows(t)
        dp, bs = len(outs), self.block_size
        tokens, positions = np.zeros(dp * t, np.int32), np.zeros(dp * t, np.int32)
        slots = np.full(dp * t, -1, np.int32)
        tables = np.zeros((dp * s, self.max_blocks_per_seq), np.int32)
        kv_lens, cu = np.zeros(dp * s, np.int32), np.zeros(dp * (s + 1), np.int32)
        logits_indices = np.zeros(dp * r, np.int32)
        prompt_next = np.full(dp * t, -1, np.int32)
        prev_rows = np.full(dp * t, -1, np.int32)
        sampling = _SamplingArrays(dp * r)
        c = self.buckets.max_num_seqs  # copies per rank: at most one per sequence row
        src, dst = np.zeros(dp * c, np.int32), np.full(dp * c, self.cache.num_blocks, np.int32)
        for rank, out in enumerate(outs):
            if out is None:
                continue
            t0, s0, c0 = rank * t, rank * s, rank * (s + 1)  # this rank's first token, row, offset
            off, sample_row = 0, rank * r
            for i, (req, start, ql) in enumerate(zip(out.requests, out.starts, out.q_lens)):
                blocks = req.block_ids
                drafts = out.drafts[i] if out.drafts else ()
                row = s0 + i
                tables[row, :len(blocks)] = blocks
                if ql == 1:
                    tokens[t0 + off] = req.token_at(start)
                    positions[t0 + off] = start
                    if start >= req.num_shared_kv_tokens:  # a fork's inherited KV is not written again
                        slots[t0 + off] = blocks[start // bs] * bs + start % bs
                else:
                    pos = np.arange(start, start + ql, dtype=np.int32)
                    tokens[t0 + off:t0 + off + ql] = ([req.token_at(start), *drafts] if drafts
                                                      else req.token_slice(start, start + ql))
                    positions[t0 + off:t0 + off + ql] = pos
                    slots[t0 + off:t0 + off + ql] = np.where(pos >= req.num_shared_kv_tokens,
                                                             tables[row, pos // bs] * bs + pos % bs, -1)
                if req.pending_row >= 0 and start <= req.num_tokens - 1 < start + ql:
                    # its last token is being sampled by the previous step: the device takes it from there
                    prev_rows[t0 + off + req.num_tokens - 1 - start] = req.pending_row
                off += ql
                if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                    prompt_next[t0 + off - ql:t0 + off] = prompt_logprobs.next_tokens(req.prompt_token_ids, start, ql)
                kv_lens[row], cu[c0 + i + 1] = start + ql, off
                # the sequence's last token (with drafts: each of its positions), among its rank's tokens
                n = len(drafts) + 1
                logits_indices[sample_row:sample_row + n] = np.arange(off - n, off)
                slot = self._penalty_slot(rank, req) if req.params.uses_penalties else -1
                for j in range(n):
                    sampling.fill(sample_row + j, req, produces=start + ql >= req.num_tokens, slot=slot, offset=j,
                                  draft_next=drafts[j] if j < n - 1 else -1)
                sample_row += n
            cu[c0 + len(out.requests) + 1:c0 + s + 1] = off
            if out.copies:
                n = len(out.copies)
                src[rank * c:rank * c + n], dst[rank * c:rank * c + n] = zip(*out.copies)
        md = AttentionMetadata(positions, slots, tables, kv_lens, cu)
        return t, StepInputs(tokens, md, logits_indices, prompt_next, prev_rows), sampling.inputs(), (src, dst)

    def _penalty_slot(self, rank: int, req) -> int:
        """The request's penalty slot on its rank; a new one is loaded before the sampler runs."""
        slot, load = self.penalty_slots[rank].get(req)
        if load:
            local_slot = rank * self.buckets.max_num_seqs + slot
            self._pending_loads += penalties.load_slot_args(local_slot, req.all_token_ids, req.num_prompt_tokens,
                                                            req.params.logit_bias)
        return slot

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

    def dispatch(self, outs: list[SchedulerOutput | None], fill_masks=None, prev: PendingStep | None = None
                 ) -> PendingStep:
        """Starts one step (one SchedulerOutput per data rank) on the device and returns at
        once. prev: the step dispatched just before, whose sampled tokens this one reads where
        a request's `pending_row` says so (they never travel through the host).

        fill_masks(bitmask [dp * S, W] int32 all ones, S): writes the token masks of the
        constrained rows; called while the device runs the forward pass."""
        began = time.perf_counter()
        t, inputs, sampling, copies = self.prepare(outs)
        first_run = t not in self._primed
        step = self.compile_bucket(t)
        s = self.buckets.num_rows(t)
        step_buf, sample_buf = self._to_device(t, inputs, sampling)
        with self._state_lock:
            if (copies[1] < self.cache.num_blocks).any():  # copy-on-write before the step writes
                first_run |= self._copy_executable is None  # compiles now (no warm-up ran)
                self._compile_copy_blocks()
                self.kv = self._copy_executable(self.kv, *copies)
            self.kv, logits, hidden = step(self._weights, self.kv, step_buf, self._prev_tokens(prev))  # runs async
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
        return PendingStep(t, out, padded, wanted, plp, began, first_run)

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
        self.last_wait_s = time.perf_counter() - wait  # host blocked on the device
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


def _logits_width(model) -> int:
    head = model.embed if model.lm_head is None else model.lm_head
    return int(head[...].shape[0])


class _SamplingArrays:
    """Per-row sampling settings being filled on the host (idle rows: greedy)."""

    def __init__(self, n: int):
        self.temperature, self.top_p, self.min_p = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
        self.top_k, self.step, self.seed = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint32)
        self.want_logprobs = np.zeros(n, bool)
        self.penalty_slot = np.full(n, -1, np.int32)
        self.repetition, self.frequency, self.presence = np.ones(n, np.float32), np.zeros(n, np.float32), np.zeros(n, np.float32)
        self.produces, self.constrained = np.zeros(n, bool), np.zeros(n, bool)
        self.draft_next = np.full(n, -1, np.int32)

    def fill(self, row: int, req, produces: bool = True, slot: int = -1, offset: int = 0, draft_next: int = -1) -> None:
        """offset: the row's position among the request's sampled rows (drafts: 1, 2, ...)."""
        p = req.params
        self.temperature[row], self.top_p[row], self.min_p[row], self.top_k[row] = p.temperature, p.top_p, p.min_p, p.top_k
        self.seed[row], self.step[row] = req.seed & 0xFFFFFFFF, len(req.output_token_ids) + offset
        self.draft_next[row] = draft_next
        self.want_logprobs[row] = p.logprobs is not None
        self.produces[row] = produces
        if slot >= 0:
            self.penalty_slot[row] = slot
            self.repetition[row], self.frequency[row], self.presence[row] = (p.repetition_penalty, p.frequency_penalty,
                                                                             p.presence_penalty)
        self.constrained[row] = produces and mask_needed(req)

    def inputs(self) -> SamplingInputs:
        return SamplingInputs(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step,
                              self.want_logprobs, self.penalty_slot, self.repetition, self.frequency, self.presence,
                              self.produces, self.constrained, self.draft_next)
