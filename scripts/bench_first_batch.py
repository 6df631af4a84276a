"""The first offline batch right after `LLM(...)`: start-up time and first-batch throughput,
side by side with transformers (same checkpoint, same greedy workload) in one run.

Each run is a fresh Python process with an empty JAX compilation cache of its own (a new
user's first run; --warm-cache: the same cache filled by a first run), which does:

- first:  llm = LLM(model) (background warm-up, the default); llm.generate(batch) at once
- waited: llm = LLM(model); llm.wait_for_warmup(); llm.generate(batch)
- small:  llm = LLM(model); llm.generate(one prompt, max_tokens=1) (quick start)

and reports the seconds LLM() took, the wait, the generate (and its tok/s), and the time
from before LLM() to the last token. The batch: 16 prompts of 128 random tokens, 128 new
tokens each (ignore_eos), on a random SmolLM2-135M-shaped Llama (bench_throughput.py), with
max_num_seqs=16, max_model_len=512, float32. transformers' batched generate runs the same
batch in this process after the pagedjax runs (tok/s: warm, its own warm-up untimed).

--tree DIR (repeatable) runs the pagedjax source tree DIR (PYTHONPATH) instead of the
installed one, e.g. a `git worktree` of an older commit for a before/after comparison; runs
alternate between trees, --repeats times each. Writes JSON (results/bench_first_batch.json).

    python scripts/bench_first_batch.py [--tree OLD --tree .] [--modes first,waited,small] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))  # bench_throughput

CHILD = r"""
import json, sys, time
T0 = time.perf_counter()
mode, model_dir, prompts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
from pagedjax import LLM, SamplingParams
import pagedjax
t = time.perf_counter()
llm = LLM(model_dir, max_num_seqs=16, max_model_len=512, dtype="float32", enable_prefix_caching=False)
built = time.perf_counter() - t
wait = 0.0
if mode == "waited":
    t = time.perf_counter(); llm.wait_for_warmup(); wait = time.perf_counter() - t
if mode == "small":
    prompts, params = prompts[:1], SamplingParams(max_tokens=1)
else:
    params = SamplingParams(max_tokens=int(sys.argv[4]), ignore_eos=True)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
gen = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
print("RESULT " + json.dumps(dict(source=str(pagedjax.__file__), llm_s=built, wait_s=wait, generate_s=gen,
      output_tokens=n, tokens_per_s=n / gen, llm_to_last_token_s=built + wait + gen,
      compiled_shapes=llm.engine.runner.compiled_shapes, token_ids=[o.outputs[0].token_ids for o in outs])))
"""


def run_child(tree: str | None, mode: str, model_dir: str, prompts, output_len: int, cache_dir: str,
              timeout: float) -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, PAGEDJAX_AUTO_DTYPE="float32")
    env.pop("PAGEDJAX_COMPILE_CACHE", None)
    if tree:
        env["PYTHONPATH"] = os.path.abspath(tree) + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", CHILD, mode, model_dir, json.dumps(prompts), str(output_len)],
                       env=env, capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir())
    line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if p.returncode != 0 or line is None:
        raise RuntimeError(f"{mode} run of {tree or 'installed'} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def main() -> None:
    from bench_throughput import bench_transformers, make_random_checkpoint

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=None, help="a pagedjax source tree (repeatable)")
    p.add_argument("--modes", default="first,waited,small")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--warm-cache", action="store_true", help="each run reuses a cache filled by an untimed run")
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out", default="results/bench_first_batch.json")
    args = p.parse_args()
    trees, modes = args.tree or [None], args.modes.split(",")

    runs: dict[tuple, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(Path(tmp) / "model")
        make_random_checkpoint(Path(model_dir))
        prompts = np.random.default_rng(0).integers(3, 49152, size=(args.num_prompts, args.prompt_len)).tolist()
        warm = {}
        if args.warm_cache:
            for tree in trees:
                warm[tree] = tempfile.mkdtemp(dir=tmp)
                run_child(tree, "waited", model_dir, prompts, args.output_len, warm[tree], args.timeout)
        for rep in range(args.repeats):
            for mode in modes:
                for tree in (trees if rep % 2 == 0 else trees[::-1]):  # alternate: noise hits both alike
                    cache = warm.get(tree) or tempfile.mkdtemp(dir=tmp)
                    r = run_child(tree, mode, model_dir, prompts, args.output_len, cache, args.timeout)
                    runs.setdefault((tree, mode), []).append(r)
                    print(f"  {tree or 'installed'} {mode}: LLM() {r['llm_s']:.1f} s, wait {r['wait_s']:.1f} s, "
                          f"generate {r['generate_s']:.1f} s ({r['tokens_per_s']:.0f} tok/s)", flush=True)
        hf = bench_transformers(model_dir, prompts, args.output_len, None)

    print(f"\ntransformers: {hf['tokens_per_s']:.0f} tok/s (warm, {args.num_prompts} x {args.prompt_len} -> "
          f"{args.output_len}); cache {'warm' if args.warm_cache else 'cold'}; median [min-max] of {args.repeats}")
    print(f"{'tree':<28} {'mode':<7} {'LLM() s':>8} {'wait s':>7} {'generate s':>15} {'tok/s':>6} "
          f"{'vs HF':>6} {'LLM()->last token s':>20}")
    summary = []
    for (tree, mode), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in ("llm_s", "wait_s", "generate_s", "tokens_per_s",
                                                                  "llm_to_last_token_s")}
        lo, hi = min(r["generate_s"] for r in rs), max(r["generate_s"] for r in rs)
        ratio = med["tokens_per_s"] / hf["tokens_per_s"] if mode != "small" else float("nan")
        same = sum(a == b for a, b in zip(rs[0]["token_ids"], hf["token_ids"])) if mode != "small" else None
        print(f"{(tree or 'installed')[-28:]:<28} {mode:<7} {med['llm_s']:8.1f} {med['wait_s']:7.1f} "
              f"{med['generate_s']:6.1f} [{lo:.1f}-{hi:.1f}] {med['tokens_per_s']:6.0f} {ratio:6.2f} "
              f"{med['llm_to_last_token_s']:20.1f}")
        summary.append(dict(tree=tree, mode=mode, median=med, generate_s_range=[lo, hi], vs_transformers=ratio,
                            identical_greedy_outputs=same, compiled_shapes=rs[-1]["compiled_shapes"],
                            runs=[{k: v for k, v in r.items() if k != "token_ids"} for r in rs]))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    hf.pop("token_ids")
    Path(args.out).write_text(json.dumps(dict(transformers=hf, runs=summary, cache="warm" if args.warm_cache
                                              else "cold", argv=sys.argv[1:], time=time.ctime()), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
