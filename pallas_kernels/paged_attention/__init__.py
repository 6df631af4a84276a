"""Paged attention: one contract (see reference.py), jnp and Pallas TPU/GPU backends."""
from .ops import IMPLS, packed_paged_attention, paged_attention, paged_decode_attention, write_kv
from .packed import packed_attention_reference
from .ragged import paged_attention_ragged
from .reference import paged_attention_chunked, paged_attention_reference

__all__ = ["IMPLS", "packed_paged_attention", "packed_attention_reference", "paged_attention", "paged_decode_attention", "write_kv",
           "paged_attention_reference", "paged_attention_chunked", "paged_attention_ragged"]
