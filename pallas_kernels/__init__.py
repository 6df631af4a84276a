"""Pallas kernels for pagedjax."""
from .paged_attention import (paged_attention, paged_attention_reference,
                              paged_decode_attention, write_kv)

__all__ = ["paged_attention", "paged_decode_attention", "write_kv", "paged_attention_reference"]
