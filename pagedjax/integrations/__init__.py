"""Adapters that plug pagedjax into other libraries (each an optional extra)."""
