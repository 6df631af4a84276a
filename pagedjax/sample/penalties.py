"""Repetition, frequency and presence penalties and logit bias, on the device.

A request that uses any of them holds one row ("slot") of a device-resident `PenaltyState`
while it runs: its output-token counts, which tokens its prompt holds, and its logit bias
as a dense row. The slot is loaded once from the request's tokens (`load_slot`, a small
jitted function with fixed shapes) and then kept current by the sampler, which adds each
sampled token to its row's counts. Rows without a slot pay nothing: the sampler skips the
penalties when no row of a step has one (a `lax.cond` on the step's flags; on GPUs, where a
conditional makes the host wait, a select: pagedjax.sample.select_cond), and their counts' scatter
entries are dropped.

With data parallelism each rank has its own `slots_per_rank` rows (rank-major), sharded on
"data", exactly like its KV pool.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.sampling_params import MAX_LOGIT_BIAS

LOAD_CHUNK = 512  # tokens loaded into a slot per call of load_slot (one compiled shape)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PenaltyState:
    counts: jax.Array  # [R, V] int32: how often each token occurs in the slot's output
    in_prompt: jax.Array  # [R, V] bool: the token occurs in the slot's prompt
    bias: jax.Array  # [R, V] float32: logit_bias as a dense row


def init_penalty_state(rows: int, vocab_size: int, sharding=None) -> PenaltyState:
    def zeros(dtype):
        x = jnp.zeros((rows, vocab_size), dtype)
        return x if sharding is None else jax.device_put(x, sharding)

    return PenaltyState(zeros(jnp.int32), zeros(bool), zeros(jnp.float32))


def _load_slot(state: PenaltyState, slot, ids, is_prompt, reset, bias_ids, bias_vals) -> PenaltyState:
    """Adds `ids` [LOAD_CHUNK] (-1: padding) to row `slot`'s prompt set (is_prompt) or output
    counts; `reset` first clears the row and sets its bias from bias_ids/bias_vals [B]."""
    v = state.counts.shape[1]
    keep = ~reset
    counts = state.counts.at[slot].multiply(keep.astype(jnp.int32))
    in_prompt = state.in_prompt.at[slot].set(state.in_prompt[slot] & keep)
    bias_row = jnp.zeros((v,), jnp.float32).at[bias_ids].set(bias_vals, mode="drop")  # -1 ids dropped
    bias = state.bias.at[slot].set(jnp.where(reset, bias_row, state.bias[slot]))
    valid = ids >= 0
    out_ids = jnp.where(valid & ~is_prompt, ids, v)  # v: out of range, dropped
    prompt_ids = jnp.where(valid & is_prompt, ids, v)
    counts = counts.at[slot, out_ids].add(1, mode="drop")
    in_prompt = in_prompt.at[slot, prompt_ids].set(True, mode="drop")
    return PenaltyState(counts, in_prompt, bias)


load_slot = jax.jit(_load_slot, donate_argnums=(0,))


def load_slot_args(slot: int, token_ids: list[int], num_prompt: int, logit_bias: dict[int, float] | None):
    """Host arrays for the load_slot calls that fill `slot` with a request's tokens: one
    call per LOAD_CHUNK tokens (at least one, which resets the row)."""
    bias_ids = np.full(MAX_LOGIT_BIAS, -1, np.int32)
    bias_vals = np.zeros(MAX_LOGIT_BIAS, np.float32)
    if logit_bias:
        bias_ids[:len(logit_bias)] = list(logit_bias)
        bias_vals[:len(logit_bias)] = list(logit_bias.values())
    ids = np.asarray(token_ids, np.int32)
    calls = []
    for start in range(0, max(len(ids), 1), LOAD_CHUNK):
        chunk = np.full(LOAD_CHUNK, -1, np.int32)
        part = ids[start:start + LOAD_CHUNK]
        chunk[:len(part)] = part
        is_prompt = np.arange(start, start + LOAD_CHUNK) < num_prompt
        calls.append((np.int32(slot), chunk, is_prompt, np.bool_(start == 0), bias_ids, bias_vals))
    return calls


def _rows(x, slot, dp: int):
    """x [dp * C, V] (each rank its C rows), slot [dp * S] rank-local -> [dp * S, V]."""
    xr = x.reshape(dp, -1, x.shape[-1])
    return jax.vmap(lambda a, i: a[i])(xr, slot.reshape(dp, -1)).reshape(-1, x.shape[-1])


def apply_penalties(logits, state: PenaltyState, slot, repetition, frequency, presence, dp: int = 1):
    """logits [S, V] float32 -> logits with bias, then transformers' repetition penalty (over
    prompt and output tokens), then OpenAI's frequency and presence penalties (over output
    tokens). slot [S] int32 (-1: none, the row is returned unchanged); penalties [S] f32."""
    has = slot >= 0
    idx = jnp.maximum(slot, 0)
    counts = _rows(state.counts, idx, dp)  # [S, V]
    in_prompt = _rows(state.in_prompt, idx, dp)
    bias = _rows(state.bias, idx, dp)
    x = logits + bias
    seen = in_prompt | (counts > 0)
    r = repetition[:, None]
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
    c = counts.astype(jnp.float32)
    x = x - frequency[:, None] * c - presence[:, None] * (c > 0)
    return jnp.where(has[:, None], x, logits)


def count_sampled(state: PenaltyState, slot, tokens, produces, dp: int = 1) -> PenaltyState:
    """Adds each row's sampled token to its slot's counts, for rows with a slot whose token
    is kept (`produces`: the row finished its pending tokens). slot/tokens/produces [dp * S]."""
    rows = state.counts.shape[0] // dp
    rank = jnp.arange(slot.shape[0], dtype=jnp.int32) // (slot.shape[0] // dp)
    row = jnp.where((slot >= 0) & produces, rank * rows + slot, state.counts.shape[0])  # out of range: dropped
    counts = state.counts.at[row, tokens].add(1, mode="drop")
    return PenaltyState(counts, state.in_prompt, state.bias)


class PenaltySlots:
    """Host side: which request holds which slot of one data rank's rows. A slot is taken
    when a request that uses penalties is first scheduled and given back lazily, when a new
    request needs one and the holder is no longer running (finished, or preempted: it is
    loaded again from its tokens when it runs again)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._slot_of: dict[object, int] = {}  # request -> slot
        self._free = list(range(num_slots - 1, -1, -1))

    def get(self, req) -> tuple[int, bool]:
        """(slot of req, whether it must be loaded now)."""
        slot = self._slot_of.get(req)
        if slot is not None:
            return slot, False
        if not self._free:
            self._reclaim()
        if not self._free:
            raise RuntimeError("no penalty slot is free although every holder is running (more running requests "
                               "than max_num_seqs?)")
        slot = self._free.pop()
        self._slot_of[req] = slot
        return slot, True

    def release(self, req) -> None:
        slot = self._slot_of.pop(req, None)
        if slot is not None:
            self._free.append(slot)

    def _reclaim(self) -> None:
        for req, slot in list(self._slot_of.items()):
            if req.status.value != "running":
                del self._slot_of[req]
                self._free.append(slot)

    def __len__(self) -> int:
        return len(self._slot_of)
