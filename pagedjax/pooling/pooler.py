"""Pooler: the engine's one object for embedding requests (None until the first one).

An embedding request is a prefill-only Request (`Request.pooling` set): the scheduler admits
it, prefills its prompt in chunks like any other, and finishes it (blocks freed) in the step
that computes its last prompt token; it never decodes, and the token its row samples is
dropped. After each step that carries pooling rows, one small compiled executable reads the
step's hidden states (after the final norm) on the device and sums, per sequence row, those
of the tokens it pools: every prompt token of a mean-pooled request, the last prompt token of
a last-token one. Only those [dp * S, E] sums come back to the host, where a mean-pooled
request adds up its chunks. When the prompt is done its embedding is built: the mean (or the
last token's state), truncated to `dimensions`, L2-normalized.

The executables have the step's fixed shapes (one per token bucket T), all compiled when the
Pooler is made: after that, embeddings of any length compile nothing.

Prefix-cache hits: a mean-pooled prompt needs every token's hidden state, so it never reads
the cache (`Request.needs_every_prompt_position`); a last-token one does (the scheduler always
computes a prompt's last token). Both write their full blocks to the cache for later requests.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.core.request import Request
from pagedjax.outputs import EmbeddingOutput, EmbeddingRequestOutput
from pagedjax.pooling.params import PoolingParams
from pagedjax.sampling_params import SamplingParams

# an embedding's sampling settings: its row samples one greedy token that nobody reads
PREFILL_ONLY = SamplingParams(max_tokens=1, temperature=0.0)


def pool_sums(hidden, rows, *, dp: int, s: int):
    """hidden [dp * T, E] (each data rank its T tokens), rows [dp * T] int32 (each token's
    sequence row within its rank, -1: not pooled) -> float32 [dp * S, E]: per sequence row,
    the sum of its pooled tokens' hidden states (zeros for rows that pool nothing)."""
    e = hidden.shape[-1]
    h = hidden.reshape(dp, -1, e).astype(jnp.float32)  # [dp, T, E]
    r = rows.reshape(dp, -1)  # [dp, T]
    r = jnp.where(r >= 0, r, s)  # unpooled tokens land in an extra segment, dropped
    sums = jax.vmap(lambda x, i: jax.ops.segment_sum(x, i, num_segments=s + 1))(h, r)  # [dp, S + 1, E]
    return sums[:, :s].reshape(dp * s, e)


@dataclass(slots=True, eq=False)
class _Pooled:
    """One embedding request in flight."""

    req: Request
    prompt: str | None
    sum: np.ndarray | None = None  # float32 [E]: the pooled hidden states so far (mean: of the chunks so far)


