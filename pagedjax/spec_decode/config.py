"""`speculative_config`: which proposer drafts, how many drafts, and its checks."""
from __future__ import annotations

from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16
MAX_IDLE_SPECULATIVE_TOKENS = 64  # the most idle_speculative_tokens may be


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config`: prompt lookup, {"method": "ngram", "num_speculative_tokens":
    k, "prompt_lookup_min": a, "prompt_lookup_max": b}, or a draft model, {"model": path,
    "num_speculative_tokens": k} (method "draft_model"; see draft_model.py). A draft model
    proposes up to k drafts a step, fewer or none while it costs more than its accepted
    drafts save (`draft_depth`); "adaptive": False makes it always propose k.

    Prompt lookup proposes up to "idle_speculative_tokens" drafts (default
    MAX_SPECULATIVE_TOKENS, at least k): a step verifies up to k of a request's drafts as
    the allocation weighs them against step costs, and more only in rows its token bucket
    would pad anyway (when few requests remain: `allocate_drafts`' idle_caps); k turns
    that off."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    method: str = "ngram"
    model: str | None = None  # the draft model (method "draft_model")
    adaptive: bool = True  # draft model: the number of drafts follows their measured worth
    # prompt lookup: drafts per request, beyond k, in rows the step's bucket pads anyway (None: k)
    idle_speculative_tokens: int | None = None

    @property
    def proposal_depth(self) -> int:
        """Drafts a proposer gives each request: k, or idle_speculative_tokens."""
        return max(self.num_speculative_tokens, self.idle_speculative_tokens or 0)

    @classmethod
    def parse(cls, config) -> "SpeculativeConfig | None":
        """From a dict (or None: no speculation), with clear errors."""
        if config is None or isinstance(config, SpeculativeConfig):
            return config
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict, got {type(config).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "adaptive",
                 "idle_speculative_tokens"}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; this engine knows {sorted(known)}")
        method = config.get("method", "draft_model" if config.get("model") is not None else "ngram")
        if method not in ("ngram", "prompt_lookup", "draft_model"):
            raise ValueError(f"speculative_config: method {method!r} is not supported; use 'ngram' (prompt lookup) "
                             "or 'draft_model' (with 'model')")
        if "num_speculative_tokens" not in config:
            raise ValueError("speculative_config needs num_speculative_tokens")
        k = config["num_speculative_tokens"]
        _check_positive("num_speculative_tokens", k)
        if k > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}")
        if method == "draft_model":
            model = config.get("model")
            if not isinstance(model, str) or not model:
                raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft checkpoint's path")
            lookup = sorted({"prompt_lookup_min", "prompt_lookup_max", "idle_speculative_tokens"} & set(config))
            if lookup:
                raise ValueError(f"speculative_config: {lookup} apply to method 'ngram', not to a draft model")
            adaptive = config.get("adaptive", True)
            if not isinstance(adaptive, bool):
                raise ValueError(f"speculative_config: adaptive must be true or false, got {adaptive!r}")
            return cls(k, method="draft_model", model=model, adaptive=adaptive)
        if config.get("model") is not None:
            raise ValueError(f"speculative_config: 'model' (a draft model) does not go with method {method!r}")
        if "adaptive" in config:
            raise ValueError("speculative_config: 'adaptive' applies to a draft model (prompt lookup costs "
                             "nothing to propose; its verification is weighed each step anyway)")
        lo = config.get("prompt_lookup_min", min(2, config.get("prompt_lookup_max", 4)))
        hi = config.get("prompt_lookup_max", max(4, lo))
        _check_positive("prompt_lookup_min", lo)
        _check_positive("prompt_lookup_max", hi)
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        idle = config.get("idle_speculative_tokens", max(k, MAX_SPECULATIVE_TOKENS))
        _check_positive("idle_speculative_tokens", idle)
        if not k <= idle <= MAX_IDLE_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: idle_speculative_tokens must be between num_speculative_tokens "
                             f"({k}) and {MAX_IDLE_SPECULATIVE_TOKENS}, got {idle}")
        return cls(k, lo, hi, "ngram", idle_speculative_tokens=idle)


def _check_positive(name: str, v) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"speculative_config: {name} must be a positive integer, got {v!r}")
