"""Host work per decode step against the number of running requests (issue 49's baseline).

A tiny random Llama (hidden 64, 2 layers, vocab 1000), so the device's share of a step is
small and what grows with the batch is the host's: scheduling, batch preparation, output
processing. For each batch size N the engine runs N requests (16-token prompts, long
outputs, EOS ignored) with async scheduling off, so a step's wall time splits into the time
the host waits for the device (`runner.last_wait_s`) and the rest, the host work. Prints per
N: the median step, the host work in total and per request, the device wait; and the host
work split once more: `launch` is the time in `runner.dispatch` outside `runner.prepare` (the
two buffers put on the device and the executables called: on CPU, XLA may run a small
executable inside the call, so part of the device's work lands here), `python` the rest
(scheduling, batch preparation, output processing); and the step's wall time with async
scheduling on (another engine: the host's work overlaps the device's). Then a cProfile of the host side at the
largest N (the functions with the most own time).

    python scripts/host_work.py [--sizes 1,16,64,256,512] [--steps 40] [--profile-top 15]
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from pathlib import Path

import numpy as np

from pagedjax import SamplingParams
from pagedjax.engine.llm_engine import LLMEngine

TINY = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def make_tiny_checkpoint(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(str(path))


def running_engine(model: str, n: int, steps: int, async_scheduling: bool = False) -> LLMEngine:
    """An engine with n requests admitted and past their prompts (every step a decode of n rows)."""
    engine = LLMEngine(model, stream_text=False, max_num_seqs=n, max_model_len=64 + steps * 2,
                       enable_prefix_caching=False, async_scheduling=async_scheduling)
    engine.warmup(progress=False)
    rng = np.random.default_rng(0)
    for i in range(n):
        engine.add_request(f"r{i}", rng.integers(3, 1000, 16).tolist(),
                           SamplingParams(max_tokens=steps * 2, ignore_eos=True))
    while any(len(r.output_token_ids) == 0 for s in engine.schedulers for r in s.running) or \
            any(s.waiting for s in engine.schedulers):
        engine.step()
    return engine


def timed(engine: LLMEngine, steps: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(wall ms, device-wait ms, launch ms) of `steps` decode steps; launch: the time in
    runner.dispatch outside runner.prepare."""
    runner, spent = engine.runner, {"dispatch": 0.0, "prepare": 0.0}

    def clocked(name, fn):
        def call(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t
        return call

    runner.dispatch, runner.prepare = clocked("dispatch", runner.dispatch), clocked("prepare", runner.prepare)
    wall, wait, launch = [], [], []
    try:
        for _ in range(steps):
            spent.update(dispatch=0.0, prepare=0.0)
            t = time.perf_counter()
            engine.step()
            wall.append(time.perf_counter() - t)
            wait.append(runner.last_wait_s)
            launch.append(spent["dispatch"] - spent["prepare"])
    finally:
        del runner.dispatch, runner.prepare  # the class's methods again
    return 1e3 * np.array(wall), 1e3 * np.array(wait), 1e3 * np.array(launch)


def async_step_ms(model: str, n: int, steps: int) -> float:
    """Median wall ms of a decode step of n requests with async scheduling on (the host's work
    for step k + 1 done while the device runs step k)."""
    engine = running_engine(model, n, steps, async_scheduling=True)
    wall = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        wall.append(time.perf_counter() - t)
    return 1e3 * float(np.median(wall))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,16,64,256,512", help="running requests (comma list)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per size")
    p.add_argument("--profile-top", type=int, default=15, help="functions listed from the profile (0: none)")
    args = p.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        make_tiny_checkpoint(Path(tmp))
        print(f"{'N':>5} {'step ms':>9} {'host ms':>9} {'host us/req':>12} {'device wait ms':>15} "
              f"{'launch ms':>10} {'python ms':>10} {'python us/req':>14} {'async step ms':>14}")
        engine = None
        for n in sizes:
            engine = running_engine(tmp, n, args.steps)
            wall, wait, launch = timed(engine, args.steps)
            host, python = wall - wait, wall - wait - launch
            print(f"{n:5d} {np.median(wall):9.2f} {np.median(host):9.2f} {1e3 * np.median(host) / n:12.1f} "
                  f"{np.median(wait):15.2f} {np.median(launch):10.2f} {np.median(python):10.2f} "
                  f"{1e3 * np.median(python) / n:14.1f} {async_step_ms(tmp, n, args.steps):14.2f}", flush=True)
        if args.profile_top and engine is not None:
            engine = running_engine(tmp, sizes[-1], args.steps)
            profile = cProfile.Profile()
            profile.enable()
            timed(engine, args.steps)
            profile.disable()
            print(f"\nhost profile, {args.steps} decode steps of {sizes[-1]} requests (own time):")
            pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile_top)


if __name__ == "__main__":
    main()
