"""Host batch preparation and the one jitted step (model forward + on-device sampling)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from models.kv_cache import AttentionMetadata, copy_blocks, init_kv_caches
from pagedjax.buckets import Buckets
from pagedjax.sampler import SamplingInputs, sample
from pagedjax.scheduler import SchedulerOutput


class ModelRunner:
    """Owns the model parameters, the device KV cache and the compiled step functions."""

    def __init__(self, model, buckets: Buckets, cache, max_blocks_per_seq: int, kv_dtype, mesh: Mesh | None = None):
        cfg = model.config
        self.buckets = buckets
        self.cache = cache
        self.block_size = getattr(cache, "block_size", 1)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.mesh = mesh or Mesh(np.array(jax.devices()[:1]), ("tp",))
        replicated = NamedSharding(self.mesh, P())
        self.graphdef, state = nnx.split(model)
        self.state = jax.device_put(state, replicated)
        kv_sharding = NamedSharding(self.mesh, P("tp") if cfg.num_kv_heads % self.mesh.size == 0 else P())
        self.kv_caches = init_kv_caches(cache, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, kv_dtype, kv_sharding)
        self._step = jax.jit(self._forward, donate_argnums=(1,))
        self.compiled_shapes: set[tuple[tuple[int, int], ...]] = set()  # grid shapes of each compiled step

    def _forward(self, state, kv_caches, segments, sampling: SamplingInputs, copies):
        """segments: [(tokens [S,Q], AttentionMetadata)]; one sampled token per grid row."""
        kv_caches = copy_blocks(kv_caches, *copies)  # copy-on-write before anything is written
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model.forward_segments(segments, kv_caches, self.cache)  # [T, E]
        rows, off = [], 0
        for tokens, md in segments:  # each row's last valid token
            s, nq = tokens.shape
            rows.append(off + jnp.arange(s) * nq + jnp.maximum(md.q_lens - 1, 0))
            off += s * nq
        hidden = hidden[jnp.concatenate(rows)]  # [R, E]
        return kv_caches, sample(model.logits(hidden), sampling)

    # -- host side ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput):
        """Numpy inputs for one step padded to its bucket, and the batch row of each request."""
        nd = out.num_decode
        shape = self.buckets.step_shape(nd, len(out.requests) - nd, max(out.q_lens[nd:], default=1))
        grids = [self._grid(s, q) for s, q in shape]
        num_rows = sum(s for s, _ in shape)
        sampling = _SamplingArrays(num_rows)
        rows = []
        for i, (req, start, ql) in enumerate(zip(out.requests, out.starts, out.q_lens)):
            g, r = (0, i) if i < nd else (1, i - nd)
            self._fill_row(grids[g], r, req, start, ql)
            row = r if g == 0 else shape[0][0] + r
            sampling.fill(row, req)
            rows.append(row)
        return _segments(grids), sampling.inputs(), self._copy_arrays(out.copies, num_rows), rows

    def _grid(self, s: int, q: int) -> dict[str, np.ndarray]:
        return {"tokens": np.zeros((s, q), np.int32), "positions": np.zeros((s, q), np.int32),
                "slots": np.full((s, q), -1, np.int32), "tables": np.zeros((s, self.max_blocks_per_seq), np.int32),
                "kv_lens": np.zeros(s, np.int32), "q_lens": np.zeros(s, np.int32)}

    def _fill_row(self, g: dict, i: int, req, start: int, ql: int) -> None:
        bs = self.block_size
        blocks = req.block_ids
        g["tables"][i, :len(blocks)] = blocks
        if ql == 1:
            g["tokens"][i, 0] = req.token_at(start)
            g["positions"][i, 0] = start
            if start >= req.num_shared_kv_tokens:  # a fork's inherited KV is not written again
                g["slots"][i, 0] = blocks[start // bs] * bs + start % bs
        else:
            pos = np.arange(start, start + ql, dtype=np.int32)
            g["tokens"][i, :ql] = req.token_slice(start, start + ql)
            g["positions"][i, :ql] = pos
            g["slots"][i, :ql] = np.where(pos >= req.num_shared_kv_tokens,
                                          g["tables"][i, pos // bs] * bs + pos % bs, -1)
        g["kv_lens"][i], g["q_lens"][i] = start + ql, ql

    def _copy_arrays(self, copies: list[tuple[int, int]], s: int):
        """Copy-on-write pairs as two [S] int32 arrays; padding entries point past the pool (no-op)."""
        src = np.zeros(s, np.int32)
        dst = np.full(s, self.cache.num_blocks, np.int32)
        if copies:
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
        return src, dst

    def execute(self, out: SchedulerOutput):
        """Runs one step; returns (sampler output as numpy, batch row of each request), with
        one device->host transfer."""
        segments, sampling, copies, rows = self.prepare(out)
        self.compiled_shapes.add(tuple(t.shape for t, _ in segments))
        self.kv_caches, result = self._step(self.state, self.kv_caches, segments, sampling, copies)
        return jax.device_get(result), rows

    def warmup(self, shapes, progress: bool = True) -> None:
        """Compiles the step for every bucket given (tuples of grid shapes), on idle inputs."""
        from tqdm import tqdm

        for shape in tqdm(shapes, desc="compiling step buckets", disable=not progress, unit="shape"):
            if shape in self.compiled_shapes:
                continue
            segments = _segments([self._grid(s, q) for s, q in shape])
            num_rows = sum(s for s, _ in shape)
            self.kv_caches, result = self._step(self.state, self.kv_caches, segments,
                                                _SamplingArrays(num_rows).inputs(), self._copy_arrays([], num_rows))
            jax.block_until_ready(result)
            self.compiled_shapes.add(shape)


def _segments(grids: list[dict]) -> list[tuple[np.ndarray, AttentionMetadata]]:
    """Filled host grids -> the step's (tokens [S, Q], AttentionMetadata) segments."""
    return [(g["tokens"], AttentionMetadata(g["positions"], g["slots"], g["tables"], g["kv_lens"], g["q_lens"]))
            for g in grids]


class _SamplingArrays:
    """Per-row sampling settings being filled on the host (idle rows: greedy)."""

    def __init__(self, n: int):
        self.temperature, self.top_p, self.min_p = np.zeros(n, np.float32), np.ones(n, np.float32), np.zeros(n, np.float32)
        self.top_k, self.step, self.seed = np.zeros(n, np.int32), np.zeros(n, np.int32), np.zeros(n, np.uint32)
        self.want_logprobs = np.zeros(n, bool)

    def fill(self, row: int, req) -> None:
        p = req.params
        self.temperature[row], self.top_p[row], self.min_p[row], self.top_k[row] = p.temperature, p.top_p, p.min_p, p.top_k
        self.seed[row], self.step[row] = req.seed & 0xFFFFFFFF, len(req.output_token_ids)
        self.want_logprobs[row] = p.logprobs is not None

    def inputs(self) -> SamplingInputs:
        return SamplingInputs(self.temperature, self.top_k, self.top_p, self.min_p, self.seed, self.step,
                              self.want_logprobs)
