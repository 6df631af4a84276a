"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

The engine wires the parts together and runs `step()`; each optional feature is one object,
None (or idle) when unused, called from one place: `spec` (SpecDecodeManager), `beams`
(BeamSearchManager), `masks` (StructuredOutputManager: grammars and other token masks),
`output` (OutputProcessor: stops, logprobs, text, the one writer of output tokens), `pooler`
(Pooler: embedding requests, made at the first one).
Penalties and prompt logprobs live in the runner's compiled step and sampler.

Not thread-safe: one thread owns an engine (the server runs it in a background thread).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pagedjax.models.kv_cache import DenseKVCache, PagedKVCache
from pagedjax.models.loader import load_model, resolve_model_dir
from pagedjax.config import EngineConfig
from pagedjax.core.beam_search import BeamGroup, BeamSearchManager, BeamSearchParams
from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import PLACEHOLDER, Request
from pagedjax.core.sched.scheduler import Scheduler
from pagedjax.core.sched.window import window_release
from pagedjax.engine import engine_stats
from pagedjax.engine.engine_info import EngineInfo
from pagedjax.engine.generation_config import sampling_defaults
from pagedjax.engine.input_processor import InputProcessor
from pagedjax.engine.kv_sizing import plan_kv
from pagedjax.engine.output_processor import OutputProcessor
from pagedjax.engine.weight_control import WeightControl
from pagedjax.lora.manager import LoRAManager
from pagedjax.outputs import RequestOutput
from pagedjax.parallel.data_parallel import DataParallelRouter
from pagedjax.parallel.distributed import is_multiprocess
from pagedjax.parallel.mesh import bytes_per_device, make_mesh
from pagedjax.pooling.params import PoolingParams, resolve_pooling_type
from pagedjax.pooling.pooler import Pooler
from pagedjax.sampling_params import SamplingParams, context_length_message
from pagedjax.spec_decode.manager import make_spec_decode
from pagedjax.structured_output.manager import StructuredOutputManager
from pagedjax.worker import compile_counter
from pagedjax.worker.compile_ahead import CompileAhead
from pagedjax.worker.kv_tiers import attach_kv_tiers
from pagedjax.worker.model_runner import ModelRunner
from pagedjax.platforms import current_platform


@dataclass(frozen=True)
class StepRecord:
    """What one `step()` did, for step observers (tests, benchmarks, tracing)."""

    outs: list  # one SchedulerOutput (or None: idle) per data-parallel rank
    produced: list  # (request, its first sampled row, its tokens or None) per request that produced
    dispatched_ahead: bool  # async scheduling dispatched the next step before reading this one


