"""`pagedjax bench startup`: seconds from process start to the first generated token, with a
cold and then a warm JAX compilation cache, for three ways of using a model (default: the
embedded one).

- generate: `pagedjax generate "What is the capital of France?" --chat --max-tokens 16`; time to
  the first stdout chunk with generated text, and to the process exit.
- serve: `pagedjax serve` (default flags, a free port on 127.0.0.1); time until GET /health
  answers 200 (the server binds once its warm-up lets it: all step shapes compiled, or with
  a background warm-up the first one), then until its first POST /v1/completions ("Hello",
  8 tokens) answers 200; then SIGINT (kill after 10 s).
- llm: `LLM(max_num_seqs=32, max_model_len=--max-model-len)` (warm-up on, the default) in a
  fresh Python process; time until `generate` of one prompt with max_tokens=1 returns its
  token (and, where the warm-up runs in the background, until `wait_for_warmup()` returns:
  JSON only).

Each target runs twice with JAX_COMPILATION_CACHE_DIR set to a fresh empty directory of its
own: cold (empty), then warm (the same directory, filled by the cold run). pagedjax uses that
directory and keeps every executable in it, however quick its compile
(pagedjax/worker/compile_counter.py; --cache-min-compile-secs sets JAX's threshold instead).
The default model's files must already be converted under ~/.cache/pagedjax (not cleared
here). Every run sets JAX_LOG_COMPILES=1 to count, from its stderr, XLA compilations
("compiled") and persistent-cache hits ("hits") up to the measured moment (the JSON also has
the process's totals); serve's /metrics and the LLM's stats() ("shapes": compiled step
shapes) are reported as well; pagedjax's own num_compilations counts cache hits as
compilations.
"""
from __future__ import annotations

import argparse
import atexit
import json
import signal
import sys
import tempfile
import time
import urllib.error

from pagedjax.entrypoints.bench.startup_proc import Proc, cache_entries, child_env, cleanup, free_port, http, pagedjax_cmd

TARGETS = ("generate", "serve", "llm")
PROMPT = "What is the capital of France?"
LABELS = {"generate": "generate: first token", "serve": "serve: first completion", "llm": "LLM: first token"}

LLM_CHILD = r"""
import json, sys, time
T0 = float(sys.argv[1])  # time.time() when the parent started this process
def mark(event, **kw):
    print(json.dumps({"event": event, "t": time.time() - T0, **kw}), flush=True)
mark("python_started")
from pagedjax import LLM, SamplingParams
mark("imported")
llm = LLM(json.loads(sys.argv[4]), max_num_seqs=32, max_model_len=int(sys.argv[5]), dtype=sys.argv[3])
mark("llm_constructed", dtype=str(llm.engine.model.dtype))
out = llm.generate([sys.argv[2]], SamplingParams(max_tokens=1), use_tqdm=False)
mark("first_token", token_ids=list(out[0].outputs[0].token_ids))
s = llm.stats()
mark("stats", num_compilations=s["num_compilations"], num_compiled_shapes=s["num_compiled_shapes"],
     num_step_shapes=s.get("num_step_shapes"))
if hasattr(llm, "wait_for_warmup"):  # the warm-up goes on in the background after the first token
    llm.wait_for_warmup()
    s = llm.stats()
    mark("warmup_done", num_compilations=s["num_compilations"], num_compiled_shapes=s["num_compiled_shapes"])
"""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--only", default=",".join(TARGETS), help="comma list of: generate, serve, llm")
    p.add_argument("--phases", default="cold,warm", help="comma list of: cold, warm (warm alone starts from an "
                                                           "empty cache too, so it is only meaningful after cold)")
    p.add_argument("--model", default=None, help="local Hugging Face model dir of every run (default: the "
                                                 "embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", help="--dtype of every run (auto: bfloat16 where the hardware has "
                                                   "fast bf16, this CPU included if it has AVX512-BF16/AMX)")
    p.add_argument("--max-model-len", type=int, default=1024, help="the llm target's max_model_len")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each measured process may take")
    p.add_argument("--cache-min-compile-secs", type=float, default=None,
                   help="JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS for the runs (default: pagedjax's 0, keep all)")
    p.add_argument("--output-json", "--out", dest="out", default="results/bench_startup.json", help="JSON path")
    p.set_defaults(_parser=p, _check=check_arguments, func=run)


