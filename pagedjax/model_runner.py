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
        self.compiled_shapes: set[tuple[int, int]] = set()

    def _forward(self, state, kv_caches, tokens, md: AttentionMetadata, sampling: SamplingInputs, copies):
        kv_caches = copy_blocks(kv_caches, *copies)  # copy-on-write before anything is written
        model = nnx.merge(self.graphdef, state)
        hidden, kv_caches = model(tokens, md, kv_caches, self.cache)  # [S, Q, E]
        last = jnp.maximum(md.q_lens - 1, 0)
        hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]  # [S, E]
        return kv_caches, sample(model.logits(hidden), sampling)

    # -- host side ------------------------------------------------------------------------
    def prepare(self, out: SchedulerOutput):
        """Numpy inputs for one step, padded to its bucket."""
        n = len(out.requests)
        s = self.buckets.seq_bucket(n)
        q = self.buckets.q_bucket(max(out.q_lens)) if out.is_prefill else 1
        bs = self.block_size
        tokens = np.zeros((s, q), np.int32)
        positions = np.zeros((s, q), np.int32)
        slots = np.full((s, q), -1, np.int32)
        tables = np.zeros((s, self.max_blocks_per_seq), np.int32)
        kv_lens = np.zeros(s, np.int32)
        q_lens = np.zeros(s, np.int32)
        temperature, top_p, min_p = np.zeros(s, np.float32), np.ones(s, np.float32), np.zeros(s, np.float32)
        top_k, step = np.zeros(s, np.int32), np.zeros(s, np.int32)
        seed = np.zeros(s, np.uint32)
        want_logprobs = np.zeros(s, bool)
        for i, (req, start, ql) in enumerate(zip(out.requests, out.starts, out.q_lens)):
            blocks = req.block_ids
            tables[i, :len(blocks)] = blocks
            if ql == 1:
                tokens[i, 0] = req.token_at(start)
                positions[i, 0] = start
                if start >= req.num_shared_kv_tokens:  # a fork's inherited KV is not written again
                    slots[i, 0] = blocks[start // bs] * bs + start % bs
            else:
                pos = np.arange(start, start + ql, dtype=np.int32)
                tokens[i, :ql] = req.all_token_ids[start:start + ql]
                positions[i, :ql] = pos
                slots[i, :ql] = np.where(pos >= req.num_shared_kv_tokens, tables[i, pos // bs] * bs + pos % bs, -1)
            kv_lens[i], q_lens[i] = start + ql, ql
            p = req.params
            temperature[i], top_p[i], min_p[i], top_k[i] = p.temperature, p.top_p, p.min_p, p.top_k
            seed[i], step[i] = req.seed & 0xFFFFFFFF, len(req.output_token_ids)
            want_logprobs[i] = p.logprobs is not None
        md = AttentionMetadata(positions, slots, tables, kv_lens, q_lens)
        sampling = SamplingInputs(temperature, top_k, top_p, min_p, seed, step, want_logprobs)
        return tokens, md, sampling, self._copy_arrays(out.copies, s)

    def _copy_arrays(self, copies: list[tuple[int, int]], s: int):
        """Copy-on-write pairs as two [S] int32 arrays; padding entries point past the pool (no-op)."""
        src = np.zeros(s, np.int32)
        dst = np.full(s, self.cache.num_blocks, np.int32)
        if copies:
            src[:len(copies)], dst[:len(copies)] = zip(*copies)
        return src, dst

    def execute(self, out: SchedulerOutput) -> dict[str, np.ndarray]:
        """Runs one step; returns the sampler output as numpy (one device->host transfer)."""
        tokens, md, sampling, copies = self.prepare(out)
        self.compiled_shapes.add(tokens.shape)
        self.kv_caches, result = self._step(self.state, self.kv_caches, tokens, md, sampling, copies)
        return jax.device_get(result)

    def warmup(self, shapes, progress: bool = True) -> None:
        """Compiles the step for every (S, Q) bucket given, on dummy padded inputs."""
        from tqdm import tqdm

        for s, q in tqdm(shapes, desc="compiling step buckets", disable=not progress, unit="shape"):
            if (s, q) in self.compiled_shapes:
                continue
            tokens = np.zeros((s, q), np.int32)
            md = AttentionMetadata(np.zeros((s, q), np.int32), np.full((s, q), -1, np.int32),
                                   np.zeros((s, self.max_blocks_per_seq), np.int32), np.zeros(s, np.int32),
                                   np.zeros(s, np.int32))
            z = np.zeros(s, np.float32)
            sampling = SamplingInputs(z, np.zeros(s, np.int32), z + 1, z, np.zeros(s, np.uint32), np.zeros(s, np.int32),
                                      np.zeros(s, bool))
            self.kv_caches, result = self._step(self.state, self.kv_caches, tokens, md, sampling,
                                                self._copy_arrays([], s))
            jax.block_until_ready(result)
            self.compiled_shapes.add((s, q))

