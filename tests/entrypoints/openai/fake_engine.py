"""A fake LLMEngine with hand-computable outputs, for testing the server without a model.

Vocabulary (a WordLevel tokenizer built in-process): 4 special tokens, the role words and
`w0` .. `w99`. Greedy output counts up from the last `wK` in the prompt: `w(K+1) w(K+2) ...`
(from `w0` when the prompt has none); after `w99` comes EOS, after EOS `w0`. With
temperature > 0 words are drawn from `random.Random(f"{seed}-{index}")`. Completion i of
n starts i words later. Logprobs: the sampled token -0.5, then token+1: -1.0, token+2:
-2.0, ... Prompt logprobs (SamplingParams.prompt_logprobs=k): at prompt position i >= 1
the "prediction" p = successor of token i-1 has -0.5, token p+j (j >= 1, mod the vocabulary)
-j; an entry holds the top k (p .. p+k-1) and the prompt's own token; they come with the
request's first output.
max_tokens=0 finishes at the first step with no tokens ("length"). Beam search: beam i is the
greedy output shifted i words (as completion i of n), cum_logprob -0.5 per token - i, best
first; it finishes after as many steps as its longest beam has tokens. `grammar_compiler`
(None: none) is what the server compiles structured outputs with. Each request reserves
n * ceil((prompt + max_tokens) / block_size) blocks while it runs, and gets one token per
sequence per step. With `output_deltas` (the server sets it)
each output carries only what is new, as LLMEngine's do.
"""
from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from pagedjax.core.beam_search import BeamSearchOutput, BeamSearchParams, BeamSequence
from pagedjax.outputs import CompletionOutput, RequestOutput
from pagedjax.sampling_params import SamplingParams

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["system", "user", "assistant"] + [f"w{i}" for i in range(100)]
EOS = 1
VOCAB_SIZE = len(SPECIALS) + len(WORDS)
W0 = len(SPECIALS) + 3  # id of w0
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tokenizer():
    """A tiny whitespace WordLevel tokenizer with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(SPECIALS + WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE)


class FakeGrammarCompiler:
    """Stands in for LLMEngine.grammar_compiler: records what it compiles (and on which
    thread) and rejects the regex "(" and JSON schemas of type "bogus"."""

    def __init__(self) -> None:
        self.compiled: list = []
        self.threads: set[str] = set()

    def compile(self, spec):
        self.threads.add(threading.current_thread().name)
        if spec.regex == "(" or (isinstance(spec.json, dict) and spec.json.get("type") == "bogus"):
            raise ValueError("invalid regex or JSON schema (fake compiler)")
        self.compiled.append(spec)
        return object()


def next_token(tid: int) -> int:
    """The greedy successor: w(K) -> w(K+1), w99 -> EOS, EOS -> w0."""
    if tid == EOS:
        return W0
    if tid == W0 + 99:
        return EOS
    return tid + 1


@dataclass
class _Seq:
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass
class _Req:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    blocks: int
    seqs: list[_Seq]
    rngs: list[random.Random]
    sent_prompt_logprobs: bool = False
    beam: BeamSearchParams | None = None
    steps: int = 0  # beam search: steps run


class FakeEngine:
    """Implements the LLMEngine interface the server codes against."""

    def __init__(self, max_model_len: int = 256, block_size: int = 4, num_blocks: int = 1024,
                 max_num_seqs: int = 64, step_delay: float = 0.0, stats_delay: float = 0.0,
                 grammar_compiler=None) -> None:
        self.tokenizer = make_tokenizer()
        self.model_name = "fake-model"
        self.max_model_len, self.block_size, self.num_blocks = max_model_len, block_size, num_blocks
        self.max_num_seqs, self.step_delay, self.stats_delay = max_num_seqs, step_delay, stats_delay
        self.free_blocks = num_blocks
        self.waiting: deque[_Req] = deque()
        self.running: dict[str, _Req] = {}
        self.added: list[str] = []
        self.aborted: list[str] = []
        self.params: dict[str, SamplingParams] = {}
        self.threads: set[int] = set()  # threads that called into the engine (must be one)
        self.fail_next_step = False
        self.num_steps = 0
        self.output_deltas = False
        self.cache_salts: dict[str, str | None] = {}
        self.grammar_compiler = grammar_compiler
        self.beam_params: dict[str, BeamSearchParams] = {}
        self.finished_beam_searches: dict[str, BeamSearchOutput] = {}

    def _touch(self) -> None:
        self.threads.add(threading.get_ident())

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    cache_salt: str | None = None) -> None:
        self._touch()
        self.cache_salts[request_id] = cache_salt
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("empty prompt")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens is too long for max_model_len {self.max_model_len}")
        blocks = params.n * math.ceil(min(len(ids) + params.max_tokens, self.max_model_len) / self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(f"request needs {blocks} KV blocks, the pool has {self.num_blocks}: it can never fit")
        rngs = [random.Random(f"{params.seed}-{i}") if params.seed is not None else random.Random()
                for i in range(params.n)]
        self.waiting.append(_Req(request_id, ids, params, blocks, [_Seq(i) for i in range(params.n)], rngs))
        self.added.append(request_id)
        self.params[request_id] = params

    def add_beam_search(self, request_id: str, prompt: str | list[int], params: BeamSearchParams) -> None:
        self._touch()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids or len(ids) >= self.max_model_len:
            raise ValueError("the prompt is empty or too long")
        blocks = params.beam_width * math.ceil(min(len(ids) + params.max_tokens, self.max_model_len) / self.block_size)
        self.waiting.append(_Req(request_id, ids, SamplingParams(max_tokens=params.max_tokens), blocks, [], [],
                                 beam=params))
        self.added.append(request_id)
        self.beam_params[request_id] = params

    def abort_request(self, request_id: str) -> None:
        self._touch()
        req = self.running.pop(request_id, None)
        if req is not None:
            self.free_blocks += req.blocks
        else:
            before = len(self.waiting)
            self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
            if len(self.waiting) == before:
                return
        self.aborted.append(request_id)

    def has_unfinished_requests(self) -> bool:
        self._touch()
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        self._touch()
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected engine failure")
        while self.waiting and len(self.running) < self.max_num_seqs and self.waiting[0].blocks <= self.free_blocks:
            req = self.waiting.popleft()
            self.free_blocks -= req.blocks
            self.running[req.request_id] = req
        if self.running:  # as LLMEngine's: counts the steps that ran a batch
            self.num_steps += 1
        outputs = []
        for req in list(self.running.values()):
            if req.beam is not None:
                self._beam_step(req)
                continue
            for seq in req.seqs:
                if seq.finish_reason is None and req.params.max_tokens == 0:
                    seq.finish_reason = "length"  # scoring: the prompt only
                elif seq.finish_reason is None:
                    self._advance(req, seq)
            finished = all(s.finish_reason for s in req.seqs)
            if finished:
                del self.running[req.request_id]
                self.free_blocks += req.blocks
            plp = None
            if req.params.prompt_logprobs is not None and not (self.output_deltas and req.sent_prompt_logprobs):
                plp, req.sent_prompt_logprobs = self._prompt_logprobs(req), True
            outputs.append(RequestOutput(req.request_id, None, list(req.prompt_token_ids),
                                         [self._output(req, s) for s in req.seqs], finished=finished,
                                         prompt_logprobs=plp))
        return outputs

    def _prompt_logprobs(self, req: _Req) -> list[dict[int, float] | None]:
        k, ids = req.params.prompt_logprobs, req.prompt_token_ids
        out: list[dict[int, float] | None] = [None]
        for prev, tid in zip(ids, ids[1:]):
            p = next_token(prev)
            entry = {(p + j) % VOCAB_SIZE: -float(j) or -0.5 for j in range(k)}
            entry[tid] = -float((tid - p) % VOCAB_SIZE) or -0.5
            out.append(entry)
        return out

    def _beam_step(self, req: _Req) -> None:
        p = req.beam
        beams = []
        for i in range(p.beam_width):
            words = [t for t in req.prompt_token_ids if t >= W0]
            tid = next_token(words[-1]) if words else W0
            for _ in range(i):
                tid = next_token(tid)
            tokens: list[int] = []
            while len(tokens) < p.max_tokens and len(req.prompt_token_ids) + len(tokens) < self.max_model_len:
                tokens.append(tid)
                if tid == EOS and not p.ignore_eos:
                    break
                tid = next_token(tid)
            beams.append(tokens)
        req.steps += 1
        if req.steps < max(len(b) for b in beams):
            return
        seqs = []
        for i, tokens in enumerate(beams):
            cum = -0.5 * len(tokens) - i
            reason = "stop" if tokens[-1] == EOS and not p.ignore_eos else "length"
            seqs.append(BeamSequence(tokens, cum, cum / len(tokens) ** p.length_penalty, reason,
                                     self.tokenizer.decode([t for t in tokens if t >= W0])))
        seqs.sort(key=lambda s: -s.score)
        del self.running[req.request_id]
        self.free_blocks += req.blocks
        self.finished_beam_searches[req.request_id] = BeamSearchOutput(req.request_id, list(req.prompt_token_ids),
                                                                       seqs)

    def _output(self, req: _Req, s: _Seq) -> CompletionOutput:
        a, c = (s.sent_tokens, s.sent_chars) if self.output_deltas else (0, 0)
        s.sent_tokens, s.sent_chars = len(s.token_ids), len(s.text)
        return CompletionOutput(s.index, s.text[c:], s.token_ids[a:], s.finish_reason,
                                s.logprobs[a:] if req.params.logprobs is not None else None, s.stop_reason)

    def _advance(self, req: _Req, seq: _Seq) -> None:
        p = req.params
        if p.temperature > 0:
            tid = W0 + req.rngs[seq.index].randrange(100)
        elif seq.token_ids:
            tid = next_token(seq.token_ids[-1])
        else:
            words = [t for t in req.prompt_token_ids if t >= W0]
            tid = next_token(words[-1]) if words else W0
            for _ in range(seq.index):
                tid = next_token(tid)
        seq.token_ids.append(tid)
        if p.logprobs is not None:
            seq.logprobs.append({tid: -0.5, **{(tid + j) % VOCAB_SIZE: -float(j) for j in range(1, p.logprobs + 1)}})
        seq.text = self.tokenizer.decode([t for t in seq.token_ids if t >= W0])
        if tid == EOS and not p.ignore_eos:
            seq.finish_reason = "stop"
        elif tid in p.stop_token_ids:
            seq.finish_reason, seq.stop_reason = "stop", tid
        for s in p.stop_strings:
            if s in seq.text:  # cut before it (after it with include_stop_str_in_output)
                seq.text = seq.text[: seq.text.index(s) + (len(s) if p.include_stop_str_in_output else 0)]
                seq.finish_reason, seq.stop_reason = "stop", s
                return
        if seq.finish_reason is None and (len(seq.token_ids) >= p.max_tokens or
                                          len(req.prompt_token_ids) + len(seq.token_ids) >= self.max_model_len):
            seq.finish_reason = "length"

    def stats(self) -> dict:
        self._touch()
        if self.stats_delay:
            time.sleep(self.stats_delay)
        return {"kv_blocks_total": self.num_blocks, "kv_blocks_free": self.free_blocks,
                "num_requests_running": len(self.running), "num_requests_waiting": len(self.waiting),
                "prefix_cache_query_tokens": 0, "prefix_cache_hit_tokens": 0, "num_preemptions": 0,
                "num_compilations": 0}
