"""Prompt lookup with and without repeating a match's period (`speculative.propose`), A/B on
one speculating engine: the rule is swapped between alternating runs, so both see the same
compiled steps and the same machine; plain decoding runs beside them.

    python scripts/ab_prompt_lookup.py [--model DIR] [--repeats 3] [--max-tokens 128]

Cases: bench_speculative.py's copy batch 1, copy batch 8 and random-token batch 8. Prints the
median [range] tok/s of each mode, the speed-ups, the engine steps of the last run and whether
the greedy outputs equal plain decoding's; then the speculating engine's step costs.
"""
from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import benchmark_cases, run  # noqa: E402

import pagedjax.spec_decode.ngram as ngram_module  # noqa: E402
from pagedjax import LLM  # noqa: E402
from pagedjax.spec_decode.ngram import propose  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4)
    args = p.parse_args(argv)
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    kw = dict(max_num_seqs=8, max_model_len=1024, max_num_batched_tokens=1024)
    off, on = LLM(args.model, **kw), LLM(args.model, speculative_config=spec, **kw)
    off.wait_for_warmup()
    on.wait_for_warmup()
    modes = {"off": (off, None), "cut": (on, functools.partial(propose, repeat_period=False)),
             "period": (on, propose)}
    for name, prompts, batch in benchmark_cases(off.tokenizer, 2):
        if batch == len(prompts) and batch > 8:  # the 8-at-a-time case: not part of this A/B
            continue
        rates, outs, steps = {m: [] for m in modes}, {}, {}
        order = list(modes)
        for rep in range(args.repeats):
            for mode in order[rep % 3:] + order[:rep % 3]:  # rotating, so no mode always runs first
                llm, rule = modes[mode]
                if rule is not None:
                    ngram_module.propose = rule
                outs[mode], seconds, tokens, steps[mode] = run(llm, prompts, batch, args.max_tokens)
                rates[mode].append(tokens / seconds)
        med = {m: float(np.median(r)) for m, r in rates.items()}
        print(f"{name:24s} " + "  ".join(f"{m} {med[m]:6.1f} [{min(r):.0f}-{max(r):.0f}]" for m, r in rates.items())
              + f"  speed-up cut {med['cut'] / med['off']:.2f}x, period {med['period'] / med['off']:.2f}x; steps "
              f"{steps['off']} / {steps['cut']} / {steps['period']}; identical {outs['cut'] == outs['off']} "
              f"{outs['period'] == outs['off']}", flush=True)
    ngram_module.propose = propose
    print("speculating engine's step costs (ms): "
          + ", ".join(f"{t} tokens {1e3 * c:.1f}" for t, c in on.engine.step_costs().items()))


if __name__ == "__main__":
    main()
