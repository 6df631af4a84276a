"""StructuredOutputManager: the engine's one object for token masks.

It builds each constrained sequence's TokenMask at admission (grammar matcher, allowed ids,
bad words, min_tokens; sample/token_mask.py), fills the step's bitmask rows while the
device runs the forward pass, and advances each grammar by the sampled token. Requests
without constraints cost nothing: the sampler's bitmask stays all ones.
"""
from __future__ import annotations

import threading

from pagedjax.core.request import Request
from pagedjax.sample.token_mask import MaskRules, TokenMask, mask_needed
from pagedjax.sampling_params import SamplingParams


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], model_name: str):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.model_name = model_name
        self.masks: dict[str, TokenMask] = {}  # request id -> its mask, for constrained sequences
        self._compiler = None
        self._lock = threading.Lock()

    @property
    def grammar_compiler(self):
        """The GrammarCompiler (built at first use; None without a tokenizer). Thread-safe:
        the server compiles a request's grammar before it reaches the engine."""
        if self.tokenizer is None:
            return None
        with self._lock:
            if self._compiler is None:
                from pagedjax.structured_output.grammar import GrammarCompiler

                self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._compiler

    def add(self, seq_ids: list[str], params: SamplingParams) -> None:
        """Builds a TokenMask for each of a request's sequences (their request ids): the
        rules once, a grammar matcher each. Raises ValueError when the request cannot be
        constrained."""
        matcher = None
        if params.structured_outputs is not None:
            if self.grammar_compiler is None:
                raise ValueError(f"{self.model_name} has no tokenizer: structured outputs need one")
            matcher = self.grammar_compiler.matcher(params.structured_outputs)
        rules = MaskRules(params, self.vocab_size, self.eos_token_ids, self.tokenizer)
        if params.ignore_eos:
            rules.min_token_bans = tuple(params.stop_token_ids)
        for i, rid in enumerate(seq_ids):
            self.masks[rid] = TokenMask(rules, matcher if i == 0 or matcher is None else matcher.fork())

    def fill(self, outs, bitmask, rows: int) -> None:
        """Writes the token masks of the step's constrained sequences (the runner calls it
        while the device runs the forward pass); rank r's entry i is row r * rows + i."""
        for rank, out in enumerate(outs):
            if out is None:
                continue
            first = out.row_offsets()
            for i, (req, start, q) in enumerate(zip(out.requests, out.starts, out.q_lens)):
                mask = self.masks.get(req.request_id)
                if mask is not None and start + q >= req.num_tokens and mask_needed(req):
                    mask.fill(bitmask[rank * rows + first[i]], req.output_token_ids)

    def accept(self, req: Request, token: int) -> bool:
        """Advances req's grammar by its sampled token; False: the sequence must stop (its
        grammar is complete, or refused the token, which the mask makes impossible)."""
        mask = self.masks.get(req.request_id)
        if mask is None:
            return True
        return mask.accept(token) and not mask.terminated

    def release(self, req: Request) -> None:
        self.masks.pop(req.request_id, None)
