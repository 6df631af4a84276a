"""Continuous batching over the block pool (host side, no JAX).

Each call to `schedule()` picks one step: a prefill step (prompt chunks of waiting or
partly prefilled requests, prefix-cache hits skipped) when there is prompt work and room,
else a decode step for every running request. `update()` folds the sampled tokens back in,
finishes requests and returns their blocks to the pool at once.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from pagedjax.block_pool import BlockPool, hash_block
from pagedjax.buckets import Buckets
from pagedjax.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work: request i computes tokens [start_i, start_i + q_lens[i])."""

    is_prefill: bool
    requests: list[Request]
    starts: list[int]
    q_lens: list[int]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, pool: BlockPool, buckets: Buckets, max_model_len: int):
        self.pool = pool
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.block_size = pool.block_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0

    # -- queue management -----------------------------------------------------------------
    def add(self, req: Request) -> None:
        n = req.num_prompt_tokens
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, "
                             f"which leaves no room to generate (prompt must be shorter than max_model_len)")
        need = cdiv(min(n + req.params.max_tokens, self.max_model_len), self.block_size)
        if need > self.pool.num_blocks:
            raise ValueError(f"request needs up to {need} KV blocks but the pool has only {self.pool.num_blocks}; "
                             f"raise num_blocks or lower max_tokens")
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None) -> None:
        """Ends a request now (stop, length or abort) and returns its blocks to the pool."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.status = RequestStatus.FINISHED
        req.finish_reason, req.stop_reason = reason, stop_reason

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput | None:
        out = self._schedule_prefill()
        if out is None and self.running:
            out = self._schedule_decode()
        return out

    def _schedule_prefill(self) -> SchedulerOutput | None:
        reqs, starts, q_lens = [], [], []
        max_q_chunk = self.buckets.max_prefill_q
        partial = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for req in partial:
            q = min(req.num_tokens - req.num_computed_tokens, max_q_chunk)
            if not self._fits(len(reqs) + 1, max(q_lens + [q])) or not self._grow(req, req.num_computed_tokens + q):
                break
            reqs.append(req), starts.append(req.num_computed_tokens), q_lens.append(q)
        while self.waiting and len(self.running) < self.buckets.max_num_seqs:
            req = self.waiting[0]
            hits = self._match_prefix(req)
            start = len(hits) * self.block_size
            q = min(req.num_tokens - start, max_q_chunk)
            if not self._fits(len(reqs) + 1, max(q_lens + [q])):
                break
            need = cdiv(start + q, self.block_size) - len(hits)
            if need > self.pool.num_free - sum(self.pool.ref_counts[b] == 0 for b in hits):
                break
            for b in hits:
                self.pool.take(b)
            req.block_ids = hits + self.pool.allocate(need)
            req.block_hashes = req.block_hashes[:len(hits)]
            req.num_computed_tokens = start
            if req.status is RequestStatus.WAITING:  # first admission (not a resumed preemption)
                req.num_cached_tokens = start
                self.prefix_cache_query_tokens += req.num_prompt_tokens
                self.prefix_cache_hit_tokens += start
            req.status = RequestStatus.RUNNING
            self.waiting.popleft()
            self.running.append(req)
            reqs.append(req), starts.append(start), q_lens.append(q)
        return SchedulerOutput(True, reqs, starts, q_lens) if reqs else None

    def _schedule_decode(self) -> SchedulerOutput:
        i = 0
        while i < len(self.running):
            req = self.running[i]
            if self._grow(req, req.num_tokens):
                i += 1
                continue
            victim = self.running[-1]  # newest running request gives way
            self._preempt(victim)
            if victim is req:
                continue
        reqs = list(self.running)
        return SchedulerOutput(False, reqs, [r.num_computed_tokens for r in reqs], [1] * len(reqs))

    def _fits(self, num_seqs: int, max_q: int) -> bool:
        return self.buckets.prefill_fits(num_seqs, max_q)

    def _grow(self, req: Request, num_tokens: int) -> bool:
        """Makes req's blocks cover num_tokens tokens; False if the pool is short."""
        need = cdiv(num_tokens, self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.pool.num_free:
            return False
        req.block_ids += self.pool.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        """Frees a running request's blocks; it is recomputed later (its prefix may be cached)."""
        self.running.remove(req)
        self.pool.free(req.block_ids[::-1])
        req.block_ids = []
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _match_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering req's leading full blocks (at least one token left to compute)."""
        if not self.pool.enable_prefix_caching:
            return []
        hits, parent = [], None
        for i in range((req.num_tokens - 1) // self.block_size):
            tokens = tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = req.block_hashes[i] if i < len(req.block_hashes) else hash_block(parent, tokens)
            block = self.pool.lookup(h, tokens)
            if block is None:
                break
            if i >= len(req.block_hashes):
                req.block_hashes.append(h)
            hits.append(block)
            parent = h
        return hits

    # -- after the step -------------------------------------------------------------------
    def update(self, out: SchedulerOutput, sampled: list[int]) -> list[tuple[Request, int]]:
        """Advances counters; returns (request, new token) for requests that completed their
        pending tokens this step (partial prefill chunks produce no token)."""
        produced = []
        for req, q, token in zip(out.requests, out.q_lens, sampled):
            req.num_computed_tokens += q
            self._cache_full_blocks(req)
            if req.num_computed_tokens < req.num_tokens:
                continue
            req.output_token_ids.append(token)
            produced.append((req, token))
        return produced

    def _cache_full_blocks(self, req: Request) -> None:
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        tokens = None
        for i in range(len(req.block_hashes), req.num_computed_tokens // bs):
            tokens = tokens or req.all_token_ids
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = hash_block(req.block_hashes[-1] if req.block_hashes else None, chunk)
            req.block_hashes.append(h)
            self.pool.cache_block(req.block_ids[i], h, chunk)

    def check_stop(self, req: Request, token: int) -> None:
        """Finishes req if `token` ends it (EOS, stop token, max_tokens, max_model_len)."""
        p = req.params
        if (not p.ignore_eos and token in req.eos_token_ids) or token in p.stop_token_ids:
            return self.finish(req, "stop", token)
        if len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            self.finish(req, "length")
