"""Pallas kernels for pagedjax."""
from .dense_attention import dense_attention
from .paged_attention import (paged_attention, paged_attention_reference,
                              paged_decode_attention, write_kv)

__all__ = ["dense_attention", "paged_attention", "paged_decode_attention", "write_kv", "paged_attention_reference"]
