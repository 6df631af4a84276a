"""Incremental, UTF-8 safe detokenization.

Text is produced by decoding a small window of recent tokens and keeping only what it adds
over the window without the newest tokens; output is held back while the newest bytes do
not yet form a whole character (the decoder shows U+FFFD for them).
"""
from __future__ import annotations

_CONTEXT = 5  # prompt tokens decoded ahead of the first output, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Appends one token; returns the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += new
        return new
