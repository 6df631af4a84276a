"""The compiled side of the model runner: the step's executables per bucket, compiled ahead
of time (`compile_bucket`) and run once (`prime_bucket`), in the foreground (`warmup`) or on
a background thread (`start_background_warmup`, worker/warmup.py); `ready_tokens` tells the
scheduler the largest step it may build without compiling. ModelRunner mixes this in: the
jitted functions, specs and caches it reads are the runner's."""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.buckets import MIN_TOKENS
from pagedjax.sample import penalties
from pagedjax.worker import host_buffer


class CompiledSteps:
    @property
    def compiled_shapes(self) -> list[int]:
        """T of every compiled step, smallest first."""
        return sorted(self._executables)

    @property
    def num_compiled_shapes(self) -> int:
        """len(compiled_shapes), safe to read while the warm-up thread adds shapes."""
        return len(self._executables)

    def compile_bucket(self, t: int):
        """The forward executable of the step of T = t tokens, compiled now (with the
        sampler of its S) if it is not yet."""
        exe = self._executables.get(t)
        if exe is not None:
            return exe
        with self._compile_lock:
            if t not in self._executables:
                began = time.perf_counter()
                (step_buf, step_layout), (sample_buf, sample_layout) = self.idle_buffers(t)
                spec = lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=self._by_rank)
                weights, kv, lora = self._specs
                lowered = self._step.lower(weights, kv, spec(step_buf), spec(self._prev_tokens(None, host=True)), lora,
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
                self.compile_seconds[t] = time.perf_counter() - began
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

    def prime_bucket(self, t: int, timed: bool = False) -> None:
        """Compiles the step of T = t and runs it once on inputs that write and keep nothing
        (no KV slot, no penalty row, nothing read back): on XLA:CPU an executable's first run
        costs 0.1-0.5 s more than the next ones (one-time loading), which a request would
        otherwise pay, and which would mislead the measured step costs (speculative drafts).
        timed: run it a second time and keep that time in step_seconds[t] (compile_ahead's
        estimate before any request ran)."""
        if t in self._primed:
            return
        step = self.compile_bucket(t)
        inputs, sampling = self._to_device(t, *self._idle_inputs(t)[:2])
        s = self.buckets.num_rows(t)
        for run in range(2 if timed else 1):
            began = time.perf_counter()
            with self._state_lock:
                self.kv, logits, _ = step(self._weights, self.kv, inputs, self._prev_tokens(None), self.lora_stacks)
                self.penalties, out, _ = self._samplers[s](logits, sampling, self._bitmask_ones(s), self.penalties)
            jax.block_until_ready(out.tokens)
            if run:
                self.step_seconds[t] = time.perf_counter() - began
        self._primed.add(t)

    def step_rung(self, num_tokens: int) -> int:
        """T of the step of num_tokens tokens: the smallest rung holding it, or while a
        background warm-up runs the smallest compiled one (never a compile on the request
        path; a rung compiled ahead of the warm-up, worker/compile_ahead.py, serves at once)."""
        if not self.warmup_done:
            for t in self.compiled_shapes:
                if t >= num_tokens:
                    return t
        return self.buckets.token_bucket(num_tokens)

    def idle_buffers(self, t: int):
        """((StepInputs buffer, layout), (SamplingInputs buffer, layout)) of a step of T = t
        tokens that computes nothing anyone reads (host_buffer.pack; compiling, tests)."""
        inputs, sampling, _ = self._idle_inputs(t)
        return host_buffer.pack(inputs, self.dp), host_buffer.pack(sampling, self.dp)


    def _compile_copy_blocks(self) -> None:
        if self._copy_executable is None:
            spec = jax.ShapeDtypeStruct((self.dp * self.buckets.max_num_seqs,), jnp.int32, sharding=self._by_rank)
            self._copy_executable = self._copy_blocks.lower(self._specs[1], spec, spec).compile()

    def _compile_load_slot(self) -> None:
        """Compiles load_slot by running it once as a no-op (slot 0, nothing added, no reset)."""
        (slot, ids, is_prompt, _, bias_ids, bias_vals), = penalties.load_slot_args(0, [], 0, None)
        self.penalties = penalties.load_slot(self.penalties, slot, ids, is_prompt, np.bool_(False), bias_ids, bias_vals)

    def ready_tokens(self) -> int | None:
        """While a background warm-up runs: the largest compiled T (a step of fewer tokens
        runs on the smallest compiled rung that holds it, `step_rung`). None otherwise (no
        limit: a missing bucket compiles on first use)."""
        if self.warmup_done:
            return None
        return max(self._executables, default=None)

    def _warmup_jobs(self) -> list[tuple]:
        """Every compile of a warm-up, in order, after the fixed-shape helpers (compiled here):
        (prime_bucket, T) for each step shape smallest first, then (prompt_executable, T) for
        each (last: every step shape is ready first; few requests ask for prompt logprobs).
        Rungs below MIN_TOKENS (a CPU's 1, 2, 4: small decode batches) come after the others:
        until they are compiled such a step runs in the 8-token rung, while a prompt chunk
        waiting for a larger rung would be cut to the largest compiled one."""
        self._compile_load_slot()
        self._compile_copy_blocks()
        self._compile_lora_write()
        if self.kv_tiers is not None:  # the KV tiers' gathers and scatters (worker/kv_tiers.py)
            self.kv_tiers.compile_shapes(self.kv)
        ladder = self.buckets.token_buckets()
        ladder = [t for t in ladder if t >= MIN_TOKENS] + [t for t in ladder if t < MIN_TOKENS]
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
        for job, t in jobs[:first]:  # the smallest step shapes, timed (compile_ahead's estimates)
            job(t, timed=True)
        self.background_warmup.start(jobs[first:])

    def allow_warmup(self, allowed: bool) -> None:
        """Lets the background warm-up compile its next bucket (True) or holds it (False)."""
        self.background_warmup.allow(allowed)

    def stop_warmup(self) -> None:
        """Stops a background warm-up after the bucket it is compiling (waits for that one)."""
        self.background_warmup.stop()

    def wait_for_warmup(self) -> None:
        """Blocks until the background warm-up is done; re-raises its error, if any."""
        self.background_warmup.wait()

    @property
    def warmup_done(self) -> bool:
        return self.background_warmup.done
