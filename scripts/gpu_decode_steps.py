"""Decode step time of the engine on an accelerator, for one source tree and one layer layout:
run it once per tree / layout (with PYTHONPATH pointing at the tree) and read the lines side by
side. Where `gpu_e2e_bf16.py` warms every step shape up, this compiles only the shapes its
batches use (max_num_batched_tokens 512), so one configuration costs well under a minute.

    PYTHONPATH=. python scripts/gpu_decode_steps.py [--scan-layers on|off] [--label NAME]
    PYTHONPATH=. python scripts/gpu_decode_steps.py --allow-cpu --batches 1 --output-len 8   # dry run

Random SmolLM2-135M-shaped weights in bf16, prompts of --prompt-len random tokens, greedy,
--output-len new tokens each. For each batch size: the first (compiling) batch's seconds, then
--repeats timed batches: output tokens/s, and the median [p10-p90] wall time of a decode
step (no prompt token in it) with the part of it the host spent waiting for the device (async scheduling: the host prepares
step t + 1 while the device runs step t). The floor printed beside: the model's weights read
once from HBM at the H200's 4.8 TB/s.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from gpu_e2e_bf16 import SMOLLM2_135M, write_random_checkpoint  # noqa: E402


def run_batch(engine, prompts: list[list[int]], output_len: int, ids) -> tuple[float, int, list, list]:
    """(seconds, output tokens, step wall seconds, step device-wait seconds) of one batch."""
    from pagedjax import SamplingParams

    sp = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for p in prompts:
        engine.add_request(f"r{next(ids)}", p, sp)
    walls, waits, produced = [], [], 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t, prompt_tokens = time.perf_counter(), engine.num_computed_prompt_tokens
        outs = engine.step()
        if engine.num_computed_prompt_tokens == prompt_tokens:  # a decode step: no prompt token in it
            walls.append(time.perf_counter() - t)
            waits.append(engine.runner.last_wait_s)
        produced += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
    return time.perf_counter() - start, produced, walls, waits


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--label", default="", help="name printed on every line (e.g. the tree)")
    p.add_argument("--scan-layers", choices=["auto", "on", "off"], default="auto")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batches", type=lambda v: [int(b) for b in v.split(",")], default=[1, 16])
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--speculate", type=int, default=0, help="k > 0: prompt-lookup speculation of k tokens")
    p.add_argument("--allow-cpu", action="store_true")
    args = p.parse_args(argv)

    import jax

    import pagedjax
    from pagedjax.engine.llm_engine import LLMEngine

    if jax.default_backend() == "cpu" and not args.allow_cpu:
        print("no accelerator: nothing run (pass --allow-cpu for a dry run on the CPU)")
        return 1
    tag = f"[{args.label or Path(pagedjax.__file__).parent.parent.name} scan={args.scan_layers} k={args.speculate}]"
    print(f"{tag} jax {jax.__version__} on {jax.devices()[0].device_kind}; pagedjax from {pagedjax.__file__}",
          flush=True)
    rng, ids = np.random.default_rng(0), itertools.count()
    with tempfile.TemporaryDirectory() as tmp:
        write_random_checkpoint(Path(tmp))
        start = time.perf_counter()
        spec = dict(speculative_config={"method": "ngram", "num_speculative_tokens": args.speculate,
                                        "prompt_lookup_min": 1, "prompt_lookup_max": 4}) if args.speculate else {}
        engine = LLMEngine(tmp, **spec, stream_text=False, dtype=args.dtype, max_num_seqs=max(args.batches),
                           max_model_len=1024, max_num_batched_tokens=512, enable_prefix_caching=False,
                           scan_layers={"auto": None, "on": True, "off": False}[args.scan_layers])
        print(f"{tag} engine built in {time.perf_counter() - start:.1f} s; layers "
              f"{'under scan' if engine.model.scan_layers else 'unrolled'}", flush=True)
        from flax import nnx

        weight_bytes = sum(getattr(x, "nbytes", 0) for x in jax.tree_util.tree_leaves(nnx.state(engine.model)))
        print(f"{tag} floor: {weight_bytes / 1e6:.0f} MB of weights read once at 4.8 TB/s = "
              f"{weight_bytes / 4.8e12 * 1e3:.3f} ms a step", flush=True)
        for batch in args.batches:
            prompts = [rng.integers(100, SMOLLM2_135M["vocab_size"], args.prompt_len).tolist() for _ in range(batch)]
            seconds, *_ = run_batch(engine, prompts, args.output_len, ids)
            print(f"{tag} batch {batch:2d}: first batch (compiles its step shapes) {seconds:.1f} s", flush=True)
            rates, walls, waits = [], [], []
            for _ in range(args.repeats):
                seconds, produced, w, d = run_batch(engine, prompts, args.output_len, ids)
                rates.append(produced / seconds)
                walls += w[2:]  # skip the first decode steps (async: the last prompt step's wait lands there)
                waits += d[2:]
            wall, wait = 1e3 * np.array(walls), 1e3 * np.array(waits)
            print(f"{tag} batch {batch:2d}: {np.median(rates):8.1f} [{min(rates):.1f}-{max(rates):.1f}] tok/s; step "
                  f"{np.median(wall):.2f} [{np.percentile(wall, 10):.2f}-{np.percentile(wall, 90):.2f}] ms, of which "
                  f"waiting for the device {np.median(wait):.2f} ms, host work {np.median(wall - wait):.2f} ms",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