def check_arguments(args: argparse.Namespace) -> None:
    args.targets = [t.strip() for t in args.only.split(",") if t.strip()]
    if not args.targets or any(t not in TARGETS for t in args.targets):
        raise ValueError(f"--only takes a comma list of {', '.join(TARGETS)}; got {args.only!r}")
    args.phase_list = [ph for ph in ("cold", "warm") if ph in (p.strip() for p in args.phases.split(","))]
    if not args.phase_list or any(ph.strip() not in ("cold", "warm") for ph in args.phases.split(",")):
        raise ValueError(f"--phases takes a comma list of cold, warm; got {args.phases!r}")
    if not args.timeout > 0:
        raise ValueError(f"--timeout must be positive, got {args.timeout}")
    if args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be a positive integer, got {args.max_model_len}")


def _env(cache_dir: str, args) -> dict:
    return child_env(cache_dir, args.cache_min_compile_secs)


def _model_flag(args) -> list[str]:
    return ["--model", args.model] if args.model else []


def run_generate(cache_dir: str, args) -> dict:
    cmd = pagedjax_cmd() + ["generate", PROMPT, "--chat", "--max-tokens", "16", "--dtype", args.dtype,
                            *_model_flag(args)]
    proc = Proc(cmd, _env(cache_dir, args))
    rc = proc.wait(args.timeout)
    first = next((t for t, c in proc.chunks if c.strip()), None)
    if rc != 0 or first is None:
        raise RuntimeError(f"pagedjax generate exited {rc} without output; stderr:\n{proc.stderr_tail()}")
    return {"seconds": first, "first_token_s": first, "total_s": proc.elapsed(), "text": proc.stdout().strip(),
            **proc.compile_counts(until=first)}


def run_serve(cache_dir: str, args) -> dict:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = pagedjax_cmd() + ["serve", *([args.model] if args.model else []), "--host", "127.0.0.1", "--port",
                            str(port), "--dtype", args.dtype]
    proc = Proc(cmd, _env(cache_dir, args))
    try:
        health = None
        while health is None:
            if proc.p.poll() is not None:
                raise RuntimeError(f"pagedjax serve exited {proc.p.returncode}; stderr:\n{proc.stderr_tail()}")
            if proc.elapsed() > args.timeout:
                raise TimeoutError(f"/health not 200 after {args.timeout:.0f} s")
            try:
                if http(base + "/health", timeout=2)[0] == 200:
                    health = proc.elapsed()
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        status, body = http(base + "/v1/models")
        model = json.loads(body)["data"][0]["id"]
        remaining = max(1.0, args.timeout - proc.elapsed())
        status, body = http(base + "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8},
                            timeout=remaining)
        completion = proc.elapsed()
        if status != 200:
            raise RuntimeError(f"POST /v1/completions answered {status}: {body[:300]!r}")
        text = json.loads(body)["choices"][0]["text"]
        metrics = {}
        status, body = http(base + "/metrics")
        for line in body.decode(errors="replace").splitlines():
            if ("compil" in line or "step_shapes" in line) and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                metrics[name] = float(value)
    finally:
        rc = proc.stop(grace=10.0)
    res = {"seconds": completion, "health_s": health, "first_completion_s": completion, "text": text,
           "metrics": metrics, "exit_code": rc, **proc.compile_counts(until=completion)}
    if rc != 0:  # measured fine, but the shutdown was not clean: keep what it said
        res["shutdown_stderr_tail"] = proc.stderr_tail(20)
    return res


