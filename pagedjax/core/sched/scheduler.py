"""Continuous batching over the block pool (host side, no JAX).

Each call to `schedule()` builds one packed step: first a decode token for every running
request with one token to go (preempting the newest requests if the pool runs short), then,
in the same step, prompt chunks of partly prefilled and waiting requests (prefix-cache hits
skipped) within the token budget, so a long prompt never stalls the running requests. A
request takes any number of tokens in a step, and appears in it at most once.
`update()` folds the sampled tokens back in; finished requests return their blocks at once.

Waiting requests are admitted in order, with two exceptions. A request whose next uncached
prompt block a running request is computing right now waits for it (and hits it once it is
cached) instead of computing it too, so a prompt shared by requests arriving together is
computed once. A request that does not fit (seats or blocks) lets later ones that fit go
first, at most max_num_seqs of them; then the queue waits for it. A preempted request that
does not fit is never passed.
"""
from __future__ import annotations

from collections import deque

from pagedjax.core.block_pool import BlockPool
from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request, RequestStatus
from pagedjax.core.sched.output import SchedulerOutput
from pagedjax.core.sched.prefix_cache import PrefixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, pool: BlockPool, buckets: Buckets, max_model_len: int):
        self.pool = pool
        self.buckets = buckets
        self.token_budget = buckets.max_num_batched_tokens  # tokens per step; the engine may lower it
        # speculative decoding's SpecDecodeManager (None when off): how many drafts each request verifies
        self.draft_policy = None
        # LoRA's LoRAManager (None when off): admit(req) -> whether req's adapter has a device slot now
        # (no I/O: the request carries its adapter's host copy)
        self.lora = None
        # sliding-window models: a WindowBlockRelease that frees blocks no query reads again (None: off)
        self.window = None
        # the host KV tier's KVOffloadPolicy (core/kv_offload.py; None when off): evicted prefix blocks
        # saved below the device pool, host hits loaded back
        self.offload = None
        self.max_model_len = max_model_len
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self.num_forks = 0
        self._copies: list[tuple[int, int]] = []  # copy-on-write copies for the step being built
        self._loads: list[tuple[bytes, int]] = []  # host tier -> device (key, block) for the step being built
        self.prefix = PrefixCache(pool)  # prefix-cache lookups and the blocks running requests are computing

    # -- queue management -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        n = req.num_prompt_tokens
        if req.pooling is not None and n > self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len} "
                             f"(an embedding's prompt may have at most max_model_len tokens)")
        if req.pooling is None and n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, "
                             f"which leaves no room to generate (prompt must be shorter than max_model_len)")
        need = cdiv(min(n + req.params.max_tokens, self.max_model_len), self.block_size)
        if self.window is not None:  # blocks outside the window go back as it moves on
            need = min(need, self.window.max_blocks_held(self.buckets.max_num_batched_tokens))
        if need > self.pool.num_blocks:
            fix = ("raise num_blocks or lower max_num_batched_tokens (a sliding-window request holds its window "
                   "and one step's tokens)" if self.window is not None else "raise num_blocks or lower max_tokens")
            raise ValueError(f"request needs up to {need} KV blocks but the pool has only {self.pool.num_blocks}; "
                             f"{fix}")
        if 1 + req.reserved_seats > self.buckets.max_num_seqs:
            raise ValueError(f"request needs {1 + req.reserved_seats} sequences at once (n or beam width) "
                             f"but max_num_seqs is {self.buckets.max_num_seqs}")
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends a request now (stop, length or abort) and returns its blocks to the pool."""
        if req.is_finished:
            return
        for child in req.pending_forks:  # never started: they end with their parent
            child.status, child.finish_reason = RequestStatus.FINISHED, reason
        req.pending_forks = []
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.prefix.release(req)
        if self.offload is not None:  # its swapped-out blocks, if any
            self.offload.forget(req)
        self.pool.free(req.held_block_ids[::-1])
        req.block_ids, req.num_released_blocks = [], 0
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self, hold: frozenset = frozenset()) -> SchedulerOutput | None:
        """hold: running requests to leave out of this step (async scheduling: they finish
        once the step in flight is read back)."""
        self._copies, self._loads = [], []
        if self.offload is not None:
            self.offload.begin()
        if self.window is not None:
            for req in self.running:
                self.window.release(req, self.pool)
        budget = min(self.token_budget, self.buckets.max_num_batched_tokens)
        decode = self._schedule_decode(budget, hold)
        reqs, starts, q_lens = self._schedule_prefill(budget - len(decode))
        if not decode and not reqs:
            return None
        if q_lens and (cut := self._trim_to_rung(len(decode) + sum(q_lens), q_lens[-1])):
            q_lens[-1] -= cut
            self._release_tail(reqs[-1], starts[-1] + q_lens[-1])
        drafts = self._schedule_drafts(decode, len(decode) + sum(q_lens), budget)
        if not any(drafts):
            out = SchedulerOutput(decode + reqs, [r.num_computed_tokens for r in decode] + starts,
                                  [1] * len(decode) + q_lens, len(decode), self._copies, [])
        else:
            out = SchedulerOutput(decode + reqs, [r.num_computed_tokens for r in decode] + starts,
                                  [1 + len(d) for d in drafts] + q_lens, len(decode), self._copies,
                                  drafts + [[]] * len(reqs))
        if self.offload is not None:  # evicted blocks saved, then host hits loaded, before the step
            out.saves, out.loads, out.writes = self.offload.take_saves(), self._loads, self.offload.take_writes()
        return out

    def _release_tail(self, req: Request, end: int) -> None:
        """Returns req's blocks past token position `end` to the pool (allocated for tokens
        that a trim moved to a later step): a step holds no block it does not write."""
        keep = cdiv(end, self.block_size)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:][::-1])
            del req.block_ids[keep:]

    def _trim_to_rung(self, total: int, last_chunk: int) -> int:
        """Tokens to cut from the step's last prompt chunk so that the step fills the rung
        below instead of padding the rung above: when the cut is no larger than the padding
        it saves (the cut tokens simply run in the next step). 0 when not worth it."""
        rungs = self.buckets.token_buckets()
        up = next((t for t in rungs if t >= total), None)
        below = [t for t in rungs if t < total]
        if up is None or not below:
            return 0
        cut = total - below[-1]
        return cut if cut <= up - total and cut < last_chunk else 0

    def _schedule_prefill(self, budget: int) -> tuple[list[Request], list[int], list[int]]:
        """Prompt chunks of partly prefilled, then waiting requests, in order, while the step
        has tokens left in `budget`."""
        reqs, starts, q_lens = [], [], []
        partial = [r for r in self.running if len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens > 1]
        for req in partial:
            q = min(req.num_tokens - req.num_computed_tokens, budget)
            if q <= 0 or not self._grow(req, req.num_computed_tokens, q):
                break
            reqs.append(req), starts.append(req.num_computed_tokens), q_lens.append(q)
            budget -= q
        self._admit_waiting(budget, reqs, starts, q_lens)
        return reqs, starts, q_lens

    def _admit_waiting(self, budget: int, reqs: list[Request], starts: list[int], q_lens: list[int]) -> None:
        """Admits waiting requests in queue order while the step has tokens and seats left,
        appending their first chunks to reqs, starts, q_lens. Two kinds stay queued while
        later ones are still considered: one whose next prompt block another request is
        computing now (it hits that block at a later step), and one that does not fit (seats
        or blocks), until max_num_seqs later requests have gone first; then the queue stops at
        it, as it always does at a preempted request that does not fit. At most max_num_seqs
        requests stay queued per step (bounds the look-ahead)."""
        max_seqs = self.buckets.max_num_seqs
        seats = self.num_seats_taken()
        skipped: list[Request] = []  # left waiting this step, in queue order
        passed: list[Request] = []  # those of them that did not fit: admissions behind them pass them
        while self.waiting and budget > 0 and seats < max_seqs and len(skipped) < max_seqs:
            req = self.waiting[0]
            fits = seats + 1 + req.reserved_seats <= max_seqs  # room for it and the sequences it will fork
            if fits:
                hits, next_key = self.prefix.match(req)
                # a swapped-out preempted request: its blocks on the host after the device hits
                resume = self.offload.resume(req, len(hits)) if self.offload is not None else None
                if resume == "wait" or (resume is None and next_key is not None
                                        and self.prefix.in_flight(next_key, req)):
                    skipped.append(self.waiting.popleft())
                    continue
                if resume is not None:
                    host, start = resume
                else:  # the host and disk tiers' blocks after the device hits
                    host = self.offload.match(req, len(hits), next_key) \
                        if self.offload is not None and next_key is not None else []
                    start = (len(hits) + len(host)) * self.block_size
                # sliding-window models: hits (device, host, disk; a swap's are all loaded) no query of
                # req will read are not taken (stay released) or loaded
                skip = min(self.window.num_outside(start), len(hits) + (len(host) if resume is None else 0)) \
                    if self.window is not None else 0
                q = min(req.num_tokens - start, budget)
                need = cdiv(start + q, self.block_size) - max(len(hits), skip)
                fits = need <= self.pool.num_free - sum(self.pool.ref_counts[b] == 0 for b in hits[skip:])
                fits = fits and (self.lora is None or self.lora.admit(req))
            if not fits:
                if req.status is RequestStatus.PREEMPTED or req.num_passed >= max_seqs:
                    break
                skipped.append(self.waiting.popleft())
                passed.append(req)
                continue
            for b in hits[skip:]:
                self.pool.take(b)
            fresh = self.pool.allocate(need)  # host blocks outside the window: stale entries (never read)
            req.block_ids, req.num_released_blocks = hits + fresh[:1] * max(0, skip - len(hits)) + fresh, skip
            req.block_hashes = req.block_hashes[:len(hits)]
            if host or resume is not None:  # their fresh blocks are loaded before the step
                self.offload.admit(req, len(hits), host, self._loads, skip)
            req.num_computed_tokens = start
            req.num_shared_kv_tokens = 0
            if req.status is RequestStatus.WAITING:  # first admission (not a resumed preemption)
                req.num_cached_tokens = start  # device and host tiers
                self.prefix_cache_query_tokens += req.num_prompt_tokens
                self.prefix_cache_hit_tokens += len(hits) * self.block_size  # the device's (host: the policy's)
            req.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(req)
            self.prefix.register(req)
            seats += 1 + req.reserved_seats
            for r in passed:
                r.num_passed += 1
            reqs.append(req), starts.append(start), q_lens.append(q)
            budget -= q
        self.waiting.extendleft(reversed(skipped))

    def _schedule_decode(self, budget: int, hold: frozenset = frozenset()) -> list[Request]:
        """Running requests with exactly one token to go, their next slot ready (at most
        `budget` of them), except those in `hold`."""
        decode, i = [], 0
        bs, ref_counts = self.block_size, self.pool.ref_counts
        while i < len(self.running) and len(decode) < budget:
            req = self.running[i]
            start = req.num_computed_tokens
            if len(req.prompt_token_ids) + len(req.output_token_ids) - start != 1 or (hold and req in hold):
                i += 1
            elif (start // bs < len(req.block_ids) and  # _grow's no-op: its block is there, not shared (or not written)
                  (start < req.num_shared_kv_tokens or ref_counts[req.block_ids[start // bs]] < 2)):
                decode.append(req)
                i += 1
            elif self._grow(req, start, 1):
                decode.append(req)
                i += 1
            else:  # the newest running request gives way (possibly req itself)
                self._preempt(self.running[-1])
        return decode

    def _schedule_drafts(self, decode: list[Request], num_tokens: int, budget: int) -> list[list[int]]:
        """The draft tokens each decoding request verifies after its token (speculative
        decoding; see SpecDecodeManager.allocate): their blocks readied, never at the cost
        of a preemption. [] when none of them has drafts."""
        if self.draft_policy is None or not any(r.draft_token_ids for r in decode):
            return []
        drafts = []
        for req, n in zip(decode, self.draft_policy.allocate(decode, num_tokens, budget)):
            ok = n and self._grow(req, req.num_computed_tokens, 1 + n)
            drafts.append(req.draft_token_ids[:n] if ok else [])
        return drafts

    def num_seats_taken(self) -> int:
        """Running sequences plus the seats they hold for sequences they will fork."""
        return len(self.running) + sum(r.reserved_seats for r in self.running)

    def _grow(self, req: Request, start: int, q: int) -> bool:
        """Readies req's blocks for writing positions [start, start + q): allocates the blocks
        they need and copies a shared block about to be written (copy-on-write, only that
        block). False, with nothing changed, if the pool is short."""
        need = cdiv(start + q, self.block_size) - len(req.block_ids)
        write_start = max(start, req.num_shared_kv_tokens)  # KV below it is already there
        first = write_start // self.block_size  # the only block written here that may be shared
        cow = (write_start < start + q and first < len(req.block_ids)
               and self.pool.ref_counts[req.block_ids[first]] > 1)
        if max(need, 0) + cow > self.pool.num_free:
            return False
        if cow:
            src = req.block_ids[first]
            req.block_ids[first] = self.pool.copy_on_write(src)
            self._copies.append((src, req.block_ids[first]))
        if need > 0:
            req.block_ids += self.pool.allocate(need)
        return True

    def fork(self, parent: Request, child: Request, shared_kv_tokens: int | None = None) -> None:
        """Starts `child` as a copy of `parent` that shares all its blocks (reference counts
        up); whichever writes a shared block first copies it then."""
        for b in parent.held_block_ids:
            self.pool.take(b)
        child.block_ids, child.num_released_blocks = list(parent.block_ids), parent.num_released_blocks
        child.dp_rank = parent.dp_rank  # its blocks live in the parent's pool
        child.lora_slot = parent.lora_slot
        child.block_hashes = list(parent.block_hashes)
        child.output_token_ids = list(parent.output_token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.num_shared_kv_tokens = parent.num_computed_tokens if shared_kv_tokens is None else shared_kv_tokens
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self.num_forks += 1

    def _preempt(self, req: Request) -> None:
        """Frees a running request's blocks; it is recomputed later (its prefix may be cached),
        or, swapped out to the host tier where it has room, loaded back."""
        self.running.remove(req)
        self.prefix.release(req)
        swapped = self.offload is not None and self.offload.swap_out(req)  # gathered before the step
        self.pool.free(req.held_block_ids[::-1])
        req.block_ids, req.num_released_blocks = [], 0
        req.draft_token_ids = []
        if not swapped:
            req.num_computed_tokens = 0
        req.num_shared_kv_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def num_cached_prefix_blocks(self, req: Request) -> int:
        """Leading blocks of req this pool has cached now (nothing taken)."""
        return len(self.prefix.match(req)[0])

    def load(self) -> int:
        """Sequences running or waiting here, with the seats they hold for forks."""
        return self.num_seats_taken() + sum(1 + r.reserved_seats for r in self.waiting)

    # -- after the step -------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[list[int]]) -> list[tuple[Request, int, list[int] | None]]:
        """Advances counters; returns (request, its index in out.requests, new tokens) for
        requests that completed their pending tokens (partial prefill chunks produce none; a
        prefill-only request, max_tokens=0 or an embedding, finishes with None), for the caller
        to append: the engine's OutputProcessor is the one writer of output tokens. sampled:
        each entry's tokens, one, or with drafts the accepted drafts plus one (only the verified
        positions count as computed; blocks past them go back to the pool)."""
        produced = []
        prefix, bs = self.prefix, self.block_size
        caching = self.pool.enable_prefix_caching
        finished = RequestStatus.FINISHED
        for i, (req, q, tokens) in enumerate(zip(out.requests, out.q_lens, sampled)):
            if req.status is finished:  # async scheduling: it ended (stop, abort) while this step ran
                continue
            n_drafts = len(out.drafts[i]) if out.drafts else 0
            req.num_computed_tokens += q - n_drafts + len(tokens) - 1
            if n_drafts:
                self._release_tail(req, req.num_computed_tokens)
            if caching and req.num_computed_tokens // bs > len(req.block_hashes):  # a block completed
                prefix.cache_full_blocks(req)
            if req.num_computed_tokens < len(req.prompt_token_ids) + len(req.output_token_ids):
                continue
            if prefix.inflight_keys:
                prefix.release(req)  # nothing left to compute: its blocks are cached
            if req.prefill_only:  # scoring a prompt or an embedding: nothing to generate
                self.finish(req, "length")
                produced.append((req, i, None))
                continue
            if req.pending_forks:  # n > 1: the prompt is computed; siblings share its blocks
                self._fork_siblings(req)
            produced.append((req, i, tokens))  # the engine's OutputProcessor appends the tokens
        return produced

    def _fork_siblings(self, parent: Request) -> None:
        """Each sibling re-runs only the last prompt position (its KV already present, not
        written again) to sample its own first token from its own seed."""
        for child in parent.pending_forks:
            self.fork(parent, child, shared_kv_tokens=parent.num_computed_tokens)
            child.num_computed_tokens -= 1
        parent.pending_forks, parent.reserved_seats = [], 0

    def check_stop(self, req: Request, token: int, num_output: int | None = None) -> None:
        """Finishes req if `token` ends it (EOS, stop token, max_tokens, max_model_len).
        num_output: output tokens up to and including `token` (default: all of them; a
        step with drafts appends several and checks them one by one)."""
        p = req.params
        if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
            return self.finish(req, "stop", token)
        n = len(req.output_token_ids) if num_output is None else num_output
        if n >= p.max_tokens or req.num_prompt_tokens + n >= self.max_model_len:
            self.finish(req, "length")
