"""Embeddings: a prompt prefilled through the scheduler, its final hidden states pooled.

`params` (PoolingParams, the checkpoint's pooling config) is host-only and cheap to import;
`pooler` (the Pooler the engine owns, with its compiled pooling executables) imports JAX.
"""
from pagedjax.pooling.params import POOLING_TYPES, PoolingParams

__all__ = ["POOLING_TYPES", "PoolingParams"]
