"""Per-request sampling settings."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top-k log-probabilities the step always computes; requests may ask up to this
DEFAULT_MAX_TOKENS = 64  # SamplingParams().max_tokens
MAX_INT32 = 2**31 - 1  # top_k, max_tokens and token ids travel to the device as int32
MIN_TEMPERATURE = 1e-2  # smaller positive temperatures are raised to it (logits / t overflows below)
MAX_STOP_STRINGS = 64  # each is matched against every new token's text
MAX_STOP_LENGTH = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries of logit_bias
MAX_BIAS = 100.0  # |logit_bias value|, as OpenAI bounds it
MAX_TOKEN_LISTS = 1024  # entries of allowed_token_ids / bad_words
MAX_REPETITION_PENALTY = 100.0


@dataclass(slots=True, frozen=True)
class StructuredOutputsParams:
    """Constrains a request's output to a grammar; exactly one field is set.

    json: a JSON schema (dict or JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: one of these strings; grammar: a Lark
    grammar (llguidance's dialect, which also takes GBNF-style rules)."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            choice = tuple(self.choice)
            if not choice or any(not isinstance(c, str) for c in choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", choice)
        set_fields = [n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None]
        set_fields += ["json_object"] if self.json_object else []
        if len(set_fields) != 1:
            raise ValueError("structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {set_fields or 'none'}")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise ValueError(f"structured_outputs.{name} must be a string")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("structured_outputs.json must be a JSON schema (an object or its JSON text)")

    def key(self) -> str:
        """A stable digest of the constraint (compiled grammars are cached by it)."""
        import hashlib
        import json as _json

        kind = next(n for n in ("json", "regex", "choice", "grammar") if getattr(self, n) is not None) \
            if not self.json_object else "json_object"
        value = getattr(self, kind)
        text = kind + ":" + (_json.dumps(value, sort_keys=True) if not isinstance(value, str) else value)
        return hashlib.sha256(text.encode()).hexdigest()


def context_length_message(max_model_len: int, num_prompt: int, max_tokens: int, param: str = "max_tokens") -> str:
    """Why a request asking for `max_tokens` after a `num_prompt`-token prompt cannot run: the
    one wording of the Python API's ValueError and the server's 400."""
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for the completion). "
            f"Reduce the prompt or `{param}`.")


@dataclass(slots=True)
class SamplingParams:
    """How to sample one request's output (greedy when temperature == 0)."""

    # None: DEFAULT_MAX_TOKENS, held to the room the prompt leaves below max_model_len; a
    # number given is a promise: more than that room is an error (as the server's 400)
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    # raw model log-probabilities of every prompt token (the first has none): the top k and
    # the prompt's own token; a request asking for them never reads the prefix cache
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0  # OpenAI: minus this once for every token generated so far
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # transformers: prompt and output tokens' logits / p (x p if < 0)
    logit_bias: dict[int, float] | None = None  # added to the logits, in [-100, 100]
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are out
    bad_words: list[str] | None = None  # never generated (their last token is masked after the rest)
    allowed_token_ids: list[int] | None = None  # only these may be generated
    structured_outputs: StructuredOutputsParams | None = None
    detokenize: bool = True  # False: token ids (and logprobs) only, no text (RL rollouts)
    include_stop_str_in_output: bool = False  # a stop string that ended the output stays in its text
    # keep only the last k prompt tokens (-1: the last max_model_len); None: the whole prompt
    truncate_prompt_tokens: int | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False, default=())
    # max_tokens came from the caller (not the default): set by __post_init__, not compared
    max_tokens_given: bool = field(init=False, repr=False, compare=False, default=False)

    def held_to_room(self) -> "SamplingParams":
        """These params with their max_tokens as a default, not a promise: held to the room a
        prompt leaves below max_model_len instead of an error (generation-config defaults,
        flags not given, a library's own settings). Returns self."""
        self.max_tokens_given = False
        return self

    def __post_init__(self) -> None:
        """Checks every field against what the engine can represent: a request that passes
        can never make a step fail."""
        self.max_tokens_given = self.max_tokens is not None
        if self.max_tokens is None:
            self.max_tokens = DEFAULT_MAX_TOKENS
        if not _is_int(self.max_tokens) or not 0 <= self.max_tokens <= MAX_INT32:
            raise ValueError(f"max_tokens must be an integer in [0, {MAX_INT32}], got {self.max_tokens!r}")
        if not isinstance(self.detokenize, bool):
            raise ValueError(f"detokenize must be True or False, got {self.detokenize!r}")
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be True or False, got "
                             f"{self.include_stop_str_in_output!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or 1 <= k <= MAX_INT32)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 (keep the prompt's last k tokens) "
                             f"or -1 (the last max_model_len), got {k!r}")
        if not self.detokenize and self.stop:
            raise ValueError("stop strings are matched in the text: they need detokenize=True")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens may be 0 only with prompt_logprobs (scoring a prompt)")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_int(self.top_k) or not 0 <= self.top_k <= MAX_INT32:
            raise ValueError(f"top_k must be 0 (off), -1 (off) or an integer in [1, {MAX_INT32}], got {self.top_k!r}")
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be an integer between 0 and {MAX_LOGPROBS}, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise ValueError(f"prompt_logprobs must be an integer between 0 and {MAX_LOGPROBS}, "
                             f"got {self.prompt_logprobs!r}")
        self._check_logits_processors()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        stops = tuple(self.stop or ())
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(stops)}")
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        if any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"stop strings may be at most {MAX_STOP_LENGTH} characters long")
        self.stop_strings = stops
        self.stop_token_ids = list(self.stop_token_ids or [])
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids are allowed, got {len(self.stop_token_ids)}")
        if any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be integers in [0, {MAX_INT32}]")

    def _check_logits_processors(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_real(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be a number in (0, {MAX_REPETITION_PENALTY:g}], got {r!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias must be a mapping of at most {MAX_LOGIT_BIAS} token ids to biases")
            bias = {}
            for t, b in self.logit_bias.items():
                if isinstance(t, str) and t.strip().lstrip("-").isdigit():
                    t = int(t)  # JSON object keys are strings
                if not _is_int(t) or not 0 <= t <= MAX_INT32:
                    raise ValueError(f"logit_bias keys must be token ids in [0, {MAX_INT32}], got {t!r}")
                if not _is_real(b) or not -MAX_BIAS <= b <= MAX_BIAS:
                    raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {b!r} for token {t}")
                bias[int(t)] = float(b)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = list(self.allowed_token_ids)
            if not ids or len(ids) > MAX_TOKEN_LISTS or any(not _is_int(t) or not 0 <= t <= MAX_INT32 for t in ids):
                raise ValueError(f"allowed_token_ids must be a non-empty list of at most {MAX_TOKEN_LISTS} "
                                 f"token ids in [0, {MAX_INT32}]")
            self.allowed_token_ids = [int(t) for t in ids]
        if self.bad_words is not None:
            words = list(self.bad_words)
            if len(words) > MAX_TOKEN_LISTS or any(not isinstance(w, str) or not w or len(w) > MAX_STOP_LENGTH
                                                   for w in words):
                raise ValueError(f"bad_words must be a list of at most {MAX_TOKEN_LISTS} non-empty strings of "
                                 f"at most {MAX_STOP_LENGTH} characters")
            self.bad_words = words or None
        so = self.structured_outputs
        if isinstance(so, dict):
            self.structured_outputs = so = StructuredOutputsParams(**so)
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        """Needs the per-request token counts and bias kept on the device."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.logit_bias is not None)

    @property
    def uses_token_mask(self) -> bool:
        """Needs a host-built mask of allowed tokens each step."""
        return (self.min_tokens > 0 or self.bad_words is not None or self.allowed_token_ids is not None
                or self.structured_outputs is not None)


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