class Pooler:
    def __init__(self, pooling_type: str, hidden_size: int, token_buckets: list[int], num_seqs: Callable[[int], int],
                 dp: int, specs: Callable[[int], tuple]):
        """pooling_type: the engine's ("last" or "mean"), for requests that name none;
        token_buckets: every step size T; num_seqs(T): the sequence rows S of that step;
        dp: data ranks; specs(T) -> (hidden, rows) ShapeDtypeStructs of that step
        (ModelRunner.hidden_specs). Compiles the pooling executable of every T now."""
        self.pooling_type = pooling_type
        self.hidden_size = hidden_size
        self.num_seqs = num_seqs
        self.dp = dp
        self.requests: dict[str, _Pooled] = {}
        self.num_embedded = 0
        self._rows_sharding = {}
        self._executables = {}
        fn = jax.jit(pool_sums, static_argnames=("dp", "s"))
        for t in token_buckets:
            hidden, rows = specs(t)
            self._rows_sharding[t] = rows.sharding
            self._executables[t] = fn.lower(hidden, rows, dp=dp, s=num_seqs(t)).compile()

    # -- requests ---------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: str | None, ids: list[int], params: PoolingParams) -> Request:
        """The prefill-only Request of an embedding (its pooling type resolved), tracked from
        now on; ValueError if `params` cannot apply to this model."""
        params.check(self.hidden_size)
        if params.pooling_type is None:
            params = replace(params, pooling_type=self.pooling_type)
        req = Request(request_id, list(ids), PREFILL_ONLY, 0, pooling=params)
        self.requests[request_id] = _Pooled(req, prompt)
        return req

    def pop(self, request_id: str) -> list[Request]:
        """Stops tracking a request (abort); returns it, if it was an embedding."""
        entry = self.requests.pop(request_id, None)
        return [] if entry is None else [entry.req]

    # -- the step -----------------------------------------------------------------------------
    def hook(self, outs) -> Callable | None:
        """For ModelRunner.dispatch: (hidden, T) -> the step's pooled sums on the device, or
        None when no entry of the step pools (the step runs as if embeddings did not exist)."""
        if not any(out is not None and any(r.pooling is not None for r in out.requests) for out in outs):
            return None

        def pool(hidden, t: int):
            rows = jax.device_put(self.rows(outs, t), self._rows_sharding[t])
            return self._executables[t](hidden, rows)

        return pool

    def rows(self, outs, t: int) -> np.ndarray:
        """[dp * T] int32: the sequence row (within its rank) of each token the step pools, -1
        elsewhere; tokens lie end to end in entry order, as InputBatch packs them."""
        rows = np.full(len(outs) * t, -1, np.int32)
        for rank, out in enumerate(outs):
            if out is None:
                continue
            off = rank * t
            for i, (req, start, q) in enumerate(zip(out.requests, out.starts, out.q_lens)):
                if req.pooling is not None:
                    if req.pooling.pooling_type == "mean":
                        rows[off:off + q] = i
                    elif start <= (last := req.num_prompt_tokens - 1) < start + q:
                        rows[off + last - start] = i
                off += q
        return rows

    def process(self, outs, pooled: np.ndarray | None, produced) -> list[EmbeddingRequestOutput]:
        """Folds a step's pooled sums (numpy [dp * S, E]) into its embedding requests and
        returns the outputs of those the step finished (`produced`: the engine's list)."""
        if pooled is not None:
            s = pooled.shape[0] // len(outs)
            for rank, out in enumerate(outs):
                if out is None:
                    continue
                for i, (req, start) in enumerate(zip(out.requests, out.starts)):
                    entry = self.requests.get(req.request_id) if req.pooling is not None else None
                    if entry is None or entry.req is not req:  # aborted meanwhile
                        continue
                    row = pooled[rank * s + i]
                    if req.pooling.pooling_type == "last" or start == 0 or entry.sum is None:
                        # last: only the chunk holding the last token pools anything; mean: a
                        # chunk from 0 starts over (a preempted request computes its prompt again)
                        if req.pooling.pooling_type == "mean" or start + out.q_lens[i] >= req.num_prompt_tokens:
                            entry.sum = row.copy()
                    else:
                        entry.sum += row
        done = []
        for req, _, _ in produced:
            if req.pooling is None or req.request_id not in self.requests or not req.is_finished:
                continue
            entry = self.requests.pop(req.request_id)
            done.append(EmbeddingRequestOutput(req.request_id, entry.prompt, list(req.prompt_token_ids),
                                               EmbeddingOutput(self.embedding(entry)), True, req.num_cached_tokens))
            self.num_embedded += 1
        return done

    @staticmethod
    def embedding(entry: _Pooled) -> np.ndarray:
        """float32 [D]: the pooled vector, truncated to `dimensions`, L2-normalized if asked."""
        req, params = entry.req, entry.req.pooling
        v = entry.sum / req.num_prompt_tokens if params.pooling_type == "mean" else entry.sum
        if params.dimensions is not None:
            v = v[:params.dimensions]
        if params.normalize:
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        return np.asarray(v, np.float32)
