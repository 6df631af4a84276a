"""The host side of a step: the scheduled requests' tokens laid end to end in numpy, padded
to the step's bucket (see core/buckets.py), with their positions, KV slots, block tables,
the rows to sample and each row's sampling settings. No JAX runs here."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import numpy as np

from pagedjax.models.kv_cache import AttentionMetadata
from pagedjax.core.buckets import Buckets
from pagedjax.core.sched.output import SchedulerOutput
from pagedjax.sample import prompt_logprobs
from pagedjax.sample.sampler import SamplingInputs
from pagedjax.sample.token_mask import mask_needed


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StepInputs:
    """The model inputs of one packed step."""

    tokens: jax.Array  # [T] int32
    md: AttentionMetadata
    logits_indices: jax.Array  # [dp * S] int32: each sequence's last token within its rank's T (sampled)
    prompt_next: jax.Array  # [T] int32: the prompt token after each position, -1: no prompt logprobs asked
    prev_rows: jax.Array  # [T] int32: the previous step's sampled row whose token goes here (not yet on the host), -1: none
    lora_slots: jax.Array | None = None  # [T] int32: each token's LoRA slot (0: the base model); None: LoRA off


class InputBatch:
    """Builds the numpy inputs of each step for one runner's buckets and KV cache."""

    def __init__(self, buckets: Buckets, block_size: int, max_blocks_per_seq: int, num_blocks: int, penalty_slot,
                 step_rung=None, lora: bool = False):
        """penalty_slot(rank, req) -> the request's penalty slot on its rank (loaded before
        the sampler runs when new); step_rung(num_tokens) -> T of a step of that many tokens
        (default: the smallest rung holding it; the runner's keeps to compiled rungs while a
        background warm-up runs); lora: fill each token's LoRA slot (`Request.lora_slot`)."""
        self.buckets = buckets
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.num_blocks = num_blocks  # a copy-on-write entry with dst = num_blocks is padding
        self.penalty_slot = penalty_slot
        self.step_rung = step_rung or buckets.token_bucket
        self.lora = lora

    def step_shape(self, outs: list[SchedulerOutput | None]) -> tuple[int, int]:
        """(T, S) of the step running `outs` (one entry per data rank, None: idle): the rung
        of the busiest rank (`step_rung`); every rank gets T token and S sequence rows."""
        t = self.step_rung(max(sum(out.q_lens) for out in outs if out is not None))
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
        lora_slots = np.zeros(dp * t, np.int32) if self.lora else None
        sampling = SamplingArrays(dp * r)
        c = self.buckets.max_num_seqs  # copies per rank: at most one per sequence row
        src, dst = np.zeros(dp * c, np.int32), np.full(dp * c, self.num_blocks, np.int32)
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
                if lora_slots is not None:
                    lora_slots[t0 + off:t0 + off + ql] = req.lora_slot
                off += ql
                if req.params.prompt_logprobs is not None and start < req.num_prompt_tokens:
                    prompt_next[t0 + off - ql:t0 + off] = prompt_logprobs.next_tokens(req.prompt_token_ids, start, ql,
                                                                                            req.prompt_logprobs_from)
                kv_lens[row], cu[c0 + i + 1] = start + ql, off
                # the sequence's last token (with drafts: each of its positions), among its rank's tokens
                n = len(drafts) + 1
                logits_indices[sample_row:sample_row + n] = np.arange(off - n, off)
                slot = self.penalty_slot(rank, req) if req.params.uses_penalties else -1
                for j in range(n):
                    sampling.fill(sample_row + j, req, produces=start + ql >= req.num_tokens, slot=slot, offset=j,
                                  draft_next=drafts[j] if j < n - 1 else -1)
                sample_row += n
            cu[c0 + len(out.requests) + 1:c0 + s + 1] = off
            if out.copies:
                n = len(out.copies)
                src[rank * c:rank * c + n], dst[rank * c:rank * c + n] = zip(*out.copies)
        md = AttentionMetadata(positions, slots, tables, kv_lens, cu)
        return t, StepInputs(tokens, md, logits_indices, prompt_next, prev_rows, lora_slots), sampling.inputs(), (src, dst)


class SamplingArrays:
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
