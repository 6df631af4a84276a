"""InputProcessor: a prompt and its sampling parameters checked and tokenized before the
engine queues them, with clear errors for what could never run."""
from __future__ import annotations

from pagedjax.sampling_params import SamplingParams


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, logits_width: int, model_name: str):
        """vocab_size: the model config's (prompt ids); logits_width: the sampled vocabulary
        (logit_bias and allowed_token_ids ids)."""
        _lift_length_limit(tokenizer)
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.logits_width = logits_width
        self.model_name = model_name

    def tokenize(self, prompt: str | list[int], keep_last: int | None = None) -> tuple[str | None, list[int]]:
        """(prompt text or None, token ids); keep_last: only the last that many token ids
        (SamplingParams.truncate_prompt_tokens; the text stays as given)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.model_name} has no tokenizer: give token-id prompts")
            text, ids = prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            text, ids = None, [int(t) for t in prompt]
            vocab = self.vocab_size
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        if keep_last is not None:
            ids = ids[-keep_last:]
        return text, ids

    def check_token_ids(self, params: SamplingParams) -> None:
        vocab = self.logits_width
        for name, ids in (("logit_bias", params.logit_bias or ()), ("allowed_token_ids", params.allowed_token_ids or ())):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name} has token ids {bad[:5]} outside the vocabulary [0, {vocab})")


NO_LENGTH_LIMIT = int(1e30)  # transformers' own "no limit" value (VERY_LARGE_INTEGER)


def _lift_length_limit(tokenizer) -> None:
    """The engine holds prompts to max_model_len itself and says so clearly (the scheduler's
    "prompt has N tokens; max_model_len is M" error); a transformers tokenizer's own limit,
    model_max_length, would only log "Token indices sequence length is longer than the
    specified maximum sequence length" on encoding a longer prompt, before that error or for
    a prompt that max_model_len allows. Nothing here truncates to it, so it is lifted."""
    if isinstance(getattr(tokenizer, "model_max_length", None), int):
        tokenizer.model_max_length = NO_LENGTH_LIMIT
