"""Speculative drafts from a smaller model with the target's vocabulary (a draft model).

Before each engine step the draft model reads what it has not seen of each speculating
request (its prompt at first, then the tokens the last step accepted; one packed step, or a
few for long prompts) and then proposes k tokens greedily, one packed decode step per draft,
with the drafts fed back on the device (one transfer to the host at the end). The target
verifies them exactly as it does prompt-lookup drafts (`speculative.py`): greedy output is
the target's own, and sampled output keeps the target's distribution (a greedy draft is a
deterministic proposal, which the verifier's accept-or-redraw rule allows).

The draft keeps its own paged KV pool and block tables: a slot per running request, whose
blocks are taken from the pool as its tokens grow and all returned when the request stops
running (a preempted request reads its tokens again when it comes back). After verification
the KV of rejected drafts is simply not counted: a slot keeps the positions the request
still agrees with (all but its last token; see _Slot.keep).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pagedjax.models.dtypes import resolve_kv_cache_dtype
from pagedjax.models.kv_cache import AttentionMetadata, PagedKVCache, init_kv_cache, kv_bytes_per_token
from pagedjax.models.loader import load_model, resolve_model_dir
from pagedjax.core.buckets import Buckets
from pagedjax.sample.sampler import argmax

DRAFT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class DraftModel:
    """A loaded draft: the model, its config and its KV cache dtype."""

    model: object  # models.llama.CausalLM
    config: object  # models.config.ModelConfig
    kv_dtype: object

    @property
    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.config.num_layers, self.model.num_kv_heads, self.config.head_dim, self.kv_dtype)


def load_draft_model(path: str, *, dtype: str, kv_cache_dtype: str, vocab_size: int, max_model_len: int) -> DraftModel:
    """Loads the draft checkpoint (one device) and checks it against the target: the same
    vocabulary (vocab_size, the target's) and room for max_model_len positions."""
    try:  # a local directory or a Hugging Face id, as the target
        path = resolve_model_dir(path)
    except FileNotFoundError as exc:
        raise FileNotFoundError(f"speculative_config: the draft model (a Hugging Face checkpoint with the target's "
                                f"tokenizer): {exc}") from None
    draft, cfg, _ = load_model(path, dtype)
    if cfg.vocab_size != vocab_size:
        raise ValueError(f"speculative_config: the draft model's vocabulary ({cfg.vocab_size} tokens) differs "
                         f"from the target's ({vocab_size}); a draft model must share the target's tokenizer")
    limit = cfg.max_position_embeddings
    if max_model_len > limit:
        raise ValueError(f"speculative_config: the draft model supports {limit} positions, fewer than "
                         f"max_model_len={max_model_len}; lower max_model_len or pick another draft")
    return DraftModel(draft, cfg, resolve_kv_cache_dtype(kv_cache_dtype, draft.dtype))


class DraftModelProposer:
    """Greedy drafts from a loaded draft model for up to `max_num_seqs` running requests.
    num_blocks: the draft pool's size in blocks of DRAFT_BLOCK_SIZE tokens (the engine sizes
    it like the target's pool in tokens, plus k + 1 per sequence)."""

    def __init__(self, draft: DraftModel, *, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int,
                 num_blocks: int, attention_impl: str = "auto"):
        cfg = draft.config
        self.graphdef, self.state = nnx.split(draft.model)
        self.buckets = Buckets(max_num_seqs, max_num_batched_tokens)
        self.max_model_len = max_model_len
        self.max_blocks = -(-max_model_len // DRAFT_BLOCK_SIZE)  # MB: table width
        self.cache = PagedKVCache(num_blocks, DRAFT_BLOCK_SIZE, attention_impl)
        self.kv = init_kv_cache(self.cache, cfg.num_layers, draft.model.num_kv_heads, cfg.head_dim, draft.kv_dtype)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest
        self._slots: dict[int, _Slot] = {}  # id(request) -> its slot
        self._rows = self.buckets.num_seqs(self.buckets.max_num_batched_tokens)  # padded width of `next`
        self._step = jax.jit(self._forward, donate_argnums=(1,))
        self._device = jax.tree.leaves(self.state)[0].sharding  # the draft runs where its weights are
        self.kv = jax.device_put(self.kv, self._device)  # placed as the step returns it: one compile per T
        self._no_prev = jax.device_put(np.zeros(self._rows, np.int32), self._device)  # a step that reads no drafts

    # -- device ---------------------------------------------------------------------------
    def _forward(self, state, kv, tokens, from_prev, prev, md: AttentionMetadata, last):
        """-> (kv, next [R] int32: the argmax after token last[s] of each sequence s, padded).
        tokens [T]; from_prev [T]: where >= 0, the token is prev[from_prev] (the previous
        step's drafts, never through the host)."""
        model = nnx.merge(self.graphdef, state)
        tokens = jnp.where(from_prev >= 0, prev[jnp.maximum(from_prev, 0)], tokens)
        hidden, kv = model(tokens, md, kv, self.cache)  # [T, E]
        nxt = argmax(model.logits(hidden[last]))  # [S]
        return kv, jnp.pad(nxt, (0, self._rows - nxt.shape[0]))

    def warmup(self) -> None:
        """Compiles (and runs once, writing nothing) every step size."""
        for t in self.buckets.token_buckets():
            self._run([], t)

    # -- host -----------------------------------------------------------------------------
    def propose(self, requests: list, k: int, running: set[int]) -> list[list[int]]:
        """Up to k greedy drafts after each request's tokens. running: id() of every request
        still running (the slots of the others are freed first)."""
        self.release_all_but(running)
        live, drafts = [], [[] for _ in requests]
        for i, req in enumerate(requests):
            tokens = req.all_token_ids
            n = min(k, self.max_model_len - len(tokens))  # drafts at positions < max_model_len
            slot = self._slot(req)
            slot.keep(tokens)
            if n <= 0 or not self._reserve(slot, len(tokens) + n - 1):
                continue
            live.append((i, slot, tokens, n))
            if len(live) == self._rows:  # a step's rows (the engine sizes them for every sequence)
                break
        if not live:
            return drafts
        for (i, *_), d in zip(live, self._catch_up(live)):  # the first draft of each
            drafts[i].append(d)
        self._decode(live, drafts)
        return drafts

    def _catch_up(self, live) -> list[int]:
        """Feeds each request's tokens its slot has not seen (at least its last one); returns
        the argmax after each request's last token."""
        first = [0] * len(live)
        todo = list(range(len(live)))
        cap = self.buckets.max_num_batched_tokens
        while todo:
            rows, room = [], cap
            for j in todo:
                if room == 0 or len(rows) == self.buckets.num_seqs(cap):
                    break
                _, slot, tokens, _ = live[j]
                chunk = tokens[slot.length:slot.length + room]
                rows.append((j, slot, chunk))
                room -= len(chunk)
            t = self.buckets.token_bucket(sum(len(c) for _, _, c in rows))
            values = np.asarray(self._run([(slot, slot.length, chunk) for _, slot, chunk in rows], t))
            finished = set()
            for r, (j, slot, chunk) in enumerate(rows):
                slot.length += len(chunk)
                if slot.length == len(live[j][2]):
                    first[j] = int(values[r])
                    finished.add(j)
            todo = [j for j in todo if j not in finished]
        return first

    def _decode(self, live, drafts: list[list[int]]) -> None:
        """Drafts 2..n: one decode step per draft over the requests still drafting, each fed
        its previous draft on the device; one transfer at the end. drafts[i] holds the first."""
        first = [drafts[i][0] for i, *_ in live]
        prev = jax.device_put(np.pad(np.asarray(first, np.int32), (0, self._rows - len(first))), self._device)
        outs, rows = [], list(range(len(live)))  # rows: indices into live, this step's row order
        for step in range(1, max(n for *_, n in live)):
            rows_next = [j for j in rows if live[j][3] > step]
            if not rows_next:
                break
            order = {j: r for r, j in enumerate(rows)}  # where each request's last draft sits in prev
            t = self.buckets.token_bucket(len(rows_next))
            from_prev = np.full(t, -1, np.int32)
            from_prev[:len(rows_next)] = [order[j] for j in rows_next]
            feed = [(live[j][1], live[j][1].length, [0]) for j in rows_next]  # the draft, after the slot's tokens
            prev = self._run(feed, t, from_prev, prev)
            for j in rows_next:
                live[j][1].length += 1
            outs.append((rows_next, prev))
            rows = rows_next
        for (rows_step, _), values in zip(outs, jax.device_get([o for _, o in outs])):
            for r, j in enumerate(rows_step):
                drafts[live[j][0]].append(int(values[r]))

    def _run(self, rows: list[tuple["_Slot", int, list[int]]], t: int, from_prev=None, prev=None):
        """One packed step of T = t tokens: rows (slot, first position, tokens fed there; where
        from_prev >= 0 the token comes from prev instead). Returns next [R] on the device."""
        s = self.buckets.num_seqs(t)
        tokens = np.zeros(t, np.int32)
        positions = np.zeros(t, np.int32)
        slots = np.full(t, -1, np.int32)
        tables = np.zeros((s, self.max_blocks), np.int32)
        kv_lens = np.zeros(s, np.int32)
        cu = np.zeros(s + 1, np.int32)
        last = np.zeros(s, np.int32)
        at = 0
        for r, (slot, start, chunk) in enumerate(rows):
            pos = np.arange(start, start + len(chunk))
            tokens[at:at + len(chunk)] = chunk
            positions[at:at + len(chunk)] = pos
            blocks = np.asarray(slot.blocks, np.int32)
            slots[at:at + len(chunk)] = blocks[pos // DRAFT_BLOCK_SIZE] * DRAFT_BLOCK_SIZE + pos % DRAFT_BLOCK_SIZE
            tables[r, :len(blocks)] = blocks
            kv_lens[r] = start + len(chunk)
            at += len(chunk)
            cu[r + 1] = at
            last[r] = at - 1
        cu[len(rows) + 1:] = at
        md = AttentionMetadata(positions, slots, tables, kv_lens, cu)
        if from_prev is None:
            from_prev = np.full(t, -1, np.int32)
        self.kv, nxt = self._step(self.state, self.kv, tokens, from_prev, self._no_prev if prev is None else prev,
                                  md, last)
        return nxt

    # -- slots ----------------------------------------------------------------------------
    def _slot(self, req) -> "_Slot":
        slot = self._slots.get(id(req))
        if slot is None or slot.request is not req:
            if slot is not None:
                self._release(id(req))
            slot = self._slots[id(req)] = _Slot(req)
        return slot

    def _reserve(self, slot: "_Slot", num_tokens: int) -> bool:
        """Blocks for the slot's first num_tokens positions; False (nothing taken) when the
        pool is short."""
        need = -(-num_tokens // DRAFT_BLOCK_SIZE) - len(slot.blocks)
        if need > len(self._free_blocks):
            return False
        for _ in range(max(need, 0)):
            slot.blocks.append(self._free_blocks.pop())
        return True

    def release(self, request) -> None:
        """Returns a finished request's blocks to the draft pool (if it holds any)."""
        slot = self._slots.get(id(request))
        if slot is not None and slot.request is request:
            self._release(id(request))

    def release_all_but(self, running: set[int]) -> None:
        """Frees the slots of requests no longer running (running: their id())."""
        for key in [key for key in self._slots if key not in running]:
            self._release(key)

    def _release(self, key: int) -> None:
        slot = self._slots.pop(key)
        self._free_blocks.extend(reversed(slot.blocks))

    @property
    def num_compiled_steps(self) -> int:
        """Step sizes compiled so far (a proposal that compiled one took compile time)."""
        return self._step._cache_size()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)


class _Slot:
    """A request's place in the draft pool: its blocks, and how many of its positions hold KV
    (its tokens, then the drafts fed in its last proposal)."""

    def __init__(self, request):
        self.request = request  # kept so that id() stays unique while the slot lives
        self.blocks: list[int] = []
        self.length = 0

    def keep(self, tokens: list[int]) -> None:
        """Drops the drafts the request did not accept, and always its last token (the drafts
        start from its logits). The accepted drafts are a prefix of the drafts fed, and the
        token after them (the bonus, or the redraw at the first rejected draft) is the
        request's last, so the slot still agrees with the request's first len - 1 tokens."""
        self.length = min(self.length, len(tokens) - 1)
