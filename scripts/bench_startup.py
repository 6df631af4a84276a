"""Start-up time: seconds from process start to the first generated token, with a cold and then
a warm JAX compilation cache, for three ways of using the default model.

- generate: `pagedjax generate "What is the capital of France?" --chat --max-tokens 16`; time to
  the first stdout chunk with generated text, and to the process exit.
- serve: `pagedjax serve` (default flags, a free port on 127.0.0.1); time until GET /health
  answers 200 (the server binds once its warm-up lets it: all step shapes compiled, or with
  a background warm-up the first one), then until its first POST /v1/completions ("Hello",
  8 tokens) answers 200; then SIGINT (kill after 10 s).
- llm: `LLM(max_num_seqs=32, max_model_len=1024)` (warm-up on, the default) in a fresh Python
  process; time until `generate` of one prompt with max_tokens=1 returns its token (and, where
  the warm-up runs in the background, until `wait_for_warmup()` returns: JSON only).

Each target runs twice with JAX_COMPILATION_CACHE_DIR set to a fresh empty directory of its
own: cold (empty), then warm (the same directory, filled by the cold run). pagedjax uses that
directory and keeps every executable in it, however quick its compile
(pagedjax/worker/compile_counter.py; --cache-min-compile-secs sets JAX's threshold instead). The
model files must already be converted under ~/.cache/pagedjax (not cleared here). --dtype is
passed to every run (default auto: the JSON of the llm runs says what it chose). Every run sets JAX_LOG_COMPILES=1 to count, from its stderr, XLA compilations ("compiled") and
persistent-cache hits ("hits") up to the measured moment (the JSON also has the process's
totals); serve's /metrics and the LLM's stats() ("shapes": compiled step shapes) are reported
as well; pagedjax's own num_compilations counts cache hits as compilations.
Each process may take at most --timeout seconds (600). Writes JSON (results/bench_startup.json).

    python scripts/bench_startup.py [--only generate,serve,llm] [--dtype float32] [--out results/bench_startup.json]
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

TARGETS = ("generate", "serve", "llm")
PROMPT = "What is the capital of France?"
_live: list[subprocess.Popen] = []  # processes this script started and has not reaped yet

LLM_CHILD = r"""
import json, sys, time
T0 = float(sys.argv[1])  # time.time() when the parent started this process
def mark(event, **kw):
    print(json.dumps({"event": event, "t": time.time() - T0, **kw}), flush=True)
mark("python_started")
from pagedjax import LLM, SamplingParams
mark("imported")
llm = LLM(max_num_seqs=32, max_model_len=1024, dtype=sys.argv[3])
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


def _pagedjax_cmd() -> list[str]:
    exe = shutil.which("pagedjax")
    return [exe] if exe else [sys.executable, "-c", "import sys; from pagedjax.entrypoints.cli import main; sys.exit(main())"]


_MIN_COMPILE_SECS: float | None = None  # --cache-min-compile-secs


def _env(cache_dir: str) -> dict:
    env = dict(os.environ)
    env.pop("PAGEDJAX_COMPILE_CACHE", None)
    env.update(JAX_COMPILATION_CACHE_DIR=cache_dir, JAX_LOG_COMPILES="1", PYTHONUNBUFFERED="1")
    if _MIN_COMPILE_SECS is not None:
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = str(_MIN_COMPILE_SECS)
    return env


