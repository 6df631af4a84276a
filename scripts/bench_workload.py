"""Mixed offline workload: pagedjax against transformers' static batching and transformers'
continuous batching, same checkpoint and identical requests, side by side in one run.

Default workload (seeded): 96 requests, prompt lengths uniform in [32, 384], output lengths
uniform in [16, 192], random token-id prompts, greedy, EOS ignored, each request asking for
exactly its own number of tokens; a SmolLM2-135M-shaped Llama with random weights, float32 on
CPU. All requests are submitted at t0.

- pagedjax: `LLM(..., warmup=True)`, max_num_seqs 32, prefix caching off; the warm-up (every
  shape bucket compiled, or loaded from pagedjax's compile cache) is not timed and is reported
  on its own. The timed run steps `llm.engine` to see each request's first token (time to
  first token, TTFT).
- transformers static batching: `model.generate` on batches of 16 in arrival order, left
  padded, each batch run to its longest requested output. generate returns a whole batch at
  once, so a request's TTFT here is the end of its batch: what a caller actually waits for.
- transformers continuous batching: the manager behind `model.generate_batch`, with each
  request's own max_new_tokens, a KV cache sized for max_num_seqs requests of the longest
  length and the same 2048-token batch budget as pagedjax. Skipped (marked "not run") if it
  cannot run here.

After its run, pagedjax's steps are replayed with only the weight matmuls (same T buckets,
no attention, KV or host work): the floor this machine puts under those steps, printed next
to the run. Output tok/s counts the tokens each request asked for, over the wall time from t0 to the
last request's end. The engines run one after the other in this process; on a shared machine
another busy process slows torch's threads far more than XLA's. Writes JSON
(results/bench_workload.json).

    python scripts/bench_workload.py [--model DIR] [--n 96] [--prompt-min 32] [--prompt-max 384]
        [--output-min 16] [--output-max 192] [--max-num-seqs 32] [--static-batch-size 16]
        [--skip-transformers-static] [--skip-continuous] [--skip-floor] [--out results/bench_workload.json]
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_throughput import make_random_checkpoint  # noqa: E402


def _model_limits(model_dir: str) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from the HF config.json."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg) if "vocab_size" not in cfg else cfg
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings") or 1 << 30)


def make_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(args.seed)
    prompt_lens = rng.integers(args.prompt_min, args.prompt_max + 1, size=args.n)
    output_lens = rng.integers(args.output_min, args.output_max + 1, size=args.n)
    prompts = [rng.integers(3, vocab, size=int(n)).tolist() for n in prompt_lens]
    return prompts, [int(n) for n in output_lens]


def _summary(name: str, wall: float, useful_tokens: int, ttft: list[float], latency: list[float]) -> dict:
    ttft_a, lat_a = np.array(ttft), np.array(latency)
    return {"engine": name, "seconds": wall, "output_tokens": useful_tokens, "tokens_per_s": useful_tokens / wall,
            "ttft_mean_s": float(ttft_a.mean()), "ttft_p50_s": float(np.percentile(ttft_a, 50)),
            "ttft_p99_s": float(np.percentile(ttft_a, 99)), "latency_mean_s": float(lat_a.mean()),
            "latency_p99_s": float(np.percentile(lat_a, 99))}


# -- pagedjax -------------------------------------------------------------------------------
def bench_pagedjax(model_dir: str, prompts: list[list[int]], output_lens: list[int], args,
                   **engine_kwargs) -> dict:
    """engine_kwargs: more LLM options (scripts/bench_quantization.py runs dtype / quantization
    / kv_cache_dtype variants through here); dtype defaults to float32, as transformers runs."""
    from pagedjax import LLM, SamplingParams

    t = time.perf_counter()
    llm = LLM(model_dir, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              enable_prefix_caching=False, warmup=True, async_scheduling=not args.no_async_scheduling,
              **{"dtype": "float32", **engine_kwargs})
    # the warm-up compiles every step bucket (on a background thread: wait for it; older
    # versions compile in the first generate); not part of the timed run
    if hasattr(llm, "wait_for_warmup"):
        llm.wait_for_warmup()
    llm.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    warmup_s = time.perf_counter() - t
    engine = llm.engine
    # the LLM engine only reports finished requests; streaming outputs show each first token
    # (no detokenization cost with the random checkpoint, which has no tokenizer; a --model
    # with a tokenizer also decodes text incrementally)
    engine.stream_text = True
    compiles = llm.stats()["num_compilations"]
    steps0 = llm.stats()["num_steps"]

    step_tokens: list[int] = []  # T (bucket) of every timed step, for the matmul floor
    prepare = engine.runner.prepare

    def recording_prepare(outs, t=None):
        res = prepare(outs, t)
        step_tokens.append(res[0])
        return res

    engine.runner.prepare = recording_prepare
    n = len(prompts)
    first: dict[str, float] = {}
    end: dict[str, float] = {}
    tokens: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    for i, (prompt, out_len) in enumerate(zip(prompts, output_lens)):
        engine.add_request(f"w{i}", prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter() - t0
        for out in outs:
            rid = out.request_id
            if rid not in first and out.outputs[0].token_ids:
                first[rid] = now
            if out.finished:
                end[rid] = now
                tokens[rid] = list(out.outputs[0].token_ids)
    wall = time.perf_counter() - t0
    ids = [f"w{i}" for i in range(n)]
    stats = llm.stats()
    res = _summary("pagedjax", wall, sum(len(tokens[r]) for r in ids), [first[r] for r in ids],
                   [end[r] for r in ids])
    res.update(warmup_s=warmup_s, compilations_during_timed_run=stats["num_compilations"] - compiles,
               num_compiled_shapes=stats["num_compiled_shapes"], num_steps=stats["num_steps"] - steps0,
               num_preemptions=stats["num_preemptions"], token_ids=[tokens[r] for r in ids])
    engine.runner.prepare = prepare
    if not args.skip_floor:
        res["floor"] = matmul_floor(engine, step_tokens)
    del engine, llm
    gc.collect()
    return res


def matmul_floor(engine, step_tokens: list[int], repeats: int = 3) -> dict:
    """The same steps (same T buckets) with only the model's weight matmuls: embedding
    gather, per layer the fused qkv, o, gate/up and down projections, then the lm_head on S
    rows; no attention, no KV, no sampling, no host work. What the run could cost at best
    on this machine with these step shapes."""
    import jax
    import jax.numpy as jnp
    from collections import Counter

    from flax import nnx

    graphdef, state = engine.runner.graphdef, engine.runner.state
    model = nnx.merge(graphdef, state)
    if model.scan_layers:
        return {"seconds": float("nan"), "steps": len(step_tokens), "note": "not timed for scanned layers"}
    hd = model.config.num_heads * model.config.head_dim

    @jax.jit
    def forward(state, tokens, rows):  # the weights an argument: as constants, XLA copies them into each executable
        model = nnx.merge(graphdef, state)
        layers = list(model.layers)
        x = model.embed[...][tokens]
        for layer in layers:
            h = jnp.einsum("ti,oi->to", x, layer.attn.wqkv[...])[:, :hd]
            x = x + jnp.einsum("ti,oi->to", h, layer.attn.wo[...])
            gu = jnp.einsum("ti,oi->to", x, layer.mlp.w_gate_up[...])
            gate, up = jnp.split(gu, 2, axis=-1)
            x = x + jnp.einsum("ti,oi->to", jax.nn.silu(gate) * up, layer.mlp.w_down[...])
        return model.logits(x[rows]).argmax(-1)

    per_t = {}
    for t, count in sorted(Counter(step_tokens).items()):
        tokens = jnp.zeros(t, jnp.int32)
        rows = jnp.arange(engine.buckets.num_seqs(t), dtype=jnp.int32)
        forward(state, tokens, rows).block_until_ready()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            forward(state, tokens, rows).block_until_ready()
            times.append(time.perf_counter() - t0)
        per_t[t] = (count, min(times))
    total = sum(c * s for c, s in per_t.values())
    return {"seconds": total, "steps": len(step_tokens), "hidden_size": model.config.hidden_size,
            "by_tokens": {str(t): {"steps": c, "ms": 1e3 * s} for t, (c, s) in per_t.items()}}


# -- transformers, static batching ----------------------------------------------------------
def _load_hf(model_dir: str, attn: str | None = None):
    import torch
    from transformers import AutoModelForCausalLM

    kw = {"attn_implementation": attn} if attn else {}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kw).eval()
    # no EOS at all: nothing stops early and nothing (min_new_tokens) masks the EOS logit, as
    # pagedjax's ignore_eos (which emits EOS like any other token)
    model.generation_config.eos_token_id = None
    return model


def bench_static(model_dir: str, prompts: list[list[int]], output_lens: list[int], batch_size: int) -> dict:
    import torch

    model = _load_hf(model_dir)
    pad = 0

    def run_batch(batch: list[list[int]], new_tokens: int) -> torch.Tensor:
        width = max(len(p) for p in batch)
        ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for j, p in enumerate(batch):  # left padding
            ids[j, width - len(p):] = torch.tensor(p)
            mask[j, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=pad)
        return out[:, width:]

    n = len(prompts)
    tokens: list[list[int]] = [[] for _ in range(n)]
    done = [0.0] * n
    computed = 0
    with torch.no_grad():
        run_batch([prompts[0][:8], prompts[1][:5]], 4)  # warm-up, not timed
        t0 = time.perf_counter()
        for b in range(0, n, batch_size):
            idx = list(range(b, min(b + batch_size, n)))
            new = max(output_lens[i] for i in idx)
            gen = run_batch([prompts[i] for i in idx], new)
            computed += gen.numel()
            now = time.perf_counter() - t0
            for j, i in enumerate(idx):
                tokens[i] = gen[j, :output_lens[i]].tolist()
                done[i] = now
        wall = time.perf_counter() - t0
    res = _summary("transformers static", wall, sum(len(t) for t in tokens), done, done)
    res.update(batch_size=batch_size, generated_tokens_incl_batch_padding=computed,
               ttft_definition="end of the request's batch (generate returns the whole batch at once)",
               token_ids=tokens)
    gc.collect()
    return res


# -- transformers, continuous batching ------------------------------------------------------
def bench_continuous(model_dir: str, prompts: list[list[int]], output_lens: list[int], args) -> dict:
    import torch
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _load_hf(model_dir, args.cb_attn)
    longest = max(len(p) for p in prompts) + max(output_lens)
    page = args.cb_page_size
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=args.max_num_seqs * math.ceil(longest / page),  # max_num_seqs requests of the longest length
        max_batch_tokens=2048,  # pagedjax's default max_num_batched_tokens
        max_requests_per_batch=args.max_num_seqs,
        allow_block_sharing=False,  # prefix caching is off for pagedjax too
        use_cuda_graph=False, use_async_batching=False, auto_switch_to_flash=False)
    gen_config = GenerationConfig(do_sample=False, max_new_tokens=max(output_lens), eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in prompts), max_generated_length=max(output_lens),
                          num_requests=len(prompts))
    results: dict[str, object] = {}
    done: dict[str, float] = {}
    with torch.no_grad(), model.continuous_batching_context_manager(
            generation_config=gen_config, continuous_batching_config=cb_config, block=True, timeout=10,
            workload_hints=hints) as manager:

        def wait(ids: set[str], t0: float, deadline: float) -> None:
            while ids - results.keys():
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{len(ids - results.keys())} requests unfinished after the time limit")
                r = manager.get_result(timeout=1)
                if r is None:
                    if not manager.is_running():
                        raise RuntimeError("the continuous batching thread stopped")
                    continue
                if r.is_finished():
                    if r.error is not None:
                        raise RuntimeError(f"request {r.request_id} failed: {r.error}")
                    results[r.request_id] = r
                    done[r.request_id] = time.perf_counter() - t0

        warm = manager.add_request(prompts[0][:8], request_id="warmup", max_new_tokens=4, eos_token_id=-1)
        wait({warm}, time.perf_counter(), time.perf_counter() + args.timeout)  # warm-up, not timed
        results.clear()
        done.clear()
        t0 = time.perf_counter()
        ids = [manager.add_request(p, request_id=f"w{i}", max_new_tokens=o, record_timestamps=True,
                                   eos_token_id=-1)
               for i, (p, o) in enumerate(zip(prompts, output_lens))]
        wait(set(ids), t0, t0 + args.timeout)
        wall = time.perf_counter() - t0
    outs = [results[r] for r in ids]
    tokens = [list(o.generated_tokens)[:n_out] for o, n_out in zip(outs, output_lens)]
    ttft = [(o.timestamps[0] - t0) if o.timestamps else done[r] for o, r in zip(outs, ids)]
    res = _summary("transformers continuous", wall, sum(len(t) for t in tokens), ttft, [done[r] for r in ids])
    res.update(attn_implementation=model.config._attn_implementation, page_size=page,
               num_blocks=cb_config.num_blocks, max_batch_tokens=2048, max_requests_per_batch=args.max_num_seqs,
               short_outputs=sum(len(t) < n_out for t, n_out in zip(tokens, output_lens)), token_ids=tokens)
    del model
    gc.collect()
    return res


# -- report ---------------------------------------------------------------------------------
def _compare(ours: list[list[int]], theirs: list[list[int]], label: str) -> tuple[int, list[str]]:
    same, lines = 0, []
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a == b:
            same += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        if len(lines) < 5:
            lines.append(f"  {label} request {i}: first diverging token index {k} (lengths {len(a)} / {len(b)})")
    return same, lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: random SmolLM2-135M-shaped Llama)")
    p.add_argument("--n", type=int, default=96, help="number of requests")
    p.add_argument("--prompt-min", type=int, default=32)
    p.add_argument("--prompt-max", type=int, default=384)
    p.add_argument("--output-min", type=int, default=16)
    p.add_argument("--output-max", type=int, default=192)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-seqs", type=int, default=32, help="pagedjax seats; also the continuous batch size")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="pagedjax max_model_len (default: 1024, or prompt-max + output-max rounded up to 256)")
    p.add_argument("--static-batch-size", type=int, default=16)
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--cb-attn", default="sdpa", choices=["sdpa", "paged|eager"],
                   help="attention of transformers' continuous batching on CPU (flash needs a GPU)")
    p.add_argument("--cb-page-size", type=int, default=256, help="transformers' continuous batching page size")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the continuous batching run may take")
    p.add_argument("--skip-transformers-static", action="store_true")
    p.add_argument("--skip-continuous", action="store_true")
    p.add_argument("--no-async-scheduling", action="store_true", help="pagedjax reads each step's tokens before "
                                                                      "scheduling the next")
    p.add_argument("--skip-floor", action="store_true", help="do not time the matmul-only floor of pagedjax's steps")
    p.add_argument("--out", default="results/bench_workload.json")
    args = p.parse_args()
    if not (1 <= args.prompt_min <= args.prompt_max and 1 <= args.output_min <= args.output_max and args.n >= 2):
        p.error("need 1 <= prompt-min <= prompt-max, 1 <= output-min <= output-max and n >= 2")

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            model_dir = tmp
            print("building the random SmolLM2-135M-shaped checkpoint ...", flush=True)
            make_random_checkpoint(Path(tmp))
        vocab, max_pos = _model_limits(model_dir)
        need = args.prompt_max + args.output_max
        if args.max_model_len is None:
            args.max_model_len = min(max(1024, -(-need // 256) * 256), max_pos)
        if need > args.max_model_len:
            p.error(f"prompt-max + output-max = {need} exceeds max_model_len {args.max_model_len}")
        prompts, output_lens = make_workload(args, vocab)
        print(f"workload: {args.n} requests, {sum(map(len, prompts))} prompt tokens, {sum(output_lens)} output "
              f"tokens asked for", flush=True)

        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        print("pagedjax ...", flush=True)
        ours = bench_pagedjax(model_dir, prompts, output_lens, args)
        print(f"  warm-up {ours['warmup_s']:.1f} s (not timed); run {ours['seconds']:.1f} s", flush=True)
        static = cont = None
        if not args.skip_transformers_static:
            print("transformers static batching ...", flush=True)
            static = bench_static(model_dir, prompts, output_lens, args.static_batch_size)
            print(f"  run {static['seconds']:.1f} s", flush=True)
        cont_reason = "skipped (--skip-continuous)" if args.skip_continuous else None
        if not args.skip_continuous:
            print(f"transformers continuous batching (attn {args.cb_attn}) ...", flush=True)
            try:
                cont = bench_continuous(model_dir, prompts, output_lens, args)
                print(f"  run {cont['seconds']:.1f} s", flush=True)
            except Exception as e:  # noqa: BLE001 - report and go on with the other engines
                cont_reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                print(f"  not run: {cont_reason}", flush=True)

    ours_tokens = ours.pop("token_ids")
    result: dict = {"args": vars(args), "workload": {"prompt_tokens": sum(map(len, prompts)),
                                                      "output_tokens_requested": sum(output_lens)},
                    "pagedjax": ours}
    rows = [ours]
    diffs: list[str] = []
    if static is not None:
        same, lines = _compare(ours_tokens, static.pop("token_ids"), "static")
        diffs += lines
        result["transformers_static"] = static
        result["speedup_vs_static"] = ours["tokens_per_s"] / static["tokens_per_s"]
        result["identical_greedy_outputs_static"] = f"{same}/{args.n}"
        rows.append(static)
    else:
        result["transformers_static"] = "not run"
    if cont is not None:
        same, lines = _compare(ours_tokens, cont.pop("token_ids"), "continuous")
        diffs += lines
        result["transformers_continuous"] = cont
        result["speedup_vs_continuous"] = ours["tokens_per_s"] / cont["tokens_per_s"]
        result["identical_greedy_outputs_continuous"] = f"{same}/{args.n}"
        rows.append(cont)
    else:
        result["transformers_continuous"] = {"status": "not run", "reason": cont_reason}

    print()
    print(f"{'engine':<26}{'output tok/s':>13}{'wall s':>9}{'TTFT mean s':>13}{'TTFT p99 s':>12}")
    for r in rows:
        label = r["engine"] + (" *" if r is static else "")
        print(f"{label:<26}{r['tokens_per_s']:>13.1f}{r['seconds']:>9.2f}{r['ttft_mean_s']:>13.2f}"
              f"{r['ttft_p99_s']:>12.2f}")
    if cont is None:
        print(f"{'transformers continuous':<26}{'not run':>13}   ({cont_reason})")
    print(f"pagedjax: warm-up {ours['warmup_s']:.1f} s (not timed), TTFT p50 {ours['ttft_p50_s']:.2f} s, "
          f"XLA compilations during the timed run: {ours['compilations_during_timed_run']}")
    if "floor" in ours:
        fl = ours["floor"]
        print(f"floor: the same {fl['steps']} steps with only the weight matmuls take {fl['seconds']:.1f} s "
              f"({result['workload']['output_tokens_requested'] / fl['seconds']:.1f} tok/s); pagedjax's run "
              f"{ours['seconds']:.1f} s is {ours['seconds'] / fl['seconds']:.2f}x that")
    if static is not None:
        print("* static batching returns a whole batch at once: its TTFT is the end of the request's batch")
        print(f"pagedjax / static      {result['speedup_vs_static']:6.2f}x   identical greedy outputs: "
              f"{result['identical_greedy_outputs_static']}")
    if cont is not None:
        print(f"pagedjax / continuous  {result['speedup_vs_continuous']:6.2f}x   identical greedy outputs: "
              f"{result['identical_greedy_outputs_continuous']}")
    if diffs:
        print("mismatches (left-padded or differently batched float32 can flip rare near-ties):")
        print("\n".join(diffs))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
