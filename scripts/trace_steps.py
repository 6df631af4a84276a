"""Where a step's device time goes, by step size: a `jax.profiler` trace of one batch, each
forward pass's ops summed and named from the compiled step's HLO.

The default model (or --model) answers bench_speculative.py's copy prompts, a closed batch of
--batch, with or without speculative decoding (--speculative), once to warm up and once traced.
For every step size T it prints the number of steps, the median device span of the forward
pass and the median time of each op group: native kernels by target and operand shapes (e.g.
`pagedjax_matmul_bf16 (f32[16,576], bf16[3072,576])`: the gate/up matmul at 16 rows), XLA
fusions by kind.

    python scripts/trace_steps.py [--speculative] [--batch 8] [--dtype auto] [--top 12]
"""
from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_speculative import chat_prompts, run  # noqa: E402

from pagedjax import LLM  # noqa: E402

_CUSTOM_CALL = re.compile(r'%(\S+) = .*? custom-call\(.*?custom_call_target="([^"]+)"'
                          r'(?:, operand_layout_constraints=\{((?:[^{}]|\{[^{}]*\})*)\})?')


def custom_call_names(hlo_text: str) -> dict[str, str]:
    """HLO op name -> 'target operand shapes' for every custom call (the native kernels)."""
    names = {}
    for m in _CUSTOM_CALL.finditer(hlo_text):
        operands = re.sub(r"\{[\d,]*\}", "", m[3] or "")  # drop the layouts
        names[m[1]] = f"{m[2]} ({operands})"[:90]
    return names


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--speculative", action="store_true", help="prompt lookup, k = 4, lookup 1-4")
    p.add_argument("--top", type=int, default=12, help="op groups printed per step size")
    args = p.parse_args(argv)
    import jax

    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
            if args.speculative else None)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=1024,
              max_num_batched_tokens=1024, speculative_config=spec)
    llm.wait_for_warmup()
    prompts = chat_prompts(llm.tokenizer)[:args.batch]
    run(llm, prompts, args.batch, args.max_tokens)
    runner, sizes = llm.engine.runner, []
    fetch = runner.fetch
    runner.fetch = lambda pending: (sizes.append(pending.t), fetch(pending))[1]  # each step's T, in order
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            run(llm, prompts, args.batch, args.max_tokens)
        events = json.load(gzip.open(next(Path(tmp).rglob("*.json.gz"))))["traceEvents"]
    runner.fetch = fetch
    runs = collections.defaultdict(list)  # run_id -> the forward pass's op events
    for e in events:
        a = e.get("args", {})
        if e.get("ph") == "X" and a.get("hlo_module", "").startswith("jit__forward") and "run_id" in a \
                and not e["name"].startswith("Thunk"):
            runs[a["run_id"]].append(e)
    order = sorted(runs, key=lambda r: min(e["ts"] for e in runs[r]))
    if len(order) != len(sizes):
        print(f"warning: {len(order)} traced forward passes for {len(sizes)} steps; sizes may be misaligned")
    names = {t: custom_call_names(runner.compile_bucket(t).as_text()) for t in set(sizes)}
    per_size = collections.defaultdict(lambda: collections.defaultdict(list))
    for run_id, t in zip(order, sizes):
        groups = collections.Counter()
        for e in runs[run_id]:
            op = e["args"].get("hlo_op", e["name"])
            groups[names[t].get(op) or "xla " + re.sub(r"\.\d+(\.clone)?$", "", op)] += e["dur"] / 1e3
        evs = runs[run_id]
        groups["(span)"] = (max(e["ts"] + e["dur"] for e in evs) - min(e["ts"] for e in evs)) / 1e3
        for k, v in groups.items():
            per_size[t][k].append(v)
    for t in sorted(per_size):
        g = per_size[t]
        print(f"\nT = {t}: {len(g['(span)'])} steps, forward pass {np.median(g['(span)']):.1f} ms (median)")
        top = sorted(((float(np.median(v)), k) for k, v in g.items() if k != "(span)"), reverse=True)
        for ms, k in top[:args.top]:
            print(f"  {ms:7.2f} ms  {k}")


if __name__ == "__main__":
    main()
