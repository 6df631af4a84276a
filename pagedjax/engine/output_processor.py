"""OutputProcessor: the one writer of a request's output tokens, and what the user sees of them.

After each step it appends the tokens a request produced, checks them one by one (EOS, stop
tokens, max_tokens, max_model_len, a grammar that completed, stop strings in the text) and
drops any a step produced past the one that ended the request (speculative drafts), keeps
the logprobs and the incrementally detokenized text, and builds RequestOutputs: cumulative,
or only what is new since the previous output (`output_deltas`, for streaming).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from pagedjax.core.request import Request, RequestStatus, append_logprobs
from pagedjax.engine.detokenizer import IncrementalDetokenizer
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sample import prompt_logprobs
from pagedjax.sampling_params import SamplingParams


@dataclass(slots=True, eq=False)
class _Sequence:
    """Text state of one output sequence."""

    req: Request
    index: int
    detok: IncrementalDetokenizer | None
    constrained: bool = False  # has a token mask (StructuredOutputManager), which a completed grammar ends
    text: str = ""
    sent_tokens: int = 0  # output_deltas: tokens (and logprobs) already returned
    sent_chars: int = 0  # output_deltas: characters of text already returned


@dataclass(slots=True, eq=False)
class _Group:
    """A user request: its n sequences share the prompt."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[_Sequence] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # params.prompt_logprobs: one per prompt token
    prompt_logprobs_sent: bool = False

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.req.status is not RequestStatus.FINISHED:
                return False
        return True


