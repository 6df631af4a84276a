"""CompileAhead: while the background warm-up is still compiling, compiles the step shapes
that the queued work needs before running it, when that pays for itself.

Right after start-up only the smallest rung (T = 8) is compiled, and every step stays within
the compiled rungs: a batch of 16 x 128-token prompts handed over at once would prefill 8
tokens a step and decode 8 of its 16 rows a step, several times slower than on the rungs it
wants. So before each step, while the warm-up runs, the engine asks `plan()` which of the
two rungs the queued work wants (the decode rung of its rows, the prompt rung of its pending
prompt tokens) are worth compiling now, in the foreground, out of the warm-up's order; a
step then runs on the smallest compiled rung that holds it (ModelRunner.step_rung).

The estimate (`work_seconds`) counts steps: a step of T tokens costs about
t_B * (T + FIXED_TOKENS) / (B + FIXED_TOKENS), from the measured time t_B of a step on a
compiled rung B; a compile costs what the compiles so far took. A rung is compiled when the
work's estimated time falls by more than its compile takes. One small request compiles
nothing (quick start stays quick); a large batch compiles its one or two rungs first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

FIXED_TOKENS = 32  # a step's fixed cost (weights read, launch, sampler), in tokens' worth of work
DEFAULT_COMPILE_SECONDS = 2.0  # until one compile has been timed


@dataclass(frozen=True)
class QueuedWork:
    """What the requests of one scheduler still have to run."""

    prompt_tokens: int  # prompt tokens not computed yet
    rows: int  # sequences that will decode at once (at most max_num_seqs)
    decode_tokens: int  # tokens still to generate, summed over the sequences (at most)

    @staticmethod
    def of(scheduler, max_model_len: int) -> "QueuedWork":
        prompt = decode = seqs = 0
        for req in (*scheduler.running, *scheduler.waiting):
            width = 1 + len(req.pending_forks)  # n > 1: the forks decode beside it
            prompt += max(0, req.num_prompt_tokens - req.num_computed_tokens)
            left = min(req.params.max_tokens - len(req.output_token_ids), max_model_len - req.num_tokens)
            decode += width * max(0, left)
            seqs += width
        return QueuedWork(prompt, min(seqs, scheduler.buckets.max_num_seqs), decode)


def work_seconds(work: QueuedWork, rungs: list[int], step_seconds: float, measured_rung: int) -> float:
    """Estimated seconds to run `work` with steps on the compiled `rungs` (sorted), a step of
    the `measured_rung` taking `step_seconds`: the prompt in steps of the largest rung, then
    the decode in steps of the smallest rung holding its rows (or several of the largest)."""
    def cost(t: int) -> float:
        return step_seconds * (t + FIXED_TOKENS) / (measured_rung + FIXED_TOKENS)

    largest = rungs[-1]
    seconds = math.ceil(work.prompt_tokens / largest) * cost(largest)
    if work.rows and work.decode_tokens:
        iterations = work.decode_tokens / work.rows
        rung = next((t for t in rungs if t >= work.rows), None)
        seconds += iterations * (cost(rung) if rung is not None else math.ceil(work.rows / largest) * cost(largest))
    return seconds


def plan(work: QueuedWork, rungs: list[int], wanted: list[int], step_seconds: float, measured_rung: int,
         compile_seconds: float) -> list[int]:
    """The rungs of `wanted` (not yet in `rungs`) worth compiling now: the subset that
    minimises estimated run time plus compile time, if that beats running as is."""
    missing = sorted(set(wanted) - set(rungs))
    best, best_seconds = [], work_seconds(work, rungs, step_seconds, measured_rung)
    for k in range(1, 1 << len(missing)):  # at most two rungs: three subsets
        subset = [t for i, t in enumerate(missing) if k >> i & 1]
        seconds = work_seconds(work, sorted(rungs + subset), step_seconds, measured_rung) \
            + compile_seconds * len(subset)
        if seconds < best_seconds:
            best, best_seconds = subset, seconds
    return best


class CompileAhead:
    """Called before each step while a background warm-up runs (LLMEngine._schedule)."""

    def __init__(self, runner, buckets, max_model_len: int):
        self.runner, self.buckets, self.max_model_len = runner, buckets, max_model_len
        self.wanted_tokens = 0  # the largest rung the queued work wants (0: none queued)

    def wanted(self, work: QueuedWork) -> list[int]:
        """The decode rung of the work's rows and the rung that takes its prompts (with one
        decode token per row) in as few steps as the budget allows."""
        out = [self.buckets.token_bucket(work.rows)] if work.rows else []
        if work.prompt_tokens:
            out.append(self.buckets.token_bucket(min(work.prompt_tokens + work.rows,
                                                     self.buckets.max_num_batched_tokens)))
        return out

    def __call__(self, schedulers) -> list[int]:
        """Compiles the rungs worth compiling for the queued work now; returns them."""
        rungs = self.runner.compiled_shapes
        measured = self.runner.step_seconds
        if not rungs or not measured:
            return []
        works = [QueuedWork.of(s, self.max_model_len) for s in schedulers]
        work = max(works, key=lambda w: (w.prompt_tokens + w.decode_tokens))  # ranks step together
        wanted = self.wanted(work)
        self.wanted_tokens = max(wanted, default=0)
        measured_rung = max(measured)
        compiles = self.runner.compile_seconds
        compile_seconds = (sum(compiles.values()) / len(compiles)) if compiles else DEFAULT_COMPILE_SECONDS
        chosen = plan(work, rungs, wanted, measured[measured_rung], measured_rung, compile_seconds)
        if chosen:
            self.runner.allow_warmup(False)  # the warm-up thread would compete for the cores
            for t in chosen:
                self.runner.compile_bucket(t)  # steps use it at once (its first run loads it)
        return chosen
