"""Small-batch decode against its floors, in one run: batch 1, 2, 4, 8 (issue 49).

For each batch B the engine decodes B requests (prompts of --prompt-len, outputs long enough
that the batch stays full) and prints:
  step ms      median wall time of a decode step, async scheduling on (the engine's default)
  sync ms      the same with async scheduling off, split into
    host       schedule + pack inputs + process outputs (the step's wall time less the next two)
    dispatch   ModelRunner.dispatch: inputs to the device, the executables queued
    wait       the host blocked reading the sampled tokens back (the device computing)
  bytes floor  the bytes a decode step must read (every weight once, the KV of B contexts)
               divided by the bandwidth a streaming-read probe measures in the same run
  mm floor     the step's matmuls alone, the engine's own kernels and weights (step_floor.py)
  x floor      step ms / bytes floor (the target: 1.3 at batch 1, bf16, on the CPU)

    python scripts/decode_floor.py [--model DIR|random-1b] [--dtype bfloat16] [--batches 1,2,4,8] [--repeats 3]

Default model: the cached default checkpoint (SmolLM2-135M-Instruct) when present, else a random
SmolLM2-135M-shaped Llama (bench_throughput.py). `--model random-1b`: random weights in a
Llama-3.2-1B shape (load_format="dummy": no checkpoint is written). On a GPU or TPU the
bandwidth probe reads a 1 GiB array on the device (the HBM floor) and the matmul floor is
XLA's dots (scripts/gpu_session.sh runs `--batches 1,16,64,256` for both models).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True,
                rms_norm_eps=1e-5, rope_theta=500000.0)


def stream_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read over `gib` GiB, the best of `repeats` (what the memory system
    can give a step): on the CPU both cores sum their half (numpy releases the GIL); on an
    accelerator a jitted sum of a bfloat16 array in its memory."""
    import os

    import jax

    if jax.default_backend() != "cpu":
        import jax.numpy as jnp

        x = jnp.ones(int(gib * 2**30) // 2, jnp.bfloat16)
        total = jax.jit(lambda x: jnp.sum(x, dtype=jnp.float32))
        total(x).block_until_ready()
        best = 0.0
        for _ in range(repeats):
            t = time.perf_counter()
            total(x).block_until_ready()
            best = max(best, x.nbytes / (time.perf_counter() - t))
        return best

    parts = [np.ones(int(gib * 2**30) // 4 // 2, np.float32) for _ in range(max(1, min(2, os.cpu_count() or 1)))]
    best = 0.0
    for _ in range(repeats):
        threads = [threading.Thread(target=p.sum) for p in parts]
        t = time.perf_counter()
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        best = max(best, sum(p.nbytes for p in parts) / (time.perf_counter() - t))
    return best


def weight_bytes(engine) -> int:
    """Bytes of every weight a decode step reads (the token embedding's rows are few; where the
    head is tied to it, the head reads the whole table once)."""
    import jax

    return int(sum(x.nbytes for x in jax.tree.leaves(engine.runner.state)))


def kv_bytes(engine, batch: int, context: int) -> int:
    """Bytes of K and V a decode step of `batch` sequences of `context` tokens reads."""
    cfg = engine.model.config
    itemsize = np.dtype(engine.runner.kv_dtype).itemsize
    return 2 * cfg.num_layers * engine.model.num_kv_heads * cfg.head_dim * itemsize * batch * context


class _Timed:
    """Wraps a bound method and sums the seconds spent in it."""

    def __init__(self, obj, name):
        self.obj, self.name, self.fn, self.seconds = obj, name, getattr(obj, name), 0.0
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        try:
            return self.fn(*a, **k)
        finally:
            self.seconds += time.perf_counter() - t


def decode_steps(engine, batch: int, prompt_len: int, steps: int, rng) -> dict:
    """Median ms per decode step of `batch` running requests: wall, and (sync) host / dispatch / wait."""
    from pagedjax import SamplingParams

    ids = [f"b{batch}-{rng.integers(1 << 40)}-{i}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, rng.integers(3, 1000, prompt_len).tolist(),
                           SamplingParams(max_tokens=2 * steps + 16, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.schedulers[0].running) or \
            engine.schedulers[0].waiting:
        engine.step()  # the prompts
    for _ in range(3):
        engine.step()
    rows = {}
    try:
        for mode in ("async", "sync"):
            engine.async_scheduling = mode == "async"
            dispatch = _Timed(engine.runner, "dispatch")
            walls, disp, waits = [], [], []
            for _ in range(steps):
                d0 = dispatch.seconds
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
                disp.append(dispatch.seconds - d0)
                waits.append(engine.runner.last_wait_s)
            del engine.runner.dispatch
            rows[mode] = (walls, disp, waits)
    finally:
        engine.async_scheduling = True
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    med = lambda xs: 1e3 * float(np.median(xs))  # noqa: E731
    walls, disp, waits = rows["sync"]
    return {"step": med(rows["async"][0]), "sync": med(walls), "dispatch": med(disp), "wait": med(waits),
            "host": med(np.array(walls) - np.array(disp) - np.array(waits))}


def prompt_ms(engine, length: int, rng) -> float:
    """ms from adding one prompt of `length` tokens (max_tokens=1) to its end: prompt processing."""
    from pagedjax import SamplingParams

    engine.add_request(f"p-{rng.integers(1 << 40)}", rng.integers(3, 1000, length).tolist(), SamplingParams(max_tokens=1))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return 1e3 * (time.perf_counter() - t)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompt-bench", type=int, default=512, help="also time one prompt of this many tokens (0: no)")
    args = p.parse_args()
    from bench_throughput import make_random_checkpoint
    from step_floor import matmul_floor_ms

    from pagedjax.engine.llm_engine import LLMEngine
    from pagedjax.models.default_model import default_model_dir

    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, load_format = args.model, "auto"
        if model == "random-1b":
            from transformers import LlamaConfig

            LlamaConfig(**LLAMA_1B).save_pretrained(tmp)
            model, load_format = tmp, "dummy"
        elif model is None:
            try:  # the cached default checkpoint (no download here)
                model = str(default_model_dir(progress=False))
            except RuntimeError:
                make_random_checkpoint(Path(tmp))
                model = tmp
        engine = LLMEngine(model, stream_text=False, max_num_seqs=max(batches), max_model_len=max(1024, 2 * args.prompt_bench),
                           max_num_batched_tokens=max(512, args.prompt_bench, max(batches)),
                           enable_prefix_caching=False, dtype=args.dtype, load_format=load_format)
        engine.warmup(progress=False)
        bw = stream_bandwidth()
        wbytes = weight_bytes(engine)
        print(f"model {model}, {args.dtype}; weights {wbytes / 2**20:.0f} MiB; streaming read "
              f"{bw / 2**30:.1f} GiB/s; prompts {args.prompt_len} tokens; median of {args.steps} steps, "
              f"{args.repeats} repeats (min-max of the medians)")
        print(f"{'batch':>5} {'step ms':>16} {'tok/s':>7} {'sync ms':>7} {'host':>6} {'dispatch':>8} {'wait':>6} "
              f"{'bytes floor':>11} {'mm floor':>8} {'x floor':>7}")
        for b in batches:
            runs = [decode_steps(engine, b, args.prompt_len, args.steps, rng) for _ in range(args.repeats)]
            mm = float(np.median([matmul_floor_ms(engine.model, b) for _ in range(args.repeats)]))
            context = args.prompt_len + args.steps  # mid-run context
            floor_bytes = 1e3 * (wbytes + kv_bytes(engine, b, context)) / bw
            step = [r["step"] for r in runs]
            med = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
            print(f"{b:>5} {med['step']:6.2f} [{min(step):.1f}-{max(step):.1f}] {1e3 * b / med['step']:7.1f} "
                  f"{med['sync']:7.2f} {med['host']:6.2f} {med['dispatch']:8.2f} {med['wait']:6.2f} "
                  f"{floor_bytes:11.2f} {mm:8.2f} {med['step'] / floor_bytes:7.2f}", flush=True)
        if args.prompt_bench:
            prompt_ms(engine, args.prompt_bench, rng)  # its shapes' first run
            times = [prompt_ms(engine, args.prompt_bench, rng) for _ in range(args.repeats)]
            print(f"prompt of {args.prompt_bench} tokens: {np.median(times):.1f} ms [{min(times):.1f}-{max(times):.1f}], "
                  f"{1e3 * args.prompt_bench / np.median(times):.0f} tok/s")


if __name__ == "__main__":
    main()