class Proc:
    """A child process in its own session, its stdout and stderr read by threads, each
    stdout chunk stamped with the seconds since the start."""

    def __init__(self, cmd: list[str], env: dict):
        self.t0 = time.perf_counter()
        self.p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, start_new_session=True)
        _live.append(self.p)
        self.chunks: list[tuple[float, str]] = []
        self.err: list[tuple[float, str]] = []
        self.readers = [threading.Thread(target=self._read_out, daemon=True),
                        threading.Thread(target=self._read_err, daemon=True)]
        for r in self.readers:
            r.start()

    def _read_out(self) -> None:
        fd = self.p.stdout.fileno()
        while chunk := os.read(fd, 65536):
            self.chunks.append((time.perf_counter() - self.t0, chunk.decode(errors="replace")))

    def _read_err(self) -> None:
        for line in iter(self.p.stderr.readline, b""):
            self.err.append((time.perf_counter() - self.t0, line.decode(errors="replace")))

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def wait(self, timeout: float) -> int:
        try:
            rc = self.p.wait(timeout=max(0.0, timeout - self.elapsed()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"still running after {timeout:.0f} s") from None
        self._reap()
        return rc

    def stop(self, grace: float = 10.0) -> int | None:
        """SIGINT, then SIGKILL after `grace` seconds."""
        if self.p.poll() is None:
            _signal(self.p, signal.SIGINT)
            try:
                self.p.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reap()
        return self.p.returncode

    def kill(self) -> None:
        _signal(self.p, signal.SIGKILL)
        self.p.wait()
        self._reap()

    def _reap(self) -> None:
        for r in self.readers:
            r.join(timeout=5)
        if self.p in _live:
            _live.remove(self.p)

    def stdout(self) -> str:
        return "".join(c for _, c in self.chunks)

    def stderr_tail(self, n: int = 15) -> str:
        lines = [line for _, line in self.err if "XLA compilation" not in line and "compilation cache" not in line
                 and "Compiling " not in line and "Finished " not in line]
        return "".join(lines[-n:])

    def compile_counts(self, until: float | None = None) -> dict:
        """From the JAX_LOG_COMPILES lines on stderr up to `until` seconds after the start
        (default: all): every backend compile request logs 'Finished XLA compilation'
        (persistent-cache hits included); hits also log 'Persistent compilation cache hit'.
        Also the same counts over the whole life of the process."""
        def count(lines: list[str]) -> tuple[int, int]:
            finished = sum("Finished XLA compilation" in line for line in lines)
            hits = sum("Persistent compilation cache hit" in line for line in lines)
            return finished - hits, hits

        compiled, hits = count([line for t, line in self.err if until is None or t <= until])
        all_compiled, all_hits = count([line for _, line in self.err])
        return {"compiled": compiled, "cache_hits": hits, "process_compiled": all_compiled,
                "process_cache_hits": all_hits}


def _signal(p: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(p.pid, sig)  # its own session: the group holds only what it started
    except (ProcessLookupError, PermissionError):
        pass


def _cleanup(*_args) -> None:
    for p in list(_live):
        _signal(p, signal.SIGKILL)
        try:
            p.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        _live.remove(p)


def _cache_entries(cache_dir: str) -> int:
    return sum(1 for f in Path(cache_dir).rglob("*") if f.is_file() and not f.name.endswith("-atime"))


# -- targets --------------------------------------------------------------------------------
def run_generate(cache_dir: str, args) -> dict:
    cmd = _pagedjax_cmd() + ["generate", PROMPT, "--chat", "--max-tokens", "16", "--dtype", args.dtype]
    proc = Proc(cmd, _env(cache_dir))
    rc = proc.wait(args.timeout)
    first = next((t for t, c in proc.chunks if c.strip()), None)
    if rc != 0 or first is None:
        raise RuntimeError(f"pagedjax generate exited {rc} without output; stderr:\n{proc.stderr_tail()}")
    return {"seconds": first, "first_token_s": first, "total_s": proc.elapsed(), "text": proc.stdout().strip(),
            **proc.compile_counts(until=first)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def run_serve(cache_dir: str, args) -> dict:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc = Proc(_pagedjax_cmd() + ["serve", "--host", "127.0.0.1", "--port", str(port), "--dtype", args.dtype],
                _env(cache_dir))
    try:
        health = None
        while health is None:
            if proc.p.poll() is not None:
                raise RuntimeError(f"pagedjax serve exited {proc.p.returncode}; stderr:\n{proc.stderr_tail()}")
            if proc.elapsed() > args.timeout:
                raise TimeoutError(f"/health not 200 after {args.timeout:.0f} s")
            try:
                if _http(base + "/health", timeout=2)[0] == 200:
                    health = proc.elapsed()
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            time.sleep(0.1)
        status, body = _http(base + "/v1/models")
        model = json.loads(body)["data"][0]["id"]
        remaining = max(1.0, args.timeout - proc.elapsed())
        status, body = _http(base + "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 8},
                             timeout=remaining)
        completion = proc.elapsed()
        if status != 200:
            raise RuntimeError(f"POST /v1/completions answered {status}: {body[:300]!r}")
        text = json.loads(body)["choices"][0]["text"]
        metrics = {}
        status, body = _http(base + "/metrics")
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
    proc = Proc([sys.executable, "-c", LLM_CHILD, repr(time.time()), PROMPT, args.dtype], _env(cache_dir))
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
            "llm_constructed_s": events["llm_constructed"]["t"], "dtype": events["llm_constructed"].get("dtype"), "first_token_s": events["first_token"]["t"],
            "total_s": proc.elapsed(), "token_ids": events["first_token"]["token_ids"],
            "num_compilations": stats.get("num_compilations"), "num_compiled_shapes": stats.get("num_compiled_shapes"),
            "num_step_shapes": stats.get("num_step_shapes"), "all_shapes_compiled_s": done.get("t"),
            "num_compilations_all_shapes": done.get("num_compilations"),
            **proc.compile_counts(until=events["first_token"]["t"])}


RUNNERS = {"generate": run_generate, "serve": run_serve, "llm": run_llm}
LABELS = {"generate": "generate: first token", "serve": "serve: first completion", "llm": "LLM: first token"}


def _compilations(target: str, r: dict) -> str:
    s = f"{r['compiled']} compiled, {r['cache_hits']} hits"
    if target == "serve":
        shapes = next((v for k, v in r["metrics"].items() if "compiled_shapes" in k), None)
        if shapes is not None:
            s += f", {shapes:.0f} shapes"
    if target == "llm" and r.get("num_compiled_shapes") is not None:
        s += f", {r['num_compiled_shapes']} shapes"
    return s


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default=",".join(TARGETS), help="comma list of: generate, serve, llm")
    p.add_argument("--phases", default="cold,warm", help="comma list of: cold, warm (warm alone starts from an "
                                                           "empty cache too, so it is only meaningful after cold)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each measured process may take")
    p.add_argument("--cache-min-compile-secs", type=float, default=None,
                   help="JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS for the runs (default: pagedjax's 0, keep all)")
    p.add_argument("--dtype", default="auto", help="--dtype of every run (auto: bfloat16 where the hardware has "
                                                   "fast bf16, this CPU included if it has AVX512-BF16/AMX)")
    p.add_argument("--out", default="results/bench_startup.json")
    args = p.parse_args()
    targets = [t.strip() for t in args.only.split(",") if t.strip()]
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        p.error(f"--only takes a comma list of {', '.join(TARGETS)}; got {args.only!r}")
    global _MIN_COMPILE_SECS
    _MIN_COMPILE_SECS = args.cache_min_compile_secs
    phases = [ph for ph in ("cold", "warm") if ph in args.phases.split(",")]
    if not phases:
        p.error(f"--phases takes a comma list of cold, warm; got {args.phases!r}")

    atexit.register(_cleanup)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: (_cleanup(), sys.exit(128 + signum)))
    results: dict = {"args": vars(args), "cache_env": "JAX_COMPILATION_CACHE_DIR", "targets": {}}
    try:
        for target in targets:
            entry: dict = {}
            results["targets"][target] = entry
            with tempfile.TemporaryDirectory(prefix=f"bench_startup_{target}_") as cache_dir:
                for phase in phases:
                    print(f"{target} ({phase} compile cache) ...", flush=True)
                    try:
                        r = RUNNERS[target](cache_dir, args)
                    except Exception as e:  # noqa: BLE001 - report it, go on with the next target
                        entry[phase] = {"error": f"{type(e).__name__}: {e}"}
                        print(f"  failed: {type(e).__name__}: {e}", flush=True)
                        break
                    r["cache_entries_after"] = _cache_entries(cache_dir)
                    entry[phase] = r
                    extra = f", exit {r['total_s']:.1f} s" if "total_s" in r else ""
                    if target == "serve":
                        extra = f" (/health 200 at {r['health_s']:.1f} s)"
                    print(f"  {r['seconds']:.1f} s{extra}; {_compilations(target, r)}; "
                          f"{r['cache_entries_after']} cache entries", flush=True)
    finally:
        _cleanup()

    print()
    print(f"{'target':<26}{'cold s':>9}{'warm s':>9}   compilations (cold -> warm)")
    for target, entry in results["targets"].items():
        cells, comp = [], []
        for phase in ("cold", "warm"):
            r = entry.get(phase, {})
            cells.append(f"{r['seconds']:>9.1f}" if "seconds" in r else f"{'failed' if 'error' in r else '-':>9}")
            comp.append(_compilations(target, r) if "seconds" in r else "-")
        print(f"{LABELS[target]:<26}{''.join(cells)}   {comp[0]} -> {comp[1]}")
        if target == "serve":
            hs = [f"{entry[ph]['health_s']:.1f}" if "health_s" in entry.get(ph, {}) else "-" for ph in ("cold", "warm")]
            print(f"{'serve: /health 200':<26}{hs[0]:>9}{hs[1]:>9}")
        if target == "generate":
            ts = [f"{entry[ph]['total_s']:.1f}" if "total_s" in entry.get(ph, {}) else "-" for ph in ("cold", "warm")]
            print(f"{'generate: process exit':<26}{ts[0]:>9}{ts[1]:>9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    failed = any("error" in ph for e in results["targets"].values() for ph in e.values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
