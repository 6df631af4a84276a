"""Speculative decoding (prompt lookup, or a draft model) on vs off, side by side in one run.

The default model (or --model) answers chat prompts that ask it to repeat, correct or
continue a given passage (greedy, --max-tokens new tokens), at batch 1 (one request at a
time), in a closed batch of 8, and all 12 at once through the engine's 8 sequence slots
(continuous batching), with and without `speculative_config`; then random-token prompts
(nothing to copy) show what speculation costs when it cannot help. Prints tokens/s, the
speed-up, the acceptance rate, whether the outputs are identical and the engine steps a run
took each way, then what a step of each size cost the speculating engine and the speed-up
those costs allow a batch of 8 (`speculation_ceiling`, at the acceptance of drafts up to
the k-th); writes JSON. Prompt lookup drafts past k in rows a step's bucket pads anyway
(`idle_speculative_tokens`, `--idle-k`; `--idle-k` equal to `--k` turns that off): the
"past k" column gives how many of those were accepted, and the ceiling leaves them out.
`--draft-model DIR` speculates with a draft model (same vocabulary) instead of prompt lookup.

    python scripts/bench_speculative.py [--model DIR] [--max-tokens 128] [--k 4] [--idle-k 16] [--draft-model DIR]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from pagedjax import LLM, SamplingParams

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "rag. He cleaned the great lens until it shone, trimmed the wick, and struck a match. For forty "
    "years the light had never failed, and the fishermen of the bay steered home by its steady beam.",
    "To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes "
    "until it is smooth and elastic. Let it rise in a warm place for an hour, shape it into a loaf, let "
    "it rise again, and bake it in a hot oven for about forty minutes until the crust is golden brown.",
    "Rivers carry water from the mountains to the sea. Along the way they carve valleys, deposit rich "
    "soil on their banks, and provide water for farms and cities. Many of the oldest civilizations grew "
    "up beside great rivers, such as the Nile, the Tigris, the Euphrates, the Indus and the Yellow River.",
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the "
    "members agreed to increase spending on the library and the parks, to keep the road repair budget "
    "the same, and to postpone the decision about the new community center until the spring meeting.",
]
TASKS = [
    "Repeat the following passage exactly, word for word:\n\n{}",
    "Correct any spelling mistakes in this passage and return the whole corrected passage:\n\n{}",
    "Copy this passage, then continue it with one more sentence:\n\n{}",
]


def _misspell(text: str) -> str:
    swaps = {"the ": "teh ", "every": "evrey", "until": "untill", "water": "watter", "members": "membres"}
    for a, b in swaps.items():
        text = text.replace(a, b, 2)
    return text


def chat_prompts(tokenizer) -> list[list[int]]:
    out = []
    for i, passage in enumerate(PASSAGES):
        for j, task in enumerate(TASKS):
            text = task.format(_misspell(passage) if j == 1 else passage)
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
            out.append(tokenizer.encode(chat, add_special_tokens=False))
    return out


def benchmark_cases(tokenizer, batch_1_prompts: int = 4) -> list[tuple[str, list[list[int]], int]]:
    """(name, prompts, batch) of each case. "batch 8": closed batches of 8 (the batch lasts as
    long as its slowest request); "8 at a time": every prompt submitted at once to an engine
    with 8 sequence slots (continuous batching: a finished request's slot takes the next
    prompt); random tokens: nothing to copy."""
    prompts = chat_prompts(tokenizer)
    rng = np.random.default_rng(0)
    random_prompts = [rng.integers(100, len(tokenizer), size=len(q)).tolist() for q in prompts[:8]]
    return [("copy, batch 1", prompts[:batch_1_prompts], 1), ("copy, batch 8", prompts[:8], 8),
            (f"copy, {len(prompts)} x 8 at a time", prompts, len(prompts)), ("random tokens, batch 8", random_prompts, 8)]


def speculation_ceiling(step_ms: dict[int, float], rows: int, acceptance: float, k: int) -> tuple[float, int]:
    """(speed-up, depth): the most that `rows` decoding requests can gain by each drafting the same
    d <= k tokens, from step costs by size (ms; a step of T tokens runs at the smallest measured
    size >= T) and drafts accepted independently at rate `acceptance`: a request then emits
    1 + a + ... + a^d tokens from a step of rows * (1 + d) tokens, against 1 from a step of `rows`.
    Every request stays in the batch: a model of the full batch (a closed batch's tail of fewer
    requests has idle rows, where drafts, past k too, cost nothing, but it is its slowest request,
    often one with little to copy)."""
    def cost(t: int) -> float | None:
        sizes = [s for s in step_ms if s >= t]
        return step_ms[min(sizes)] if sizes else None

    plain = cost(rows)
    if plain is None:
        raise ValueError(f"no measured step of {rows} tokens or more")
    best = (1.0, 0)
    for d in range(1, k + 1):
        c = cost(rows * (1 + d))
        if c is not None:
            best = max(best, (sum(acceptance ** i for i in range(d + 1)) * plain / c, d))
    return best


def _idle_drafts(llm: LLM) -> tuple[int, int]:
    """(drafts past the k-th of their request verified so far, accepted): 0s without prompt lookup."""
    spec = llm.engine.spec
    return (getattr(spec, "num_idle_draft_tokens", 0), getattr(spec, "num_accepted_idle_draft_tokens", 0))


def run(llm: LLM, prompts: list[list[int]], batch: int, max_tokens: int) -> tuple[list[list[int]], float, int, int]:
    """(outputs, seconds, tokens, engine steps) for `prompts` in batches of `batch`."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    outs, tokens, steps = [], 0, llm.engine.num_steps
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        for o in llm.generate(prompts[i:i + batch], sp, use_tqdm=False):
            outs.append(o.outputs[0].token_ids)
            tokens += len(o.outputs[0].token_ids)
    return outs, time.perf_counter() - start, tokens, llm.engine.num_steps - steps


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--idle-k", type=int, default=None,
                   help="prompt lookup's idle_speculative_tokens: drafts per request in rows a step pads anyway "
                        "(default: the engine's, 16; equal to --k: off)")
    p.add_argument("--lookup-min", type=int, default=1)
    p.add_argument("--lookup-max", type=int, default=4)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--draft-model", default=None,
                   help="a draft model's dir (same vocabulary) instead of prompt lookup")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case per mode (median and range printed)")
    p.add_argument("--batch-1-prompts", type=int, default=4, help="prompts run one at a time")
    p.add_argument("--output", default="results/bench_speculative.json")
    args = p.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.lookup_min,
            "prompt_lookup_max": args.lookup_max}
    if args.idle_k is not None:
        spec["idle_speculative_tokens"] = args.idle_k
    if args.draft_model:
        spec = {"model": args.draft_model, "num_speculative_tokens": args.k}
    kw = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024, dtype=args.dtype)
    engines = {"off": LLM(args.model, **kw), "on": LLM(args.model, speculative_config=spec, **kw)}
    for llm in engines.values():
        llm.wait_for_warmup()
    cases = benchmark_cases(engines["off"].tokenizer, args.batch_1_prompts)
    results = {"config": vars(args) | {"speculative_config": spec}, "cases": {}}
    print(f"{'case':28s} {'off tok/s':>16s} {'on tok/s':>16s} {'speed-up':>9s} {'accepted':>9s} "
          f"{'tokens/step':>12s} {'identical':>10s} {'steps off/on':>13s} {'past k':>14s}")
    for name, batch_prompts, batch in cases:
        llm_on, rates = engines["on"], {"off": [], "on": []}
        before, steps_before = llm_on.stats(), llm_on.engine.num_verify_steps
        idle_before = _idle_drafts(llm_on)
        outs, steps = {}, {}
        for rep in range(args.repeats):  # alternating, so a noisy neighbour hits both alike
            for mode in (("off", "on") if rep % 2 == 0 else ("on", "off")):
                outs[mode], seconds, tokens, steps[mode] = run(engines[mode], batch_prompts, batch, args.max_tokens)
                rates[mode].append(tokens / seconds)
        after = llm_on.stats()
        drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
        accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
        verify_steps = llm_on.engine.num_verify_steps - steps_before
        idle_drafts, idle_accepted = (a - b for a, b in zip(_idle_drafts(llm_on), idle_before))
        off, on = float(np.median(rates["off"])), float(np.median(rates["on"]))
        case = {"off_tok_s": off, "on_tok_s": on, "off_runs": rates["off"], "on_runs": rates["on"],
                "speedup": on / off, "draft_tokens": drafts, "accepted_tokens": accepted,
                "acceptance_rate": accepted / max(drafts, 1), "tokens_per_verify_step": 1 + accepted / max(verify_steps, 1),
                "identical": outs["on"] == outs["off"], "num_prompts": len(batch_prompts), "batch": batch,
                "steps_off": steps["off"], "steps_on": steps["on"],
                # drafts past the k-th of a request (idle rows), and those up to it (the ceiling's)
                "idle_draft_tokens": idle_drafts, "idle_accepted_tokens": idle_accepted,
                "acceptance_rate_up_to_k": (accepted - idle_accepted) / max(drafts - idle_drafts, 1)}
        results["cases"][name] = case
        spread = lambda r: f"{np.median(r):5.1f} [{min(r):.0f}-{max(r):.0f}]"
        print(f"{name:28s} {spread(rates['off']):>16s} {spread(rates['on']):>16s} {case['speedup']:8.2f}x "
              f"{100 * case['acceptance_rate']:8.1f}% {case['tokens_per_verify_step']:12.2f} "
              f"{str(case['identical']):>10s} {steps['off']:>6d}/{steps['on']:<6d} "
              f"{f'{idle_accepted}/{idle_drafts}':>14s}")
    # what a step of each size cost the speculating engine (moving averages of wall time): the
    # draft allocation weighs these
    costs = engines["on"].engine.step_costs()
    results["step_ms"] = {t: 1e3 * c for t, c in costs.items()}
    print("step wall time by size, speculating engine (ms): " + ", ".join(f"{t} tokens {1e3 * c:.1f}"
                                                                           for t, c in costs.items()))
    # the modeled ceiling of the closed batches of 8 on this machine: what these step costs allow
    for name, case in results["cases"].items():
        if case["batch"] == 8 and any(t >= 8 for t in results["step_ms"]):
            at_rate, d = speculation_ceiling(results["step_ms"], 8, case["acceptance_rate_up_to_k"], args.k)
            every, d_all = speculation_ceiling(results["step_ms"], 8, 1.0, args.k)
            case["ceiling"], case["ceiling_all_accepted"] = at_rate, every
            print(f"ceiling for {name} from these step costs (all 8 requests decoding): "
                  f"{at_rate:.2f}x at its {100 * case['acceptance_rate_up_to_k']:.0f}% acceptance (depth {d}), "
                  f"{every:.2f}x with every draft accepted (depth {d_all}); measured {case['speedup']:.2f}x")
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
