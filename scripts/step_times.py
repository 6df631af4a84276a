"""Per-step wall time of the engine, split into host time (scheduling, batch preparation,
output processing) and the time the host waits for the device, with async scheduling off
(the host works while the device idles) and on (it prepares step t + 1 while the device
runs step t), side by side; and the cost of a mixed step
(decodes + one prompt chunk) at two KV pool sizes, which must not differ (no step work
proportional to the pool).

    python scripts/step_times.py [--model DIR] [--num-prompts 16] [--prompt-len 128] [--output-len 128] [--repeats 3]
Default model: the SmolLM2-135M-shaped random Llama of bench_throughput.py.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import make_random_checkpoint  # noqa: E402

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.engine.llm_engine import LLMEngine  # noqa: E402


def timed_steps(engine, rng, num_prompts, prompt_len, output_len) -> list[tuple[float, float]]:
    """(wall seconds, seconds waiting for the device) of every step of one batch."""
    for _ in range(num_prompts):
        engine.add_request(f"r{rng.integers(1 << 62)}", rng.integers(3, 1000, prompt_len).tolist(),
                           SamplingParams(max_tokens=output_len, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - t, engine.runner.last_wait_s))
    return times


def mixed_step_ms(model, num_blocks: int, rng, repeats: int = 5) -> tuple[float, float]:
    """Median ms of a decode-only step of 4 requests and of a step adding a 100-token prompt."""
    engine = LLMEngine(model, stream_text=False, max_num_seqs=32, max_model_len=1024, num_blocks=num_blocks,
                       enable_prefix_caching=False, async_scheduling=False)  # each step() call: one whole step
    engine.warmup(progress=False)
    for i in range(4):
        engine.add_request(f"d{i}", rng.integers(3, 1000, 50).tolist(), SamplingParams(max_tokens=200, ignore_eos=True))
    engine.step()
    decode, mixed = [], []
    for k in range(repeats):
        t = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - t)
        engine.add_request(f"p{k}", rng.integers(3, 1000, 100).tolist(), SamplingParams(max_tokens=1))
        t = time.perf_counter()
        engine.step()
        mixed.append(time.perf_counter() - t)
    return 1e3 * float(np.median(decode)), 1e3 * float(np.median(mixed))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="alternating sync / async batches measured")
    p.add_argument("--pool-sizes", default="256,4096", help="KV blocks for the mixed-step probe (comma list)")
    args = p.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (make_random_checkpoint(Path(tmp)) or tmp)
        engines = {mode: LLMEngine(model, stream_text=False, max_num_seqs=args.num_prompts, max_model_len=512,
                                   enable_prefix_caching=False, async_scheduling=mode == "async")
                   for mode in ("sync", "async")}
        for engine in engines.values():
            engine.warmup(progress=False)
            timed_steps(engine, rng, args.num_prompts, args.prompt_len, args.output_len)
        runs = {mode: [] for mode in engines}
        for _ in range(args.repeats):  # alternating, so both see the same machine
            for mode, engine in engines.items():
                runs[mode] += timed_steps(engine, rng, args.num_prompts, args.prompt_len, args.output_len)[2:]
        print(f"decode steps of {args.num_prompts} rows, {args.repeats} alternating runs, medians [p10-p90] ms:")
        for mode, times in runs.items():
            wall = 1e3 * np.array([w for w, _ in times])
            wait = 1e3 * np.array([d for _, d in times])
            host = wall - wait
            print(f"  {mode:5s}: step {np.median(wall):6.1f} [{np.percentile(wall, 10):.1f}-{np.percentile(wall, 90):.1f}]"
                  f"  host work {np.median(host):5.2f} (scheduling, batch preparation, outputs)"
                  f"  waiting for the device {np.median(wait):6.1f}")
        sync = runs["sync"]
        print(f"  floor: the device time of a step, as the sync host waits for it: "
              f"{1e3 * np.median([d for _, d in sync]):.1f} ms (async hides the host work behind it)")
        for nb in (int(x) for x in args.pool_sizes.split(",")):
            dec, mixed = mixed_step_ms(model, nb, rng)
            print(f"pool of {nb:5d} blocks: decode step (4 requests) {dec:6.1f} ms; "
                  f"step with a 100-token prompt added {mixed:6.1f} ms")


if __name__ == "__main__":
    main()
