"""Per-step wall time of the engine on the throughput workload: the prefill step and the
median decode step (after a first pass that compiles the shapes).

    python scripts/step_times.py [--model DIR] [--num-prompts 16] [--prompt-len 128] [--output-len 128]
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
from pagedjax.engine import LLMEngine  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or (make_random_checkpoint(Path(tmp)) or tmp)
        engine = LLMEngine(model, stream_text=False, max_num_seqs=args.num_prompts, max_model_len=512,
                           enable_prefix_caching=False)
        rng = np.random.default_rng(0)

        def run() -> list[float]:
            for _ in range(args.num_prompts):
                engine.add_request(f"r{rng.integers(1 << 62)}", rng.integers(3, 1000, args.prompt_len).tolist(),
                                   SamplingParams(max_tokens=args.output_len, ignore_eos=True))
            times = []
            while engine.has_unfinished_requests():
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
            return times

        run()
        times = run()
    print(f"prefill step {times[0]:.2f} s; decode step median {1e3 * np.median(times[1:]):.1f} ms "
          f"(p90 {1e3 * np.percentile(times[1:], 90):.1f} ms); total {sum(times):.2f} s for {len(times)} steps")


if __name__ == "__main__":
    main()