class OutputProcessor:
    def __init__(self, tokenizer, schedulers, masks, stream_text: bool):
        """schedulers: one per data-parallel rank (they finish requests); masks: the
        StructuredOutputManager (a completed grammar stops its sequence). stream_text: keep
        every request's text up to date each step and return outputs of unfinished requests
        too; off, text is decoded once at the end."""
        self.tokenizer = tokenizer
        self.schedulers = schedulers
        self.masks = masks
        self.stream_text = stream_text
        # True: each RequestOutput carries only what is new since the request's previous output
        # (text, token ids, logprobs), so a step costs O(new tokens), not O(output length)
        self.output_deltas = False
        self.groups: dict[str, _Group] = {}
        self._seq_of: dict[str, _Sequence] = {}
        self._group_of: dict[str, _Group] = {}
        self.num_generated_tokens = 0

    def add(self, request_id: str, prompt: str | None, reqs: list[Request]) -> None:
        """Tracks a user request whose sequences (n of them) are `reqs`."""
        params, ids = reqs[0].params, reqs[0].prompt_token_ids
        group = _Group(request_id, prompt, list(ids), params)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(ids)
        incremental = (self.tokenizer is not None and params.detokenize
                       and (self.stream_text or bool(params.stop_strings)))
        for i, req in enumerate(reqs):
            seq = _Sequence(req, i, IncrementalDetokenizer(self.tokenizer, ids) if incremental else None,
                            params.uses_token_mask)
            group.seqs.append(seq)
            self._seq_of[req.request_id] = seq
            self._group_of[req.request_id] = group
        self.groups[request_id] = group

    def pop(self, request_id: str) -> list[Request]:
        """Stops tracking a user request; returns its sequences."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return []
        for seq in group.seqs:
            self._seq_of.pop(seq.req.request_id, None)
            self._group_of.pop(seq.req.request_id, None)
        return [seq.req for seq in group.seqs]

    def any_params(self, predicate) -> bool:
        return any(predicate(g.params) for g in self.groups.values())

    # -- after a step ---------------------------------------------------------------------
    @staticmethod
    def append(req: Request, tokens: list[int]) -> None:
        """A step's tokens for req (placeholders while async scheduling has them on the device)."""
        req.output_token_ids += tokens

    @staticmethod
    def append_produced(produced) -> None:
        """`append` of each (request, entry, tokens) Scheduler.update returned (None: nothing produced)."""
        for req, _, tokens in produced:
            if tokens is not None:
                req.output_token_ids += tokens

    @staticmethod
    def fill_placeholders(produced, result) -> None:
        """Puts the step's sampled tokens where placeholders were appended."""
        for req, row, tokens in produced:
            if tokens is not None:
                tokens[0] = req.output_token_ids[-1] = int(result.tokens[row])
                req.pending_row = -1

    def collect_prompt_logprobs(self, outs, plp) -> None:
        """Stores the prompt logprobs the step computed for the requests that asked."""
        t = len(plp.logprobs) // len(outs)
        for rank, out in enumerate(outs):
            if out is None:
                continue
            off = rank * t
            for req, start, q in zip(out.requests, out.starts, out.q_lens):
                group = self._group_of.get(req.request_id)
                if group is not None and group.prompt_logprobs is not None and start < req.num_prompt_tokens:
                    for pos, entry in prompt_logprobs.entries(plp, off, range(start, start + q), req.prompt_token_ids,
                                                              req.params.prompt_logprobs, req.prompt_logprobs_from):
                        group.prompt_logprobs[pos] = entry
                off += q

    def process(self, produced, result) -> tuple[list[RequestOutput], list[Request]]:
        """Stop checks, logprobs, grammars and text for the tokens a step produced (beams
        aside: BeamSearchManager). Returns the outputs to report and the sequences of the
        requests that finished (no longer tracked)."""
        touched: dict[int, _Group] = {}  # id -> group, in order of first appearance
        now = time.monotonic()
        group_of, seq_of, finished_status = self._group_of, self._seq_of, RequestStatus.FINISHED
        generated = 0  # tokens of the fast path below (the general one counts its own)
        for req, row, tokens in produced:
            if req.beam_group is not None or req.pooling is not None:  # beams, embeddings: their own managers
                continue
            group = group_of[req.request_id]
            touched[id(group)] = group
            if tokens is None:  # max_tokens=0: the prompt is scored, nothing generated
                continue
            if req.first_token_time is None:
                req.first_token_time = now
            seq = seq_of[req.request_id]
            if len(tokens) == 1 and seq.detok is None and not seq.constrained and req.status is not finished_status:
                # most tokens: one, no text to keep, no mask; check_stop only where one of its
                # conditions can hold (EOS, a stop token, max_tokens, max_model_len: its tests, as a pre-check)
                token, p = tokens[0], req.params
                if p.logprobs is not None:
                    append_logprobs(req, result, row, token)
                n = len(req.output_token_ids)
                sched = self.schedulers[req.dp_rank]
                if (n >= p.max_tokens or len(req.prompt_token_ids) + n >= sched.max_model_len
                        or token in p.stop_token_ids or (not p.ignore_eos and token in req.eos_token_ids)):
                    sched.check_stop(req, token, n)
                generated += 1
                continue
            before = len(req.output_token_ids) - len(tokens)
            for j, token in enumerate(tokens):  # several with speculative decoding
                if req.is_finished:  # ended by an earlier token of this step: the rest never happened
                    del req.output_token_ids[len(req.output_token_ids) - (len(tokens) - j):]
                    break
                append_logprobs(req, result, row + j, token)
                self.num_generated_tokens += 1
                sched = self.schedulers[req.dp_rank]
                sched.check_stop(req, token, before + j + 1)
                if seq.constrained and not self.masks.accept(req, token) and not req.is_finished:
                    sched.finish(req, "stop")
                if seq.detok is not None:
                    self._append_text(seq, token)
        self.num_generated_tokens += generated
        outputs, finished = [], []
        for g in touched.values():
            done = g.finished
            if self.stream_text or done:  # offline (stream_text off) callers only read finished outputs
                outputs.append(self._output(g))
            if done and g.request_id in self.groups:
                finished += self.pop(g.request_id)
        return outputs, finished

    def _append_text(self, seq: _Sequence, token: int) -> None:
        """Adds the token's text; a stop string ends the sequence and is cut from the text (the
        text ends after it with include_stop_str_in_output)."""
        before = len(seq.detok.text)
        seq.detok.add(token)
        stops = seq.req.params.stop_strings
        if not stops:
            return
        text = seq.detok.text
        lo = max(0, before - max(len(s) for s in stops) + 1)
        hits = [(pos, s) for s in stops if (pos := text.find(s, lo)) >= 0]
        if not hits:
            return
        pos, stop = min(hits)
        seq.detok.text = text[:pos + len(stop) if seq.req.params.include_stop_str_in_output else pos]
        if seq.req.is_finished:  # finished by length on the same token: the stop string wins
            seq.req.finish_reason, seq.req.stop_reason = "stop", stop
        else:
            self.schedulers[seq.req.dp_rank].finish(seq.req, "stop", stop)

    def _text(self, seq: _Sequence) -> str:
        req = seq.req
        if seq.detok is None:
            if not req.is_finished or self.tokenizer is None or not req.params.detokenize:
                return ""
            if not seq.text:
                seq.text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            return seq.text
        text = seq.detok.text
        stops = req.params.stop_strings
        if stops and not req.is_finished and not req.params.include_stop_str_in_output:
            # hold back what could be the start of a stop string (kept stop strings are shown anyway)
            text = text[:max(0, len(text) - max(len(s) for s in stops) + 1)]
        return text

    def _output(self, g: _Group) -> RequestOutput:
        want_logprobs = g.params.logprobs is not None
        outs = []
        for s in g.seqs:
            req, text = s.req, self._text(s)
            tokens, logprobs = req.output_token_ids, req.output_logprobs
            if self.output_deltas:
                text, tokens, logprobs = text[s.sent_chars:], tokens[s.sent_tokens:], logprobs[s.sent_tokens:]
                s.sent_chars, s.sent_tokens = s.sent_chars + len(text), len(req.output_token_ids)
            else:
                tokens, logprobs = list(tokens), list(logprobs)
            outs.append(CompletionOutput(s.index, text, tokens, req.finish_reason,
                                         logprobs if want_logprobs else None, req.stop_reason))
        prompt_lps = None
        if g.prompt_logprobs is not None and not (self.output_deltas and g.prompt_logprobs_sent) \
                and (g.finished or g.seqs[0].req.num_computed_tokens >= len(g.prompt_token_ids)):
            prompt_lps, g.prompt_logprobs_sent = list(g.prompt_logprobs), True
        return RequestOutput(g.request_id, g.prompt, g.prompt_token_ids, outs, g.finished,
                             g.seqs[0].req.num_cached_tokens, prompt_lps)