def run_llm(cache_dir: str, args) -> dict:
    cmd = [sys.executable, "-c", LLM_CHILD, repr(time.time()), PROMPT, args.dtype, json.dumps(args.model),
           str(args.max_model_len)]
    proc = Proc(cmd, _env(cache_dir, args))
    rc = proc.wait(args.timeout)
    events = {}
    for line in proc.stdout().splitlines():
        if line.startswith("{"):
            ev = json.loads(line)
            events[ev.pop("event")] = ev
    if rc != 0 or "first_token" not in events:
        raise RuntimeError(f"the LLM process exited {rc}; stderr:\n{proc.stderr_tail()}")
    stats, done = events.get("stats", {}), events.get("warmup_done", {})
    return {"seconds": events["first_token"]["t"], "imported_s": events["imported"]["t"],
            "llm_constructed_s": events["llm_constructed"]["t"], "dtype": events["llm_constructed"].get("dtype"),
            "first_token_s": events["first_token"]["t"], "total_s": proc.elapsed(),
            "token_ids": events["first_token"]["token_ids"], "num_compilations": stats.get("num_compilations"),
            "num_compiled_shapes": stats.get("num_compiled_shapes"), "num_step_shapes": stats.get("num_step_shapes"),
            "all_shapes_compiled_s": done.get("t"), "num_compilations_all_shapes": done.get("num_compilations"),
            **proc.compile_counts(until=events["first_token"]["t"])}


RUNNERS = {"generate": run_generate, "serve": run_serve, "llm": run_llm}


def _compilations(target: str, r: dict) -> str:
    s = f"{r['compiled']} compiled, {r['cache_hits']} hits"
    if target == "serve":
        shapes = next((v for k, v in r["metrics"].items() if "compiled_shapes" in k), None)
        if shapes is not None:
            s += f", {shapes:.0f} shapes"
    if target == "llm" and r.get("num_compiled_shapes") is not None:
        s += f", {r['num_compiled_shapes']} shapes"
    return s


def measure(args: argparse.Namespace) -> dict:
    """Every target in every phase; a target that fails is reported and the next one goes on."""
    results: dict = {"args": {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "func"},
                     "cache_env": "JAX_COMPILATION_CACHE_DIR", "targets": {}}
    for target in args.targets:
        entry: dict = {}
        results["targets"][target] = entry
        with tempfile.TemporaryDirectory(prefix=f"bench_startup_{target}_") as cache_dir:
            for phase in args.phase_list:
                print(f"{target} ({phase} compile cache) ...", flush=True)
                try:
                    r = RUNNERS[target](cache_dir, args)
                except Exception as e:  # noqa: BLE001 - report it, go on with the next target
                    entry[phase] = {"error": f"{type(e).__name__}: {e}"}
                    print(f"  failed: {type(e).__name__}: {e}", flush=True)
                    break
                r["cache_entries_after"] = cache_entries(cache_dir)
                entry[phase] = r
                extra = f", exit {r['total_s']:.1f} s" if "total_s" in r else ""
                if target == "serve":
                    extra = f" (/health 200 at {r['health_s']:.1f} s)"
                print(f"  {r['seconds']:.1f} s{extra}; {_compilations(target, r)}; "
                      f"{r['cache_entries_after']} cache entries", flush=True)
    return results


def table(results: dict) -> str:
    lines = [f"{'target':<26}{'cold s':>9}{'warm s':>9}   compilations (cold -> warm)"]
    for target, entry in results["targets"].items():
        cells, comp = [], []
        for phase in ("cold", "warm"):
            r = entry.get(phase, {})
            cells.append(f"{r['seconds']:>9.1f}" if "seconds" in r else f"{'failed' if 'error' in r else '-':>9}")
            comp.append(_compilations(target, r) if "seconds" in r else "-")
        lines.append(f"{LABELS[target]:<26}{''.join(cells)}   {comp[0]} -> {comp[1]}")
        for key, label, where in (("health_s", "serve: /health 200", "serve"),
                                  ("total_s", "generate: process exit", "generate")):
            if target == where:
                vals = [f"{entry[ph][key]:.1f}" if key in entry.get(ph, {}) else "-" for ph in ("cold", "warm")]
                lines.append(f"{label:<26}{vals[0]:>9}{vals[1]:>9}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pagedjax.entrypoints.bench.report import save_json

    atexit.register(cleanup)
    handlers = {sig: signal.signal(sig, lambda signum, frame: (cleanup(), sys.exit(128 + signum)))
                for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        results = measure(args)
    finally:
        cleanup()
        for sig, old in handlers.items():
            signal.signal(sig, old)
    print()
    print(table(results))
    print(f"wrote {save_json(results, args.out)}")
    failed = any("error" in ph for e in results["targets"].values() for ph in e.values())
    return 1 if failed else 0
