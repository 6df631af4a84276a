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
from pagedjax.worker.request_rows import RequestRows


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
        # decode rows' block tables and sampling settings kept between steps (room for two steps' sequences)
        self.request_rows = RequestRows(2 * buckets.max_num_seqs, max_blocks_per_seq)
        self.vectorize_from = 8  # decode entries of a rank packed vectorized from this many on (fewer: one by one is faster)

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
            # its decode entries (one token each, no drafts) packed vectorized, the rest one by one
            nd = 0 if out.drafts or out.num_decode < self.vectorize_from else out.num_decode
            if nd:
                self._pack_decode(out.requests[:nd], out.starts[:nd], rank, t0, s0, c0, rank * r, tokens, positions,
                                  slots, tables, kv_lens, cu, logits_indices, prompt_next, prev_rows, lora_slots,
                                  sampling)
            off, sample_row = nd, rank * r + nd
            for i in range(nd, len(out.requests)):
                req, start, ql = out.requests[i], out.starts[i], out.q_lens[i]
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

    def _pack_decode(self, reqs, starts, rank, t0, s0, c0, r0, tokens, positions, slots, tables, kv_lens, cu,
                     logits_indices, prompt_next, prev_rows, lora_slots, sampling) -> None:
        """prepare's loop for a rank's first n entries when each computes one token (decode, no
        drafts), as whole-array writes: entry i is token t0 + i, sequence row s0 + i, sampled
        row r0 + i. What does not change while a request runs (block table, sampling settings)
        is gathered from `request_rows`; the rest is read in one pass over the requests."""
        n, bs = len(reqs), self.block_size
        rows = self.request_rows.rows(reqs)  # [n]
        token, num_output, num_tokens, shared, block, pending = zip(*[
            (q.token_at(i), len(q.output_token_ids), len(q.prompt_token_ids) + len(q.output_token_ids),
             q.num_shared_kv_tokens, q.block_ids[i // bs], q.pending_row) for q, i in zip(reqs, starts)])
        start, num_tokens = np.array(starts, np.int64), np.array(num_tokens, np.int64)
        tokens[t0:t0 + n] = token
        positions[t0:t0 + n] = start
        # a fork's inherited KV is not written again
        slots[t0:t0 + n] = np.where(start >= np.array(shared), np.array(block, np.int64) * bs + start % bs, -1)
        tables[s0:s0 + n] = self.request_rows.table[rows]
        # its last token is being sampled by the previous step: the device takes it from there
        pending = np.array(pending, np.int32)
        prev_rows[t0:t0 + n] = np.where((pending >= 0) & (start == num_tokens - 1), pending, -1)
        if lora_slots is not None:
            lora_slots[t0:t0 + n] = [q.lora_slot for q in reqs]
        for i in np.flatnonzero(self.request_rows.scored[rows]):
            q, p = reqs[i], starts[i]
            if p < q.num_prompt_tokens:  # a fork re-running the prompt's end
                prompt_next[t0 + i] = prompt_logprobs.next_tokens(q.prompt_token_ids, p, 1, q.prompt_logprobs_from)[0]
        kv_lens[s0:s0 + n] = start + 1
        cu[c0 + 1:c0 + n + 1] = np.arange(1, n + 1)
        logits_indices[r0:r0 + n] = np.arange(n)
        sampling.fill_rows(r0, self.request_rows, rows, np.array(num_output, np.int32), start + 1 >= num_tokens,
                           lambda i: self.penalty_slot(rank, reqs[i]))


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

    def fill_rows(self, row: int, store, rows: np.ndarray, step: np.ndarray, produces: np.ndarray,
                  penalty_slot) -> None:
        """`fill` of rows row, row + 1, ... (one sampled row per request, offset 0, no draft) as
        whole-array writes, the requests' settings gathered from their rows of `store` (a
        RequestRows). step [n]: each one's output tokens; produces [n] bool; penalty_slot(i) ->
        the slot of the i-th request, asked of those with penalties, in order."""
        n = len(rows)
        out = slice(row, row + n)
        self.temperature[out], self.top_p[out] = store.temperature[rows], store.top_p[rows]
        self.min_p[out], self.top_k[out] = store.min_p[rows], store.top_k[rows]
        self.seed[out], self.step[out] = store.seed[rows], step
        self.draft_next[out] = -1
        self.want_logprobs[out] = store.want_logprobs[rows]
        self.produces[out] = produces
        for i in np.flatnonzero(store.penalized[rows]):
            if (slot := penalty_slot(i)) >= 0:
                r = rows[i]
                self.penalty_slot[row + i] = slot
                self.repetition[row + i], self.frequency[row + i] = store.repetition[r], store.frequency[r]
                self.presence[row + i] = store.presence[r]
        # mask_needed, row by row: a rule of the request, or min_tokens not yet out
        self.constrained[out] = produces & (store.has_rule[rows] | (step < store.min_tokens[rows]))

    def inputs(self) -> SamplingInputs:
        return SamplingInputs(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step,
                              self.want_logprobs, self.penalty_slot, self.repetition, self.frequency, self.presence,
                              self.produces, self.constrained, self.draft_next)
