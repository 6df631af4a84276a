"""SpecDecodeManager: the engine's one object for speculative decoding (None when off).

Before a step it proposes drafts for the requests about to decode (prompt lookup, or a
draft model at a depth that pays, `draft_depth`); the scheduler asks it how many of them
each request verifies (`allocate`, weighing the measured step costs); after the step it
counts what the sampler accepted (`emitted`) and records what the step cost.
"""
from __future__ import annotations

import time

import numpy as np

from pagedjax.core.buckets import Buckets
from pagedjax.core.request import Request
from pagedjax.spec_decode import ngram
from pagedjax.spec_decode.config import SpeculativeConfig
from pagedjax.spec_decode.policy import MeasuredCosts, acceptance_estimate, allocate_drafts, draft_depth

# a draft model that does not pay drafts once after this many steps (its acceptance and cost
# move), then after twice as many each time it still does not pay, up to DRAFT_PROBE_MAX
DRAFT_PROBE_INTERVAL, DRAFT_PROBE_MAX = 16, 512


class SpecDecodeManager:
    def __init__(self, config: SpeculativeConfig, buckets: Buckets, max_model_len: int, drafter=None):
        """drafter: a DraftModelProposer (method "draft_model"), None for prompt lookup."""
        self.config = config
        self.buckets = buckets
        self.max_model_len = max_model_len
        self.drafter = drafter
        self.num_draft_tokens = 0  # drafts verified, accepted, request-steps that verified
        self.num_accepted_draft_tokens = 0
        self.num_verify_steps = 0
        # of those, drafts past the k-th of their request (idle rows: `allocate`), and accepted
        self.num_idle_draft_tokens = 0
        self.num_accepted_idle_draft_tokens = 0
        # the cost model: wall seconds of a step by T, of a draft model's proposal by depth
        self.step_costs = MeasuredCosts(float)
        self.draft_costs = MeasuredCosts(lambda depth: 0.0)
        self._steps_without_drafts = 0  # consecutive steps a draft model did not draft
        self._drafted_last_step = False
        self._probe_interval = DRAFT_PROBE_INTERVAL

    # -- before the step ------------------------------------------------------------------
    def propose(self, schedulers) -> None:
        """Drafts (prompt lookup, or the draft model) for every running request about to
        decode (not for beams, nor for requests whose penalties or token masks depend on each
        token before it)."""
        wanted, rows = [], 0
        for sched in schedulers:
            rank = 0  # decoding requests of this data-parallel rank
            for req in sched.running:
                p = req.params
                req.draft_token_ids = []
                if (req.num_tokens - req.num_computed_tokens == 1 and req.output_token_ids and req.beam_group is None
                        and not p.uses_penalties and not p.uses_token_mask):
                    wanted.append(req)
                    rank += 1
            rows = max(rows, rank)
        if self.drafter is None:
            c = self.config
            for req in wanted:
                # up to idle_speculative_tokens: the drafts past k go only in rows a step pads anyway
                req.draft_token_ids = ngram.propose(np.asarray(req.all_token_ids), c.proposal_depth,
                                                    c.prompt_lookup_min, c.prompt_lookup_max)
            return
        running = {id(req) for sched in schedulers for req in sched.running}
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
            self.draft_costs.add(depth, time.perf_counter() - began)
        self._drafted_last_step = True

    def _draft_depth(self, wanted: list[Request], rows: int) -> int:
        """Drafts per request the draft model proposes this step (policy.draft_depth; rows:
        the decoding requests of the largest data-parallel rank): 0 while it costs more than
        its accepted drafts save, but 1 now and then (after DRAFT_PROBE_INTERVAL steps, then
        ever fewer), so that its acceptance and cost stay measured. Always
        num_speculative_tokens with "adaptive": False."""
        if not wanted:
            return 0
        if not self.config.adaptive:
            return self.config.num_speculative_tokens
        rates = [acceptance_estimate(r.num_accepted_drafts, r.num_drafted) for r in wanted]
        room = min(self.buckets.max_draft_tokens, self.buckets.max_num_batched_tokens - rows)
        target = lambda t: self.step_costs(self.buckets.token_bucket(t))
        depth = draft_depth(rates, self.config.num_speculative_tokens, target, self.draft_costs, rows, room)
        if depth == 0:
            self._steps_without_drafts += 1
            if self._steps_without_drafts < self._probe_interval:
                return 0
            depth, self._probe_interval = 1, min(2 * self._probe_interval, DRAFT_PROBE_MAX)
        else:
            self._probe_interval = DRAFT_PROBE_INTERVAL
        self._steps_without_drafts = 0
        return depth

    def allocate(self, decode: list[Request], num_tokens: int, budget: int) -> list[int]:
        """Drafts each decoding request verifies this step (policy.allocate_drafts), within
        its limits (max_tokens, max_model_len); the scheduler readies their blocks. Up to k
        drafts each are weighed against the step costs; the drafts a request has beyond k
        (prompt lookup's idle_speculative_tokens) fill only the rows that the step's rung
        would pad anyway."""
        k = self.config.num_speculative_tokens
        idle_caps = [max(0, min(len(r.draft_token_ids), self.max_model_len - r.num_computed_tokens - 1,
                                r.params.max_tokens - len(r.output_token_ids) - 1)) for r in decode]
        caps = [min(c, k) for c in idle_caps]
        rates = [acceptance_estimate(r.num_accepted_drafts, r.num_drafted) for r in decode]
        return allocate_drafts(caps, rates, num_tokens, self.buckets.token_buckets(), budget,
                               self.buckets.max_draft_tokens, self.step_costs,
                               idle_caps if idle_caps != caps else None)

    # -- after the step -------------------------------------------------------------------
    def emitted(self, result, out, i: int, row: int) -> list[int]:
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
        k = self.config.num_speculative_tokens
        self.num_idle_draft_tokens += max(0, n - k)
        self.num_accepted_idle_draft_tokens += max(0, len(tokens) - 1 - k)
        req = out.requests[i]
        req.num_drafted += n
        req.num_accepted_drafts += len(tokens) - 1
        self.num_verify_steps += 1
        return tokens

    def record_step(self, pending) -> None:
        """What a step of its size cost (not its first run: compiling or loading)."""
        if not pending.first_run:
            self.step_costs.add(pending.t, time.perf_counter() - pending.began)

    def release(self, req: Request) -> None:
        if self.drafter is not None:
            self.drafter.release(req)