class LLMEngine(WeightControl, EngineInfo):
    def __init__(self, model: str | None = None, *, stream_text: bool = True, weights=None, **engine_kwargs):
        """stream_text: keep every request's text up to date each step and return outputs of
        unfinished requests too (for streaming); off, text is decoded once at the end.
        weights: Hugging Face-named arrays to load instead of the directory's weight files
        (a mapping or (name, array) pairs; every tensor the model needs)."""
        compile_counter.install()
        compile_counter.enable_persistent_cache()
        self.config = cfg = EngineConfig(model=model, **engine_kwargs)
        self.mesh = make_mesh(cfg.tensor_parallel_size, cfg.data_parallel_size)
        self.model_dir = resolve_model_dir(model)  # a local dir, the default model's, or a Hugging Face id's snapshot
        self.model, self.model_config, self.tokenizer = load_model(self.model_dir, cfg.dtype, cfg.scan_layers, self.mesh,
                                                                   cfg.quantization, cfg.expert_parallel, cfg.moe_impl,
                                                                   load_format=cfg.load_format, weights=weights)
        self.num_weight_updates = 0
        cfg.resolve(self.model_config)
        self.max_model_len = cfg.max_model_len
        self.model_name = engine_stats.model_name(model)
        # what requests that leave them unset sample with (generation_config.json; {}: SamplingParams' own)
        self.sampling_defaults = sampling_defaults(cfg.generation_config, self.model_dir)
        draft = None
        if cfg.speculative_config is not None and cfg.speculative_config.method == "draft_model":
            from pagedjax.spec_decode.draft_model import load_draft_model

            draft = load_draft_model(cfg.speculative_config.model, dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                                     vocab_size=self.model_config.vocab_size, max_model_len=cfg.max_model_len)
        plan = plan_kv(cfg, self.model, draft)  # fills cfg.num_blocks
        self.kv_bytes_per_token, self.kv_budget_tokens = plan.kv_bytes_per_token, plan.budget_tokens
        self.kv_dtype = plan.kv_dtype
        spec = cfg.speculative_config
        # a step verifies at most k drafts for each of up to 16 requests (sampled rows beyond one per sequence)
        max_drafts = spec.num_speculative_tokens * min(plan.max_num_seqs, 16) if spec else 0
        self.buckets = Buckets(plan.max_num_seqs, cfg.max_num_batched_tokens, max_drafts,
                               min_tokens=cfg.min_step_tokens or current_platform().smallest_step(self.model.dtype))
        # one block pool and scheduler per data-parallel rank; num_blocks and max_num_seqs are per rank
        dense = cfg.kv_cache == "dense"
        self.pools = [BlockPool(cfg.num_blocks, plan.block_size, cfg.enable_prefix_caching and not dense)
                      for _ in range(cfg.data_parallel_size)]
        self.schedulers = [Scheduler(pool, self.buckets, cfg.max_model_len) for pool in self.pools]
        self.pool, self.scheduler = self.pools[0], self.schedulers[0]  # the only ones without data parallelism
        self.router = DataParallelRouter(self.schedulers)
        cache = (DenseKVCache(cfg.num_blocks, cfg.max_model_len, mesh=self.mesh) if dense else
                 PagedKVCache(cfg.num_blocks, cfg.block_size, cfg.attention_impl, mesh=self.mesh))
        self.runner = ModelRunner(self.model, self.buckets, cache, -(-cfg.max_model_len // plan.block_size),
                                  plan.kv_dtype, self.mesh,
                                  lora_slots=(cfg.max_loras, cfg.max_lora_rank, tuple(cfg.lora_target_modules))
                                  if cfg.enable_lora else None)
        self.lora: LoRAManager | None = None  # multi-LoRA (enable_lora): adapters and their device slots
        if cfg.enable_lora:
            self.lora = LoRAManager(self.model_config, self.model.tp_layout, cfg.max_loras, cfg.max_lora_rank,
                                    cfg.max_cpu_loras, self.schedulers, cfg.lora_target_modules)
            for sched in self.schedulers:
                sched.lora = self.lora
        if cfg.release_window_blocks and not dense and draft is None:  # a draft model reads every block
            for sched in self.schedulers:
                sched.window = window_release(self.model_config.layer_windows, plan.block_size)
        self.kv_tiers = attach_kv_tiers(cfg, self.runner, self.schedulers, self.model_dir, weights)  # None: no tier
        self.compile_ahead = CompileAhead(self.runner, self.buckets, cfg.max_model_len)
        self.spec = make_spec_decode(cfg, self.buckets, plan, draft)  # None: no speculative decoding
        for sched in self.schedulers:
            sched.draft_policy = self.spec
        # read once from the arrays' shards (their placement never changes)
        self.weight_bytes_per_device = bytes_per_device(self.runner.state)
        self.kv_pool_bytes_per_device = bytes_per_device(self.runner.kv)
        self.eos_token_ids = tuple(self.model_config.eos_token_ids) or engine_stats.tokenizer_eos(self.tokenizer)
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.runner.vocab_size,
                                     self.model_name)
        self.masks = StructuredOutputManager(self.tokenizer, self.runner.vocab_size, self.eos_token_ids,
                                             self.model_name)
        self.output = OutputProcessor(self.tokenizer, self.schedulers, self.masks, stream_text)
        self.beams: BeamSearchManager | None = None  # made at the first beam search
        self.pooler: Pooler | None = None  # made at the first embedding request
        self._seed_rng = np.random.default_rng(cfg.seed)
        self.num_steps = 0
        self.num_computed_prompt_tokens = 0
        # schedule step t + 1 while the device runs step t (see step()); never across processes,
        # whose followers replay process 0's steps one at a time
        self.async_scheduling = cfg.async_scheduling and not is_multiprocess()
        self._inflight = None  # (outs, PendingStep) dispatched, not yet read back
        self.step_observers: list = []  # callables, each called with a StepRecord after every step

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None, lora_request=None, score_from: int = 0) -> None:
        """Queues a request; raises ValueError with the reason if it can never run.

        With n > 1 the prompt is computed once and the n sequences fork from it, sharing its
        blocks. `cache_salt` keeps this request's prefix-cache entries apart from others'.
        lora_request: a LoRARequest (needs enable_lora) to run the request with that adapter.
        score_from: with prompt_logprobs, the first prompt index whose log-probability is
        wanted (the prefix before it may come from the prefix cache; add_score_request)."""
        params = params or SamplingParams()
        self.check_awake()
        self._check_new_id(request_id)
        adapter = None
        if lora_request is not None:
            if self.lora is None:
                raise ValueError("a lora_request needs an engine started with enable_lora=True")
            adapter = self.lora.add(lora_request)  # registered and read if new (its host copy)
        if self.tokenizer is None and params.stop_strings:
            raise ValueError(f"{self.model_name} has no tokenizer: stop strings cannot be matched")
        keep = params.truncate_prompt_tokens
        text, ids = self.inputs.tokenize(prompt, self.max_model_len if keep == -1 else keep)
        self.inputs.check_token_ids(params)
        self._check_fits(len(ids), params)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if params.uses_token_mask:
            self.masks.add(seq_ids, params)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31))
        reqs = [Request(rid, list(ids), params, base_seed + i, self.eos_token_ids, cache_salt=cache_salt,
                        lora_adapter=adapter, prompt_logprobs_from=score_from) for i, rid in enumerate(seq_ids)]
        reqs[0].pending_forks, reqs[0].reserved_seats = reqs[1:], len(reqs) - 1
        rank = self.router.route(reqs[0])
        self.schedulers[rank].add(reqs[0])
        for req in reqs:
            req.dp_rank = rank
        self.output.add(request_id, text, reqs)

    def _check_fits(self, num_prompt: int, params: SamplingParams | BeamSearchParams) -> None:
        """A max_tokens the caller gave must fit beside the prompt (the server's 400 in words);
        a default one is held to the room left. A prompt with no room left is the scheduler's error."""
        if params.max_tokens_given and num_prompt < self.max_model_len < num_prompt + params.max_tokens:
            raise ValueError(context_length_message(self.max_model_len, num_prompt, params.max_tokens))

    def add_beam_search(self, request_id: str, prompt: str | list[int], params: BeamSearchParams) -> None:
        """Queues a beam search; its result lands in `finished_beam_searches[request_id]`."""
        self.check_awake()
        self._check_new_id(request_id)
        _, ids = self.inputs.tokenize(prompt)
        self._check_fits(len(ids), params)
        if self.beams is None:
            self.beams = BeamSearchManager(self.schedulers, self.tokenizer)
        group = BeamGroup(request_id, ids, params, self.eos_token_ids)
        self.beams.add(group, self.router.route(group.root))

    def add_embed_request(self, request_id: str, prompt: str | list[int], params: PoolingParams | None = None) -> None:
        """Queues an embedding request: its prompt is prefilled (chunked like any other, through
        the same scheduler), pooled and finished at once, its blocks freed; its one output is an
        EmbeddingRequestOutput. ValueError with the reason if it can never run."""
        params = params or PoolingParams()
        self.check_awake()
        self._check_new_id(request_id)
        text, ids = self.inputs.tokenize(prompt)
        if self.pooler is None:
            self.pooler = Pooler(resolve_pooling_type(self.config.pooling_type, self.model_dir),
                                 self.model_config.hidden_size, self.buckets.token_buckets(), self.buckets.num_seqs,
                                 self.config.data_parallel_size, self.runner.hidden_specs)
        req = self.pooler.make_request(request_id, text, ids, params)
        rank = self.router.route(req)
        try:
            self.schedulers[rank].add(req)
        except ValueError:
            self.pooler.pop(request_id)
            raise
        req.dp_rank = rank

    @property
    def finished_beam_searches(self) -> dict:
        """request id -> BeamSearchOutput of each beam search done and not yet popped."""
        return self.beams.finished if self.beams is not None else {}

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.output.groups or (self.beams is not None and request_id in self.beams.groups) \
                or (self.pooler is not None and request_id in self.pooler.requests):
            raise ValueError(f"request id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> None:
        """Ends a request at once and returns its blocks; unknown ids are ignored."""
        if self.beams is not None:
            self.beams.abort(request_id)
        pooled = self.pooler.pop(request_id) if self.pooler is not None else []
        for req in self.output.pop(request_id) + pooled:
            self.schedulers[req.dp_rank].finish(req, "abort")
            self._release(req)
        self._warmup_if_idle()

    def _release(self, req: Request) -> None:
        """Gives back what a finished sequence held beside its blocks."""
        self.runner.release_penalty_slot(req)
        self.masks.release(req)
        if self.spec is not None:
            self.spec.release(req)

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or any(s.has_unfinished() for s in self.schedulers)

    @property
    def grammar_compiler(self):
        """The structured-output GrammarCompiler (built at first use; None without a tokenizer)."""
        return self.masks.grammar_compiler

    @property
    def stream_text(self) -> bool:
        return self.output.stream_text

    @stream_text.setter
    def stream_text(self, value: bool) -> None:
        self.output.stream_text = value

    @property
    def output_deltas(self) -> bool:
        """True: each RequestOutput carries only what is new since the request's previous one."""
        return self.output.output_deltas

    @output_deltas.setter
    def output_deltas(self, value: bool) -> None:
        self.output.output_deltas = value

    # -- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Runs one model step and returns the outputs of requests that changed.

        With async scheduling the engine schedules and dispatches the next step before it reads
        this one's tokens, so the host prepares step t + 1 while the device runs step t: the
        tokens step t samples reach step t + 1 on the device (`Request.pending_row`), and a
        request that stops at step t (EOS, stop string) wastes one row of step t + 1, whose
        result is dropped. Requests whose next step needs the sampled token on the host first
        (token masks, penalties, beams, speculative drafts) run one step at a time."""
        if self._inflight is not None:
            (outs, pending), self._inflight = self._inflight, None
        else:
            outs = self._schedule()
            if outs is None:
                return []
            pending = self._dispatch(outs)
        ahead = False
        if self._can_overlap():
            produced = self._update(outs, pending)  # placeholders for the tokens still on the device
            nxt = self._schedule(hold=self._finishing(produced))
            if nxt is not None:
                self._inflight, ahead = (nxt, self._dispatch(nxt, prev=pending)), True
            result = self.runner.fetch(pending)
            self.output.fill_placeholders(produced, result)
        else:
            result = self.runner.fetch(pending)
            produced = self._update(outs, pending, result)
        if self.spec is not None:
            self.spec.record_step(pending)
        if result.prompt is not None:
            self.output.collect_prompt_logprobs(outs, result.prompt)
        if self.beams is not None and self.beams.groups:
            self.beams.process(produced, result)
        embedded = self.pooler.process(outs, result.pooled, produced) if self.pooler is not None else []
        outputs, finished = self.output.process(produced, result)
        for req in finished:
            self._release(req)
        self._warmup_if_idle()
        for observe in self.step_observers:
            observe(StepRecord(outs, produced, ahead))
        return embedded + outputs if embedded else outputs

    def _schedule(self, hold: frozenset = frozenset()) -> list | None:
        """One SchedulerOutput per data rank for the next step (None: nothing to run)."""
        if not self.runner.warmup_done:  # compile the rungs the queued work wants, if that pays
            self.compile_ahead(self.schedulers)
        budget = self.runner.ready_tokens() or self.buckets.max_num_batched_tokens
        if self.spec is not None:
            self.spec.propose(self.schedulers)
        outs = []
        for sched in self.schedulers:
            sched.token_budget = budget
            outs.append(sched.schedule(hold))
        if all(out is None for out in outs):
            self.runner.allow_warmup(True)
            return None
        # a background warm-up waits while every step fits the buckets compiled so far, or the
        # queued work wants no larger one than the budget (compile_ahead compiled it)
        self.runner.allow_warmup(budget < self.compile_ahead.wanted_tokens and
                                 any(out is not None and sum(out.q_lens) >= budget for out in outs))
        return outs

    def _dispatch(self, outs, prev=None):
        if self.lora is not None:  # adapters admitted into new slots: written before the step reads them
            self.lora.flush(self.runner.load_lora_slot)
        pool = self.pooler.hook(outs) if self.pooler is not None else None  # embeddings in this step
        return self.runner.dispatch(outs, lambda bitmask, rows: self.masks.fill(outs, bitmask, rows), prev, pool)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens are read: no
        request needs its last token on the host to build its next step."""
        if not self.async_scheduling or self.spec is not None or (self.beams is not None and self.beams.groups):
            return False
        return not self.output.any_params(lambda p: p.uses_token_mask or p.uses_penalties)

    def _update(self, outs, pending, result=None) -> list[tuple[Request, int, list[int] | None]]:
        """Folds a step into the schedulers and appends each produced token: (request, its
        first sampled row, its tokens) for each request that produced. Without `result` (async
        scheduling) each produced token is a PLACEHOLDER, and the request's pending_row points
        at its row of the step's padded tokens (`PendingStep.tokens`) for the next step to read
        on the device."""
        self.num_steps += 1
        rows = self.buckets.num_rows(pending.t)  # sampled rows per data rank
        produced = []
        for rank, (sched, out) in enumerate(zip(self.schedulers, outs)):
            if out is None:
                continue
            self.num_computed_prompt_tokens += out.num_prefill_tokens
            offsets = out.row_offsets()
            first = [rank * rows + r for r in offsets]  # each entry's first sampled row
            if result is None:
                emitted = [[PLACEHOLDER] for _ in offsets]
            elif self.spec is not None:
                emitted = [self.spec.emitted(result, out, i, row) for i, row in enumerate(first)]
            else:
                emitted = [[token] for token in result.tokens[first].tolist()]
            done = sched.update(out, emitted)
            self.output.append_produced(done)
            for req, i, tokens in (done if result is None else ()):  # async: each token's row on the device
                if tokens is not None:
                    req.pending_row = rank * self.runner.max_rows + offsets[i]
            produced += [(req, first[i], tokens) for req, i, tokens in done]
        return produced

    def _finishing(self, produced) -> frozenset:
        """Requests that end with the token just produced whatever it is (max_tokens,
        max_model_len): the next step leaves them out."""
        return frozenset(req for req, _, tokens in produced if tokens is not None and (
            len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len))

    def _warmup_if_idle(self) -> None:
        """Lets a background warm-up go on once no request is left (the engine idles)."""
        if not self.has_unfinished_requests():
            self.runner.allow_warmup(True)

    # -- compile & stats ------------------------------------------------------------------
    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compiles the step for every bucket so that serving compiles nothing afterwards.

        background: compile the smallest bucket now and the others on a background thread;
        steps stay within the compiled buckets meanwhile (prompts take smaller chunks), so
        serving starts at once and never compiles on the request path."""
        if self.spec is not None and self.spec.drafter is not None:  # the draft model's steps (small) first
            self.spec.drafter.warmup()
        if background and not is_multiprocess():  # processes must agree on every step's size
            self.runner.start_background_warmup()
        else:
            self.runner.warmup(progress)

    def wait_for_warmup(self) -> None:
        """Blocks until a background warm-up has compiled every bucket."""
        self.runner.wait_for_warmup()
