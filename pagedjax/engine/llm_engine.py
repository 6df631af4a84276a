"""LLMEngine: requests in, one scheduled model step at a time, RequestOutputs out.

Not thread-safe: one thread owns an engine (the server runs it in a background thread).
"""
from __future__ import annotations

import threading
import time
from dataclasses import asdict, dataclass, field, fields

import numpy as np
from flax import nnx

from models.kv_cache import DenseKVCache, PagedKVCache
from models.loader import load_model, resolve_kv_cache_dtype
from pagedjax.worker import compile_counter
from pagedjax.sample import prompt_logprobs
from pagedjax.core.beam_search import BeamGroup, BeamSearchOutput, BeamSearchParams
from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.config import EngineConfig
from pagedjax.parallel.data_parallel import DataParallelRouter
from pagedjax.parallel.distributed import is_multiprocess
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.core.kv_memory import KVMemory, kv_memory
from pagedjax.worker.model_runner import ModelRunner
from pagedjax.parallel.mesh import bytes_per_device, make_mesh
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.core.request import PLACEHOLDER, Request
from pagedjax.sampling_params import SamplingParams
from pagedjax.core.sched.scheduler import Scheduler
from pagedjax.spec_decode.policy import MeasuredCosts, acceptance_estimate, draft_depth, propose
from pagedjax.sample.token_mask import MaskRules, TokenMask, mask_needed

# a draft model that does not pay drafts once after this many steps (its acceptance and cost
# move), then after twice as many each time it still does not pay, up to DRAFT_PROBE_MAX
DRAFT_PROBE_INTERVAL, DRAFT_PROBE_MAX = 16, 512


@dataclass(slots=True, eq=False)
class _Sequence:
    """Text state of one output sequence."""

    req: Request
    index: int
    detok: IncrementalDetokenizer | None
    text: str = ""
    sent_tokens: int = 0  # output_deltas: tokens (and logprobs) already returned
    sent_chars: int = 0  # output_deltas: characters of text already returned
    mask: TokenMask | None = None  # constraints on the next token (grammar, allowed/bad words, min_tokens)


