"""Notices transformers prints that do not concern a pagedjax user, filtered out of its logs.

pagedjax uses transformers for tokenizers and configs only, and detokenizes itself:
- "PyTorch was not found. Models won't be available...": pagedjax never needs torch;
- "Ignoring clean_up_tokenization_spaces=True for BPE tokenizer...": transformers already
  ignores the setting, it only says so on every start.
Only these exact messages go; every other transformers warning still reaches the user.
"""
import logging

_DROPPED = {
    "transformers": ("PyTorch was not found.",),
    "transformers.tokenization_utils_tokenizers": ("Ignoring clean_up_tokenization_spaces=True for BPE",),
}


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


for _name, _prefixes in _DROPPED.items():
    _logger = logging.getLogger(_name)
    if not any(isinstance(f, _DropNotices) for f in _logger.filters):
        _logger.addFilter(_DropNotices(_prefixes))