def spec_stats(spec: SpecDecodeManager | None) -> dict:
    """The speculation counters of LLMEngine.stats() (zeros, and 1 token a step, when off)."""
    drafted, accepted, steps = ((spec.num_draft_tokens, spec.num_accepted_draft_tokens, spec.num_verify_steps)
                                if spec is not None else (0, 0, 0))
    return {
        "spec_draft_tokens": drafted,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / max(drafted, 1),
        # tokens a request gets from a step that verifies drafts (1 without speculation)
        "spec_mean_tokens_per_step": 1 + accepted / max(steps, 1),
    }


def make_spec_decode(cfg, buckets: Buckets, plan, draft=None) -> SpecDecodeManager | None:
    """The engine's SpecDecodeManager for cfg.speculative_config (None: off). draft: the
    loaded DraftModel (method "draft_model"); plan: the engine's KVPlan, whose pool the
    draft model's own pool mirrors."""
    spec = cfg.speculative_config
    if spec is None:
        return None
    drafter = None
    if draft is not None:
        from pagedjax.spec_decode.draft_model import DRAFT_BLOCK_SIZE, DraftModelProposer

        # room for every token the target's pools hold plus k + 1 for each sequence; a step of
        # the draft fits every sequence of every rank
        k = spec.num_speculative_tokens
        seqs = plan.max_num_seqs * cfg.data_parallel_size
        tokens = cfg.num_blocks * plan.block_size * cfg.data_parallel_size + seqs * (k + 1)
        drafter = DraftModelProposer(
            draft, max_num_seqs=seqs, max_model_len=cfg.max_model_len,
            max_num_batched_tokens=max(cfg.max_num_batched_tokens, seqs),
            num_blocks=-(-tokens // DRAFT_BLOCK_SIZE) + seqs, attention_impl=cfg.attention_impl)
    return SpecDecodeManager(spec, buckets, cfg.max_model_len, drafter)
