"""What a training loop asks of the engine between rollouts: new weights from memory, the
prefix cache dropped, device memory released and restored, completions scored. A part of
LLMEngine (a mixin), kept apart by concern; `WeightSync` (worker/) does the device work."""
from __future__ import annotations

from pagedjax.engine.request_stream import EngineDeadError
from pagedjax.sampling_params import SamplingParams


class WeightControl:
    _weight_sync = None  # worker.weight_sync.WeightSync, made at the first update or sleep

    @property
    def weight_sync(self):
        if self._weight_sync is None:
            from pagedjax.worker.weight_sync import WeightSync

            self._weight_sync = WeightSync(self.runner, self.model)
        return self._weight_sync

    def update_weights(self, weights, transform=None) -> int:
        """Replaces model weights from memory: Hugging Face-named arrays (a mapping or
        (name, array) pairs; jax.Array on any device, or numpy; any subset of the tensors).
        Fused projections, stacked layers, 8-bit re-quantization and tensor-parallel shards are
        handled here. All or nothing: unknown names, wrong shapes or dtypes raise ValueError and
        change nothing. Only between requests (RuntimeError while some run). Compiles no step.
        The prefix cache is dropped (its K/V came from the old weights). Returns the number of
        engine parameters written. transform: a jnp function of `weights` that returns the
        Hugging Face-named arrays, compiled into the same update (no copy in between)."""
        self._check_idle("update_weights")
        self.runner.wait_for_warmup()  # a background warm-up steps with the weights and the pool
        n = self.weight_sync.update(weights, transform)
        self.reset_prefix_cache()
        if self.kv_tiers is not None:  # the disk tier keeps the model files' KV, no longer these weights'
            self.kv_tiers.drop_disk()
        self.num_weight_updates += 1
        return n

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached prefix block (they stay allocated to running requests, which
        go on); the next prompts compute their KV afresh. True (it always can)."""
        for pool in self.pools:
            pool.reset_prefix_cache()
        if self.kv_tiers is not None:  # the host tier's blocks too (their KV may be from old weights)
            self.kv_tiers.clear()
        return True

    def close_kv_tiers(self) -> None:
        """Writes the KV blocks computed since the last step through to the disk tier and waits
        for its pending writes (`LLM.close()`, its `with` exit and the server's shutdown all
        come here); idempotent, a no-op without a disk tier. The engine still serves after it;
        the disk tier is read-only then."""
        if self.kv_tiers is not None:
            with self.runner._state_lock:  # a background warm-up's first run may be replacing the pool
                self.kv_tiers.close(self.runner.kv)

    def sleep(self, level: int = 1) -> None:
        """Releases device memory while the process does other work (e.g. trains): level 1 the
        KV pool, level 2 the weights too (kept on the host). Requests are refused until
        `wake_up()`; only between requests (RuntimeError while some run). A background
        warm-up still compiling is finished first."""
        self._check_idle("sleep")
        self.runner.wait_for_warmup()  # its steps read the pool and the weights sleep releases
        self.weight_sync.sleep(level)
        self.reset_prefix_cache()  # the pool's contents are gone

    def wake_up(self) -> None:
        """Restores what `sleep` released (a zeroed KV pool, the weights from the host); no
        compilation."""
        if self._weight_sync is not None:
            self._weight_sync.wake_up()

    @property
    def sleep_level(self) -> int:
        """0: awake; 1: the KV pool released; 2: the weights too."""
        return 0 if self._weight_sync is None else self._weight_sync.sleep_level

    def check_awake(self) -> None:
        if self.sleep_level:
            raise EngineAsleepError(f"the engine is asleep (sleep level {self.sleep_level}): call wake_up() first")

    def add_score_request(self, request_id: str, prompt_ids: list[int], completion_ids: list[int],
                          lora_request=None) -> None:
        """Queues the scoring of completion_ids after prompt_ids: the model's log-probability of
        each completion token (one prefill through the scheduler, chunked like any prompt; the
        prompt's blocks may come from the prefix cache). Its output's prompt_logprobs hold them
        from index len(prompt_ids) on."""
        if not completion_ids:
            raise ValueError("nothing to score: the completion is empty")
        self.add_request(request_id, list(prompt_ids) + list(completion_ids),
                         SamplingParams(max_tokens=0, prompt_logprobs=0), score_from=len(prompt_ids),
                         lora_request=lora_request)

    def _check_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise RuntimeError(f"{what} runs between requests; requests are still running "
                               f"({sum(len(s.running) + len(s.waiting) for s in self.schedulers)}; wait for them or "
                               "abort them)")


class EngineAsleepError(EngineDeadError):
    """A request reached an engine put to sleep (unavailable for now: the server answers 503)."""
