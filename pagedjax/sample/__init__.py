"""On-device sampling and the logits processors (penalties, token masks, prompt logprobs)."""