@dataclass(slots=True, eq=False)
class _Group:
    """A user request: its n sequences share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # params.prompt_logprobs: one per prompt token
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        return all(s.req.is_finished for s in self.seqs)


class LLMEngine:
    def __init__(self, model: str | None = None, *, stream_text: bool = True, **engine_kwargs):
        """stream_text: keep every request's text up to date each step and return outputs of
        unfinished requests too (for streaming); off, text is decoded once at the end."""
        compile_counter.install()
        compile_counter.enable_persistent_cache()
        self.config = EngineConfig(model=model, **engine_kwargs)
        cfg = self.config
        self.mesh = make_mesh(cfg.tensor_parallel_size, cfg.data_parallel_size)
        self.model, self.model_config, self.tokenizer = load_model(model, cfg.dtype, cfg.scan_layers, self.mesh)
        cfg.resolve(self.model_config)
        self.max_model_len = cfg.max_model_len
        self.model_name = _model_name(model)
        self.stream_text = stream_text
        # True: each RequestOutput carries only what is new since the request's previous output
        # (text, token ids, logprobs), so a step costs O(new tokens), not O(output length)
        self.output_deltas = False
        mc = self.model_config
        kv_dtype = resolve_kv_cache_dtype(cfg.kv_cache_dtype, self.model.dtype)
        # KV heads as stored: replicated up to tensor_parallel_size when the model has fewer
        self.kv_bytes_per_token = 2 * mc.num_layers * self.model.num_kv_heads * mc.head_dim * kv_dtype.itemsize
        # dense: a block is one request's whole max_model_len slot, taken at admission, no sharing
        dense = cfg.kv_cache == "dense"
        block_size = cfg.max_model_len if dense else cfg.block_size
        weight_bytes = max(bytes_per_device(nnx.state(self.model)).values())  # one device's share
        spec = cfg.speculative_config
        k = spec.num_speculative_tokens if spec else 0
        draft, draft_token_bytes = None, 0  # a draft model: it and its KV pool share the budget
        if spec is not None and spec.method == "draft_model":
            from pagedjax.spec_decode import draft_model

            draft = draft_model.load_draft_model(spec.model, dtype=cfg.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
                                                 vocab_size=mc.vocab_size, max_model_len=cfg.max_model_len)
            # its pool holds every rank's tokens (plus k + 1 and a block per sequence: reserved below)
            draft_token_bytes = draft.kv_bytes_per_token * cfg.data_parallel_size
            weight_bytes += max(bytes_per_device(nnx.state(draft.model)).values())
        if cfg.num_blocks is None:
            # the penalty slots (counts int32, prompt flags, bias f32 per vocabulary entry) sit beside the pool
            penalty_bytes = cfg.max_num_seqs * mc.vocab_size * 9
            reserved = 0  # the draft's k + 1 tokens and a block per sequence, and its blocks' rounding
            if draft is not None:
                bs = draft_model.DRAFT_BLOCK_SIZE
                reserved = draft_token_bytes * (cfg.max_num_seqs * (k + 1 + bs) + bs)
            cfg.num_blocks = cfg.default_num_blocks((self.kv_bytes_per_token + draft_token_bytes) * block_size,
                                                    weight_bytes + penalty_bytes, block_size, reserved)
        self.kv_budget_tokens = (None if cfg.kv_cache_memory_gb is None else
                                 int(cfg.kv_cache_memory_gb * (1 << 30)) // (self.kv_bytes_per_token + draft_token_bytes))
        max_seqs = min(cfg.max_num_seqs, cfg.num_blocks) if dense else cfg.max_num_seqs  # dense: batch <= slots
        self.spec = spec  # SpeculativeConfig or None
        # a step verifies at most k drafts for each of up to 16 requests (sampled rows beyond one per sequence)
        max_drafts = self.spec.num_speculative_tokens * min(max_seqs, 16) if self.spec else 0
        self.buckets = Buckets(max_seqs, cfg.max_num_batched_tokens, max_drafts)
        # one block pool and scheduler per data-parallel rank; num_blocks and max_num_seqs are per rank
        self.pools = [BlockPool(cfg.num_blocks, block_size, cfg.enable_prefix_caching and not dense)
                      for _ in range(cfg.data_parallel_size)]
        self.schedulers = [Scheduler(pool, self.buckets, cfg.max_model_len) for pool in self.pools]
        self.pool, self.scheduler = self.pools[0], self.schedulers[0]  # the only ones without data parallelism
        self.router = DataParallelRouter(self.schedulers)
        if dense:
            cache = DenseKVCache(cfg.num_blocks, cfg.max_model_len, mesh=self.mesh)
        else:
            cache = PagedKVCache(cfg.num_blocks, cfg.block_size, cfg.attention_impl, mesh=self.mesh)
        max_blocks = -(-cfg.max_model_len // block_size)
        self.runner = ModelRunner(self.model, self.buckets, cache, max_blocks, kv_dtype, self.mesh)
        self.drafter = None  # speculative decoding with a draft model
        if draft is not None:
            # room for every token the target's pools hold plus k + 1 for each sequence; a step of
            # the draft fits every sequence of every rank
            seqs = max_seqs * cfg.data_parallel_size
            tokens = cfg.num_blocks * block_size * cfg.data_parallel_size + seqs * (k + 1)
            self.drafter = draft_model.DraftModelProposer(
                draft, max_num_seqs=seqs, max_model_len=cfg.max_model_len,
                max_num_batched_tokens=max(cfg.max_num_batched_tokens, seqs),
                num_blocks=-(-tokens // draft_model.DRAFT_BLOCK_SIZE) + seqs, attention_impl=cfg.attention_impl)
        # read once from the arrays' shards (their placement never changes)
        self.weight_bytes_per_device = bytes_per_device(self.runner.state)
        self.kv_pool_bytes_per_device = bytes_per_device(self.runner.kv)
        self.eos_token_ids = tuple(mc.eos_token_ids) or _tokenizer_eos(self.tokenizer)
        self._groups: dict[str, _Group] = {}
        self._beam_groups: dict[str, BeamGroup] = {}
        self.finished_beam_searches: dict[str, BeamSearchOutput] = {}
        self._seq_of: dict[str, _Sequence] = {}
        self._group_of: dict[str, _Group] = {}
        self._seed_rng = np.random.default_rng(cfg.seed)
        self.num_steps = 0
        self.num_generated_tokens = 0
        self.num_computed_prompt_tokens = 0
        self.num_draft_tokens = 0  # speculative decoding: drafts verified, accepted, request-steps that verified
        self.num_accepted_draft_tokens = 0
        self.num_verify_steps = 0
        # speculative decoding's cost model: wall seconds of a step by T, of a draft model's proposal by depth
        self._step_costs = MeasuredCosts(float)
        self._draft_costs = MeasuredCosts(lambda depth: 0.0)
        self._steps_without_drafts = 0  # consecutive steps a draft model did not draft
        self._drafted_last_step = False
        self._probe_interval = DRAFT_PROBE_INTERVAL
        for sched in self.schedulers:
            sched.step_cost = self._step_costs
        # schedule step t + 1 while the device runs step t (see step()); never across processes,
        # whose followers replay process 0's steps one at a time
        self.async_scheduling = cfg.async_scheduling and not is_multiprocess()
        self._inflight = None  # (outs, PendingStep) dispatched, not yet read back
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()

    @property
    def grammar_compiler(self):
        """The structured-output GrammarCompiler (built at first use; None without a tokenizer)."""
        if self.tokenizer is None:
            return None
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from pagedjax.structured_output.grammar import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.runner.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    # -- requests -------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    cache_salt: str | None = None) -> None:
        """Queues a request; raises ValueError with the reason if it can never run.

        With n > 1 the prompt is computed once and the n sequences fork from it, sharing its
        blocks. `cache_salt` keeps this request's prefix-cache entries apart from others'."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self.tokenizer is None and params.stop_strings:
            raise ValueError(f"{self.model_name} has no tokenizer: stop strings cannot be matched")
        text, ids = self._tokenize(prompt)
        self._check_token_ids(params)
        masks = self._token_masks(params) if params.uses_token_mask else [None] * params.n
        group = _Group(request_id, text, ids, params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
        base_seed = params.seed if params.seed is not None else int(self._seed_rng.integers(0, 2**31))
        reqs = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            reqs.append(Request(rid, list(ids), params, base_seed + i, self.eos_token_ids))
        reqs[0].pending_forks, reqs[0].reserved_seats, reqs[0].cache_salt = reqs[1:], len(reqs) - 1, cache_salt
        for child in reqs[1:]:
            child.cache_salt = cache_salt
        rank = self.router.route(reqs[0])
        self.schedulers[rank].add(reqs[0])
        for i, req in enumerate(reqs):
            req.dp_rank = rank
            incremental = self.tokenizer is not None and (self.stream_text or bool(params.stop_strings))
            seq = _Sequence(req, i, IncrementalDetokenizer(self.tokenizer, ids) if incremental else None, mask=masks[i])
            group.seqs.append(seq)
            self._seq_of[req.request_id] = seq
            self._group_of[req.request_id] = group
        self._groups[request_id] = group

    def _check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.runner.vocab_size
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def _token_masks(self, params: SamplingParams) -> list[TokenMask]:
        """A TokenMask per sequence: the request's rules built once, a grammar matcher each."""
        matcher = None
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError(f"{self.model_name} has no tokenizer: structured outputs need one")
            matcher = self.grammar_compiler.matcher(params.structured_outputs)
        rules = MaskRules(params, self.runner.vocab_size, self.eos_token_ids, self.tokenizer)
        if params.ignore_eos:
            rules.min_token_bans = tuple(params.stop_token_ids)
        return [TokenMask(rules, matcher if i == 0 or matcher is None else matcher.fork()) for i in range(params.n)]

    def _fill_masks(self, outs, bitmask, rows: int) -> None:
        """Writes the token masks of the constrained sequences of the step (runner callback,
        called while the device runs the forward pass); rank r's request i is row r * rows + i."""
        for rank, out in enumerate(outs):
            if out is None:
                continue
            first = out.row_offsets()
            for i, (req, start, q) in enumerate(zip(out.requests, out.starts, out.q_lens)):
                seq = self._seq_of.get(req.request_id)
                if seq is not None and seq.mask is not None and start + q >= req.num_tokens and mask_needed(req):
                    seq.mask.fill(bitmask[rank * rows + first[i]], req.output_token_ids)

    def _collect_prompt_logprobs(self, outs, plp) -> None:
        """Stores the prompt logprobs the step computed for the requests that asked."""
        t = len(plp.logprobs) // len(outs)
        for rank, out in enumerate(outs):
            if out is None:
                continue
            off = rank * t
            for req, start, q in zip(out.requests, out.starts, out.q_lens):
                group = self._group_of.get(req.request_id)
                if group is not None and group.prompt_logprobs is not None and start < req.num_prompt_tokens:
                    for pos, entry in prompt_logprobs.entries(plp, off, range(start, start + q), req.prompt_token_ids,
                                                              req.params.prompt_logprobs):
                        group.prompt_logprobs[pos] = entry
                off += q

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids), with clear errors for what cannot run."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_name} has no tokenizer: give token-id prompts")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return text, ids

    def abort_request(self, request_id: str) -> None:
        """Ends a request at once and returns its blocks; unknown ids are ignored."""
        beam_group = self._beam_groups.pop(request_id, None)
        if beam_group is not None:
            beam_group.abort(self.schedulers[beam_group.root.dp_rank])
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for seq in group.seqs:
            self.schedulers[seq.req.dp_rank].finish(seq.req, "abort")
            self._forget(seq)
        self._warmup_if_idle()

    def has_unfinished_requests(self) -> bool:
        return self._inflight is not None or any(s.has_unfinished() for s in self.schedulers)

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
            outs, pending = self._inflight
            self._inflight = None
        else:
            outs = self._schedule()
            if outs is None:
                return []
            pending = self._dispatch(outs)
        if self._can_overlap():
            produced = self._update(outs, pending)  # placeholders for the tokens still on the device
            nxt = self._schedule(hold=self._finishing(produced))
            if nxt is not None:
                self._inflight = (nxt, self._dispatch(nxt, prev=pending))
            result = self.runner.fetch(pending)
            self._fill_placeholders(produced, result)
        else:
            result = self.runner.fetch(pending)
            produced = self._update(outs, pending, result)
        if self.spec is not None and not pending.first_run:  # what a step of each size costs here
            self._step_costs.add(pending.t, time.perf_counter() - pending.began)
        if result.prompt is not None:
            self._collect_prompt_logprobs(outs, result.prompt)
        return self._process(produced, result)

    def _schedule(self, hold: frozenset = frozenset()) -> list | None:
        """One SchedulerOutput per data rank for the next step (None: nothing to run)."""
        budget = self.runner.ready_tokens() or self.buckets.max_num_batched_tokens
        if self.spec is not None:
            self._propose_drafts()
        outs = []
        for sched in self.schedulers:
            sched.token_budget = budget
            outs.append(sched.schedule(hold))
        if all(out is None for out in outs):
            self.runner.allow_warmup(True)
            return None
        # a background warm-up waits while every step fits the buckets it has compiled so far
        self.runner.allow_warmup(any(out is not None and sum(out.q_lens) >= budget for out in outs))
        return outs

    def _dispatch(self, outs, prev=None):
        return self.runner.dispatch(outs, lambda bitmask, rows: self._fill_masks(outs, bitmask, rows), prev)

    def _can_overlap(self) -> bool:
        """Whether the next step may be scheduled before this one's tokens are read: no
        request needs its last token on the host to build its next step."""
        if not self.async_scheduling or self.spec is not None or self._beam_groups:
            return False
        return not any(g.params.uses_token_mask or g.params.uses_penalties for g in self._groups.values())

    def _update(self, outs, pending, result=None) -> list[tuple[Request, int, list[int] | None]]:
        """Folds a step into the schedulers: (request, its first sampled row, its tokens) for
        each request that produced. Without `result` (async scheduling) each produced token is
        a PLACEHOLDER, and the request's pending_row points at its row of the step's padded
        tokens (`PendingStep.tokens`) for the next step to read on the device."""
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
            else:
                emitted = [self._emitted(result, out, i, row) for i, row in enumerate(first)]
            for req, i, tokens in sched.update(out, emitted):
                if result is None and tokens is not None:
                    req.pending_row = rank * self.runner.max_rows + offsets[i]
                produced.append((req, first[i], tokens))
        return produced

    def _finishing(self, produced) -> frozenset:
        """Requests that end with the token just produced whatever it is (max_tokens,
        max_model_len): the next step leaves them out."""
        return frozenset(req for req, _, tokens in produced if tokens is not None and (
            len(req.output_token_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len))

    @staticmethod
    def _fill_placeholders(produced, result) -> None:
        """Puts the step's sampled tokens where `_update` left placeholders."""
        for req, row, tokens in produced:
            if tokens is not None:
                tokens[0] = req.output_token_ids[-1] = int(result.tokens[row])
                req.pending_row = -1

    def _process(self, produced, result) -> list[RequestOutput]:
        """Stop checks, logprobs, grammars, text and outputs for the tokens a step produced."""
        touched: dict[str, _Group] = {}
        beams_touched: dict[int, BeamGroup] = {}
        now = time.monotonic()
        for req, row, tokens in produced:
            if tokens is None:  # max_tokens=0: the prompt is scored, nothing generated
                touched[req.request_id] = self._group_of[req.request_id]
                continue
            if req.beam_group is not None:
                self._append_logprobs(req, result, row, tokens[0])
                beams_touched[id(req.beam_group)] = req.beam_group
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            seq = self._seq_of[req.request_id]
            before = len(req.output_token_ids) - len(tokens)
            for j, token in enumerate(tokens):  # several with speculative decoding
                if req.is_finished:  # ended by an earlier token of this step: the rest never happened
                    del req.output_token_ids[len(req.output_token_ids) - (len(tokens) - j):]
                    break
                self._append_logprobs(req, result, row + j, token)
                self.num_generated_tokens += 1
                self.schedulers[req.dp_rank].check_stop(req, token, before + j + 1)
                if seq.mask is not None:
                    self._advance_mask(seq, token)
                if seq.detok is not None:
                    self._append_text(seq, token)
            touched[req.request_id] = self._group_of[req.request_id]
        for bg in beams_touched.values():
            if bg.ready():
                bg.advance(self.schedulers[bg.root.dp_rank])
                self.num_generated_tokens += len(bg.beams)
                if bg.done:
                    self._beam_groups.pop(bg.request_id, None)
                    self.finished_beam_searches[bg.request_id] = bg.output(self.tokenizer)
        groups = {id(g): g for g in touched.values()}.values()
        # offline (stream_text off) callers only read finished outputs: skip copying the rest
        outputs = [self._output(g) for g in groups if self.stream_text or g.finished]
        for g in touched.values():
            if g.finished and g.request_id in self._groups:
                del self._groups[g.request_id]
                for seq in g.seqs:
                    self._forget(seq)
        self._warmup_if_idle()
        return outputs

    def _warmup_if_idle(self) -> None:
        """Lets a background warm-up go on once no request is left (the engine idles)."""
        if not self.has_unfinished_requests():
            self.runner.allow_warmup(True)

    def add_beam_search(self, request_id: str, prompt: str | list[int], params: BeamSearchParams) -> None:
        """Queues a beam search; its result lands in `finished_beam_searches[request_id]`."""
        if request_id in self._groups or request_id in self._beam_groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        _, ids = self._tokenize(prompt)
        group = BeamGroup(request_id, ids, params, self.eos_token_ids)
        rank = self.router.route(group.root)
        self.schedulers[rank].add(group.root)
        self._beam_groups[request_id] = group

    def step_costs(self) -> dict[int, float]:
        """Wall seconds of a step by its size T, as measured so far (medians of recent steps;
        kept with speculative decoding, whose draft allocation weighs them)."""
        return self._step_costs.as_dict()

    def draft_costs(self) -> dict[int, float]:
        """Wall seconds of a draft model's proposal by its depth (drafts per request), as
        measured so far (medians of recent proposals)."""
        return self._draft_costs.as_dict()

    def _propose_drafts(self) -> None:
        """Drafts (prompt lookup, or the draft model) for every running request about to
        decode (not for beams, nor for requests whose penalties or token masks depend on each
        token before it)."""
        spec, wanted, rows = self.spec, [], 0
        for sched in self.schedulers:
            rank = 0  # decoding requests of this data-parallel rank
            for req in sched.running:
                p = req.params
                req.draft_token_ids = []
                if (req.num_tokens - req.num_computed_tokens == 1 and req.output_token_ids and req.beam_group is None
                        and not p.uses_penalties and not p.uses_token_mask):
                    wanted.append(req)
                    rank += 1
            rows = max(rows, rank)
        if self.drafter is not None:
            running = {id(req) for sched in self.schedulers for req in sched.running}
            self.drafter.release_all_but(running)  # slots of finished or preempted requests
            depth = self._draft_depth(wanted, rows)
            if depth == 0:
                self._drafted_last_step = False
                return
            began, compiled = time.perf_counter(), self.drafter.num_compiled_steps
            for req, drafts in zip(wanted, self.drafter.propose(wanted, depth, running)):
                req.draft_token_ids = drafts
            # a cost: not a first run (compile, load), nor a proposal after steps without
            # drafts (it reads every token missed meanwhile); propose reads its drafts back
            if self.drafter.num_compiled_steps == compiled and self._drafted_last_step:
                self._draft_costs.add(depth, time.perf_counter() - began)
            self._drafted_last_step = True
            return
        for req in wanted:
            req.draft_token_ids = propose(np.asarray(req.all_token_ids), spec.num_speculative_tokens,
                                          spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _draft_depth(self, wanted: list[Request], rows: int) -> int:
        """Drafts per request the draft model proposes this step (speculative.draft_depth;
        rows: the decoding requests of the largest data-parallel rank): 0 while it costs more
        than its accepted drafts save, but 1 now and then (after DRAFT_PROBE_INTERVAL steps,
        then ever fewer), so that its acceptance and cost stay measured. Always
        num_speculative_tokens with "adaptive": False."""
        if not wanted:
            return 0
        if not self.spec.adaptive:
            return self.spec.num_speculative_tokens
        rates = [acceptance_estimate(r.num_accepted_drafts, r.num_drafted) for r in wanted]
        room = min(self.buckets.max_draft_tokens, self.buckets.max_num_batched_tokens - rows)
        target = lambda t: self._step_costs(self.buckets.token_bucket(t))
        depth = draft_depth(rates, self.spec.num_speculative_tokens, target, self._draft_costs, rows, room)
        if depth == 0:
            self._steps_without_drafts += 1
            if self._steps_without_drafts < self._probe_interval:
                return 0
            depth, self._probe_interval = 1, min(2 * self._probe_interval, DRAFT_PROBE_MAX)
        else:
            self._probe_interval = DRAFT_PROBE_INTERVAL
        self._steps_without_drafts = 0
        return depth

    def _emitted(self, result, out, i: int, row: int) -> list[int]:
        """The tokens entry i of `out` emits: its sampled token, or with drafts the accepted
        drafts and then the redraw at the first rejected one (or the sample after the last)."""
        n = out.num_drafts(i)
        if not n:
            return [int(result.tokens[row])]
        drafts, tokens = out.drafts[i], []
        for j in range(n):
            if not result.accepted[row + j]:
                tokens.append(int(result.resampled[row + j]))
                break
            tokens.append(drafts[j])
        else:
            tokens.append(int(result.tokens[row + n]))
        self.num_draft_tokens += n
        self.num_accepted_draft_tokens += len(tokens) - 1
        req = out.requests[i]
        req.num_drafted += n
        req.num_accepted_drafts += len(tokens) - 1
        self.num_verify_steps += 1
        return tokens

    def _append_logprobs(self, req: Request, result, row: int, token: int) -> None:
        if req.params.logprobs is not None:
            k = req.params.logprobs
            entry = {int(t): float(lp) for t, lp in zip(result.top_ids[row, :k], result.top_logprobs[row, :k])}
            entry[token] = float(result.logprobs[row])
            req.output_logprobs.append(entry)

    def _advance_mask(self, seq: _Sequence, token: int) -> None:
        """Feeds the sampled token to the sequence's grammar; a finished grammar stops it."""
        accepted = seq.mask.accept(token)
        if seq.req.is_finished:
            return
        if not accepted:  # cannot happen with the mask applied; never emit past a broken grammar
            self.schedulers[seq.req.dp_rank].finish(seq.req, "stop")
        elif seq.mask.terminated:
            self.schedulers[seq.req.dp_rank].finish(seq.req, "stop")

    def _append_text(self, seq: _Sequence, token: int) -> None:
        """Adds the token's text; a stop string ends the sequence and is cut from the text."""
        before = len(seq.detok.text)
        seq.detok.add(token)
        stops = seq.req.params.stop_strings
        if not stops:
            return
        text = seq.detok.text
        lo = max(0, before - max(len(s) for s in stops) + 1)
        hits = [(pos, s) for s in stops if (pos := text.find(s, lo)) >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        seq.detok.text = text[:pos]
        if seq.req.is_finished:  # finished by length on the same token: the stop string wins
            seq.req.finish_reason, seq.req.stop_reason = "stop", stop
        else:
            self.schedulers[seq.req.dp_rank].finish(seq.req, "stop", stop)

    def _text(self, seq: _Sequence) -> str:
        req = seq.req
        if seq.detok is None:
            if not req.is_finished or self.tokenizer is None:
                return ""
            if not seq.text:
                seq.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            return seq.text
        text = seq.detok.text
        stops = req.params.stop_strings
        if stops and not req.is_finished:  # hold back what could be the start of a stop string
            text = text[:max(0, len(text) - max(len(s) for s in stops) + 1)]
        return text

    def _output(self, g: _Group) -> RequestOutput:
        want_logprobs = g.params.logprobs is not None
        outs = []
        for s in g.seqs:
            req, text = s.req, self._text(s)
            tokens, logprobs = req.output_token_ids, req.output_logprobs
            if self.output_deltas:
                text, tokens, logprobs = text[s.sent_chars:], tokens[s.sent_tokens:], logprobs[s.sent_tokens:]
                s.sent_chars, s.sent_tokens = s.sent_chars + len(text), len(req.output_token_ids)
            else:
                tokens, logprobs = list(tokens), list(logprobs)
            outs.append(CompletionOutput(s.index, text, tokens, req.finish_reason,
                                         logprobs if want_logprobs else None, req.stop_reason))
        prompt_lps = None
        if g.prompt_logprobs is not None and not (self.output_deltas and g.prompt_logprobs_sent) \
                and (g.finished or g.seqs[0].req.num_computed_tokens >= len(g.prompt_token_ids)):
            prompt_lps, g.prompt_logprobs_sent = list(g.prompt_logprobs), True
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.finished,
                             g.seqs[0].req.num_cached_tokens, prompt_lps)

    def _forget(self, seq: _Sequence) -> None:
        self.runner.release_penalty_slot(seq.req)
        if self.drafter is not None:
            self.drafter.release(seq.req)
        self._seq_of.pop(seq.req.request_id, None)
        self._group_of.pop(seq.req.request_id, None)

    # -- compile & stats ------------------------------------------------------------------
    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compiles the step for every bucket so that serving compiles nothing afterwards.

        background: compile the smallest bucket now and the others on a background thread;
        steps stay within the compiled buckets meanwhile (prompts take smaller chunks), so
        serving starts at once and never compiles on the request path."""
        if self.drafter is not None:  # the draft model's steps (small) compile first, here
            self.drafter.warmup()
        if background and not is_multiprocess():  # processes must agree on every step's size
            self.runner.start_background_warmup()
        else:
            self.runner.warmup(progress)

    def wait_for_warmup(self) -> None:
        """Blocks until a background warm-up has compiled every bucket."""
        self.runner.wait_for_warmup()

    def stats(self) -> dict:
        """Totals over the data-parallel ranks; "data_parallel_ranks" has each rank's own."""
        mem = self.kv_memory()
        ranks = [_rank_stats(p, s) for p, s in zip(self.pools, self.schedulers)]
        totals = {k: sum(r[k] for r in ranks) for k in ranks[0]}
        return {
            **totals,
            "block_size": self.pool.block_size,
            "num_compilations": compile_counter.num_compilations(),
            "num_compiled_shapes": len(self.runner.compiled_shapes),
            "num_step_shapes": len(self.buckets.token_buckets()),
            "warmup_done": self.runner.warmup_done and len(self.runner.compiled_shapes) == len(self.buckets.token_buckets()),
            "num_steps": self.num_steps,
            "num_generated_tokens": self.num_generated_tokens,
            "num_computed_prompt_tokens": self.num_computed_prompt_tokens,
            "spec_draft_tokens": self.num_draft_tokens,
            "spec_accepted_tokens": self.num_accepted_draft_tokens,
            "spec_acceptance_rate": self.num_accepted_draft_tokens / max(self.num_draft_tokens, 1),
            # tokens a request gets from a step that verifies drafts (1 without speculation)
            "spec_mean_tokens_per_step": 1 + self.num_accepted_draft_tokens / max(self.num_verify_steps, 1),
            "kv_cache": self.config.kv_cache,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            **{f"kv_tokens_{k}": v for k, v in asdict(mem).items() if k != "num_requests"},
            "kv_utilization": mem.utilization,
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "data_parallel_size": self.config.data_parallel_size,
            "weight_bytes_per_device": self.weight_bytes_per_device,
            "kv_pool_bytes_per_device": self.kv_pool_bytes_per_device,
            "data_parallel_ranks": ranks,
        }

    def kv_memory(self) -> KVMemory:
        """KV memory accounting from the block pools' state now (see pagedjax.core.kv_memory), summed
        over the data-parallel ranks."""
        budget = self.kv_budget_tokens
        each = [kv_memory(p, s.running, self.max_model_len, budget) for p, s in zip(self.pools, self.schedulers)]
        return KVMemory(**{f.name: sum(getattr(m, f.name) for m in each) for f in fields(KVMemory)})


def _rank_stats(pool: BlockPool, s: Scheduler) -> dict:
    return {
        "kv_blocks_total": pool.num_blocks,
        "kv_blocks_free": pool.num_free,
        "kv_blocks_cached": pool.num_cached,
        "num_requests_running": len(s.running),
        "num_requests_waiting": len(s.waiting),
        "prefix_cache_query_tokens": s.prefix_cache_query_tokens,
        "prefix_cache_hit_tokens": s.prefix_cache_hit_tokens,
        "num_preemptions": s.num_preemptions,
        "num_forks": s.num_forks,
        "num_cow_copies": pool.num_cow_copies,
    }


def _model_name(model) -> str:
    from pathlib import Path

    return "SmolLM2-135M-Instruct" if model is None else Path(str(model)).name


def _tokenizer_eos(tokenizer) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)
