"""Pallas kernels for pagedjax."""
from .dense_attention import dense_attention
from .paged_attention import (packed_attention_reference, packed_paged_attention, paged_attention, paged_attention_reference,
                              paged_decode_attention, write_kv)

__all__ = ["dense_attention", "packed_paged_attention", "packed_attention_reference", "paged_attention", "paged_decode_attention", "write_kv", "paged_attention_reference"]
