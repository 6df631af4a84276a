"""Beam search inside the scheduler: beams are forked requests sharing KV blocks.

Each round every live beam decodes one token in the same engine step; the group then keeps
the best `beam_width` continuations. A kept continuation forks its parent beam (all blocks
shared, reference counts up; the partly filled last block is copied only when written), and
the old beams drop their references at once. Selection follows transformers' beam search
(no sampling): 2 x beam_width candidates per round, finished hypotheses scored
sum_logprobs / generated_len ** length_penalty, and its early-stopping rules.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from pagedjax.core.request import Request, append_logprobs
from pagedjax.sampling_params import DEFAULT_MAX_TOKENS, MAX_LOGPROBS, SamplingParams


@dataclass(slots=True)
class BeamSearchParams:
    beam_width: int
    max_tokens: int | None = None  # as SamplingParams.max_tokens: None is 64 held to the room left
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True, False or "never", as in transformers
    ignore_eos: bool = False
    max_tokens_given: bool = field(init=False, repr=False, compare=False, default=False)

    def __post_init__(self) -> None:
        self.max_tokens_given = self.max_tokens is not None
        if self.max_tokens is None:
            self.max_tokens = DEFAULT_MAX_TOKENS
        if not isinstance(self.beam_width, int) or not 1 <= self.beam_width <= MAX_LOGPROBS // 2:
            raise ValueError(f"beam_width must be an integer in [1, {MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass(slots=True)
class BeamSequence:
    token_ids: list[int]
    cum_logprob: float
    score: float  # cum_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" (EOS) or "length"
    text: str = ""


@dataclass(slots=True)
class BeamSearchOutput:
    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSequence] = field(default_factory=list)  # best first


@dataclass(slots=True, eq=False)
class _Beam:
    req: Request
    cum_logprob: float


class BeamGroup:
    """The live beams and finished hypotheses of one prompt."""

    def __init__(self, request_id: str, prompt_ids: list[int], params: BeamSearchParams, eos_ids: tuple[int, ...]):
        self.request_id = request_id
        self.params = params
        self.eos_ids = () if params.ignore_eos else tuple(eos_ids)
        self.prompt_ids = prompt_ids
        self._ids = itertools.count()
        self.sampling = SamplingParams(max_tokens=params.max_tokens, temperature=0.0, ignore_eos=True,
                                       logprobs=2 * params.beam_width)
        root = self._new_request()
        root.reserved_seats = params.beam_width - 1
        self.beams = [_Beam(root, 0.0)]
        self.finished: list[tuple[float, list[int], float, str]] = []  # (score, tokens, cum_logprob, reason)
        self.improvable = True  # transformers' early-stop heuristic not yet satisfied
        self.done = False

    def _new_request(self) -> Request:
        req = Request(f"{self.request_id}/beam{next(self._ids)}", list(self.prompt_ids), self.sampling, seed=0)
        req.beam_group = self
        return req

    @property
    def root(self) -> Request:
        return self.beams[0].req

    def ready(self) -> bool:
        """Every live beam has decoded this round's token."""
        return all(len(b.req.output_logprobs) == 1 for b in self.beams)

    def advance(self, scheduler) -> None:
        """Selects the next beams from this round's log-probabilities and forks them."""
        p, w = self.params, self.params.beam_width
        gen_len = len(self.beams[0].req.output_token_ids)
        candidates = []
        for bi, beam in enumerate(self.beams):
            for tok, lp in beam.req.output_logprobs[-1].items():
                candidates.append((beam.cum_logprob + lp, bi, tok))
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:2 * w]
        at_limit = gen_len >= p.max_tokens or self.root.num_tokens >= scheduler.max_model_len
        hits = [at_limit or tok in self.eos_ids for _, _, tok in candidates]
        full = len(self.finished) >= w
        if self.improvable and not (full and p.early_stopping is True):
            for rank, ((score, bi, tok), hit) in enumerate(zip(candidates, hits)):
                if hit and rank < w:
                    tokens = self.beams[bi].req.output_token_ids[:-1] + [tok]
                    reason = "stop" if tok in self.eos_ids else "length"
                    self.finished.append((score / gen_len ** p.length_penalty, tokens, score, reason))
            self.finished.sort(key=lambda f: -f[0])
            del self.finished[w:]
        keep = [c for c, hit in zip(candidates, hits) if not hit][:w]
        if keep:
            best_len = (scheduler.max_model_len if p.early_stopping == "never" and p.length_penalty > 0 else gen_len)
            best_possible = keep[0][0] / best_len ** p.length_penalty
            if len(self.finished) >= w and best_possible <= self.finished[-1][0]:
                self.improvable = False
        all_finished = len(self.finished) >= w and p.early_stopping is True
        if not keep or not self.improvable or all_finished:
            self.done = True
            self.abort(scheduler)
            return
        new_beams = []
        for score, bi, tok in keep:
            child = self._new_request()
            scheduler.fork(self.beams[bi].req, child)
            child.output_token_ids[-1] = tok
            child.output_logprobs = []
            new_beams.append(_Beam(child, score))
        self.abort(scheduler)
        new_beams[0].req.reserved_seats = w - len(new_beams)
        self.beams = new_beams

    def abort(self, scheduler) -> None:
        """Ends every live beam and returns its blocks (the finished hypotheses stay)."""
        for beam in self.beams:
            scheduler.finish(beam.req, "abort")

    def output(self, tokenizer) -> BeamSearchOutput:
        seqs = [BeamSequence(tokens, cum, score, reason,
                             tokenizer.decode(tokens, skip_special_tokens=True) if tokenizer else "")
                for score, tokens, cum, reason in self.finished]
        return BeamSearchOutput(self.request_id, self.prompt_ids, seqs)


class BeamSearchManager:
    """The engine's one object for beam searches (created at the first one): their groups,
    each round's selection once all of a group's beams have decoded, the finished results."""

    def __init__(self, schedulers, tokenizer):
        self.schedulers = schedulers  # one per data-parallel rank
        self.tokenizer = tokenizer
        self.groups: dict[str, BeamGroup] = {}
        self.finished: dict[str, BeamSearchOutput] = {}  # request id -> result, until the caller pops it
        self.num_generated_tokens = 0

    def add(self, group: BeamGroup, rank: int) -> None:
        """Queues a beam search's root on its data-parallel rank (DataParallelRouter.route)."""
        self.schedulers[rank].add(group.root)
        self.groups[group.request_id] = group

    def process(self, produced, result) -> None:
        """Records the beams' tokens of a step; a group whose beams all decoded selects."""
        touched: dict[int, BeamGroup] = {}
        for req, row, tokens in produced:
            if req.beam_group is not None and tokens is not None:
                append_logprobs(req, result, row, tokens[0])
                touched[id(req.beam_group)] = req.beam_group
        for bg in touched.values():
            if bg.ready():
                bg.advance(self.schedulers[bg.root.dp_rank])
                self.num_generated_tokens += len(bg.beams)
                if bg.done:
                    self.groups.pop(bg.request_id, None)
                    self.finished[bg.request_id] = bg.output(self.tokenizer)

    def abort(self, request_id: str) -> None:
        group = self.groups.pop(request_id, None)
        if group is not None:
            group.abort(self.schedulers[group.root.dp_rank])
