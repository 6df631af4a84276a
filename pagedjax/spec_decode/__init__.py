"""Speculative decoding: prompt lookup, a draft model, the draft allocation policy."""
