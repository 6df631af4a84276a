"""The prompts `LLM.generate` (and embed, beam_search) take, as vLLM's: a string, token ids,
`{"prompt": str}` or `{"prompt_token_ids": [...]}` (either with an optional `cache_salt`),
one of them or a list mixing them."""
from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Union

TEXT_KEYS = {"prompt", "cache_salt"}  # vLLM's TextPrompt (text-only)
TOKENS_KEYS = {"prompt_token_ids", "cache_salt"}  # vLLM's TokensPrompt (text-only)
PromptInput = Union[str, Sequence[int], Mapping[str, Any]]  # one prompt, as generate takes it
MULTIMODAL_KEYS = {"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids", "token_type_ids", "prompt_embeds"}


@dataclass(slots=True, frozen=True)
class Prompt:
    """One prompt: its text or token ids, and the cache salt that keeps its prefix-cache
    entries apart from other tenants' (None: shared)."""

    prompt: str | list[int]
    cache_salt: str | None = None


def _is_token(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool)


def _token_list(p) -> list[int] | None:
    """p as a list of token ids (a sequence or a 1-D array of ints), else None."""
    if getattr(p, "ndim", None) == 1 and hasattr(p, "tolist"):  # numpy / jax arrays
        p = p.tolist()
    if isinstance(p, Sequence) and not isinstance(p, (str, bytes)) and all(_is_token(t) for t in p):
        return [int(t) for t in p]
    return None


def parse_prompt(p, where: str = "prompt") -> Prompt:
    """One prompt as a Prompt; TypeError (wrong type) or ValueError (a dict's keys) naming it."""
    if isinstance(p, str):
        return Prompt(p)
    ids = _token_list(p)
    if ids is not None:
        return Prompt(ids)
    if not isinstance(p, Mapping):
        raise TypeError(f"{where} must be a str, a list of token ids, {{'prompt': str}} or "
                        f"{{'prompt_token_ids': [...]}}, got {type(p).__name__}")
    keys = set(p)
    unsupported = sorted(keys & MULTIMODAL_KEYS)
    if unsupported:
        raise ValueError(f"{where}: {', '.join(unsupported)} {'is' if len(unsupported) == 1 else 'are'} not supported "
                         "(pagedjax serves text-only models): give 'prompt' or 'prompt_token_ids' only")
    if "prompt" in keys and "prompt_token_ids" in keys:
        raise ValueError(f"{where}: give either 'prompt' or 'prompt_token_ids', not both")
    allowed = TOKENS_KEYS if "prompt_token_ids" in keys else TEXT_KEYS
    unknown = sorted(map(repr, keys - allowed))
    if unknown:
        raise ValueError(f"{where}: unknown key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; a prompt dict "
                         "holds 'prompt' (a str) or 'prompt_token_ids' (a list of token ids), and optionally "
                         "'cache_salt'")
    if not keys & {"prompt", "prompt_token_ids"}:
        raise ValueError(f"{where}: a prompt dict needs 'prompt' (a str) or 'prompt_token_ids' (a list of token ids)")
    salt = p.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise TypeError(f"{where}['cache_salt'] must be a non-empty str, got {salt!r:.100}")
    if "prompt" in keys:
        if not isinstance(p["prompt"], str):
            raise TypeError(f"{where}['prompt'] must be a str, got {type(p['prompt']).__name__}")
        return Prompt(p["prompt"], salt)
    ids = _token_list(p["prompt_token_ids"])
    if ids is None:
        raise TypeError(f"{where}['prompt_token_ids'] must be a list of int token ids, got "
                        f"{p['prompt_token_ids']!r:.100}")
    return Prompt(ids, salt)


def parse_prompts(prompts) -> list[Prompt]:
    """`prompts` (one prompt, or a list of them; a flat list of ints is one token-id prompt)
    as a list of Prompts; ValueError for none."""
    if isinstance(prompts, (str, Mapping)) or getattr(prompts, "ndim", None) == 1:
        return [parse_prompt(prompts)]
    if not isinstance(prompts, Sequence) and not hasattr(prompts, "__iter__"):
        raise TypeError(f"prompts must be a str, a list of token ids, a prompt dict or a list of them, got "
                        f"{type(prompts).__name__}")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(_is_token(t) for t in prompts):  # a single token-id prompt
        return [Prompt([int(t) for t in prompts])]
    return [parse_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]
