"""Dense vs paged KV cache: one workload, one KV memory budget, both backends, one process.

`compare(...)` runs the same requests (greedy, EOS ignored, so every request produces exactly
its sampled output length) through `LLMEngine(kv_cache="dense")` and `LLMEngine(kv_cache="paged")`
with the same `kv_cache_memory_gb`, samples `pagedjax.core.kv_memory.kv_memory` after every step, and
returns a JSON-able report: peak concurrent requests, KV utilization, waste split into internal
and external, throughput, latency, prefix-sharing savings, identical-output check, timelines.
`write_report(...)` writes it as JSON, a markdown table and PNG plots (pagedjax.compare.plots).

The two backends run interleaved, one engine step each in turn, each timed on its own clock
(the sum of its own step times), so load from other processes falls on both alike while
both run (the longer run finishes alone).
Compilation is kept out of the timings: before the timed run each engine compiles exactly the
step shapes the workload will hit, found by a dry run of its scheduler on a copy of its block
pool (no model; the schedule does not depend on token values when EOS is ignored).
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pagedjax.worker import compile_counter
from pagedjax.core.kv_memory import block_map
from pagedjax.compare.tiers import tier_counters, tier_engine_kwargs, tier_sample, tier_table_rows
from pagedjax.sampling_params import SamplingParams

BACKENDS = ("dense", "paged")
INT8_KV = "paged_int8kv"  # the paged backend with kv_cache_dtype="int8", in the same KV bytes


@dataclass(slots=True)
class Workload:
    """Requests all arriving at t=0; lengths uniform in [lo, hi] (inclusive)."""

    num_requests: int = 40
    prompt_len: tuple[int, int] = (32, 320)
    output_len: tuple[int, int] = (100, 200)
    max_model_len: int = 2048
    shared_prefix_len: int = 0  # leading tokens every prompt shares (a system prompt)
    n: int = 1  # sequences per request (parallel sampling)
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("prompt_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be a range 1 <= lo <= hi, got {(lo, hi)}")
        if self.num_requests < 1 or self.n < 1 or self.shared_prefix_len < 0:
            raise ValueError("num_requests and n must be >= 1 and shared_prefix_len >= 0")
        if self.shared_prefix_len + self.prompt_len[1] + self.output_len[1] > self.max_model_len:
            raise ValueError("shared prefix + longest prompt + longest output exceeds max_model_len")

    def requests(self, vocab_size: int) -> list[tuple[list[int], SamplingParams]]:
        """(prompt token ids, params) per request; ids avoid the low (special) token range."""
        rng = np.random.default_rng(self.seed)
        lo_id = min(100, vocab_size // 4)
        prefix = rng.integers(lo_id, vocab_size, self.shared_prefix_len).tolist()
        out = []
        for _ in range(self.num_requests):
            prompt = prefix + rng.integers(lo_id, vocab_size, int(rng.integers(*self.prompt_len, endpoint=True))).tolist()
            max_tokens = int(rng.integers(*self.output_len, endpoint=True))
            out.append((prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=self.n)))
        return out


def kv_bytes_per_token(model: str | None, dtype: str = "auto") -> int:
    """KV bytes one token takes in every layer (K and V), read from the model's config."""
    from pagedjax.models.config import load_config
    from pagedjax.models.loader import resolve_dtype, resolve_kv_cache_dtype

    if model is None:
        from pagedjax.models.default_model import default_model_dir

        model = default_model_dir(progress=False)
    cfg = load_config(model)
    itemsize = np.dtype(resolve_kv_cache_dtype("auto", resolve_dtype(dtype, cfg))).itemsize
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * itemsize


class BackendRun:
    """One backend working through the workload one engine step at a time, on its own clock:
    the sum of its own `add_request` and `step()` times (the accounting sampled after each
    step is not counted; every step bucket is compiled before)."""

    def __init__(self, kind: str, model: str | None, workload: Workload, budget_tokens: int, *,
                 block_size: int = 16, max_num_seqs: int = 64, enable_prefix_caching: bool = True,
                 dtype: str = "auto", progress: bool = False, engine_kwargs: dict | None = None):
        from pagedjax.engine.llm_engine import LLMEngine

        if (engine_kwargs or {}).get("data_parallel_size", 1) != 1:
            raise ValueError("the dense vs paged comparison reads one block pool: run it with data_parallel_size=1")
        self.kind = kind
        self.budget_bytes = budget_tokens * kv_bytes_per_token(model, dtype)
        kv_dtype = "int8" if kind == INT8_KV else "auto"  # same bytes, ~2x the tokens
        self.engine = LLMEngine(model, stream_text=True, kv_cache="dense" if kind == "dense" else "paged",
                                kv_cache_dtype=kv_dtype, block_size=block_size,
                                max_num_seqs=max_num_seqs, max_model_len=workload.max_model_len,
                                enable_prefix_caching=enable_prefix_caching, dtype=dtype,
                                kv_cache_memory_gb=self.budget_bytes / (1 << 30),
                                # one whole step per step() call: each memory sample is of written KV,
                                # not of blocks an unread step in flight holds
                                **{"async_scheduling": False, **(engine_kwargs or {})})
        assert kv_dtype != "auto" or self.engine.kv_budget_tokens == budget_tokens
        self.requests = workload.requests(self.engine.model_config.vocab_size)
        self.engine.warmup(progress)
        self.compilations = 0  # during the timed steps (0: every bucket was compiled before)
        self.clock = 0.0
        self.timeline: list[dict] = []
        self.first: dict[str, float] = {}
        self.finish: dict[str, float] = {}
        self.done: dict[str, object] = {}
        self.peak = self.peak_map = self.peak_tiers = None
        self.progress, self.bar = progress, None
        t = time.perf_counter()
        for i, (prompt, params) in enumerate(self.requests):
            self.engine.add_request(str(i), prompt, params)
        self.clock += time.perf_counter() - t

    @property
    def finished(self) -> bool:
        return not self.engine.has_unfinished_requests()

    def step(self) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=len(self.requests), desc=f"{self.kind:>5} requests", unit="req",
                            disable=not self.progress)
        e = self.engine
        compiles, prompt, gen = compile_counter.num_compilations(), e.num_computed_prompt_tokens, e.num_generated_tokens
        t = time.perf_counter()
        outs = e.step()
        dt = time.perf_counter() - t
        self.clock = now = self.clock + dt
        self.compilations += compile_counter.num_compilations() - compiles
        for out in outs:
            self.first.setdefault(out.request_id, now)
            if out.finished:
                self.finish[out.request_id], self.done[out.request_id] = now, out
                self.bar.update(1)
        mem = e.kv_memory()
        self.timeline.append({"t": now, "step_s": dt, "prompt_tokens": e.num_computed_prompt_tokens - prompt,
                              "generated_tokens": e.num_generated_tokens - gen, **mem.as_dict()})
        if self.peak is None or mem.reserved > self.peak["reserved"]:
            self.peak = self.timeline[-1]
            self.peak_map = block_map(self.engine.pool, self.engine.scheduler.running)
            self.peak_tiers = tier_sample(self.engine)  # None: no KV tier

    def result(self) -> dict:
        """Metrics, timeline, the block map at the fullest moment, and every output's token ids."""
        if self.bar is not None:
            self.bar.close()
        engine, timeline, n = self.engine, self.timeline, len(self.requests)
        if self.peak_tiers is not None:
            engine.close_kv_tiers()  # the disk tier's pending writes land: its counters are final
        stats = engine.stats()
        latency = np.array([self.finish[str(i)] for i in range(n)])
        ttft = np.array([self.first[str(i)] for i in range(n)])
        gen = stats["num_generated_tokens"]
        taken = sum(s["reserved"] + s["external_waste"] for s in timeline)
        waste = lambda key: sum(s[key] for s in timeline) / taken if taken else 0.0  # noqa: E731
        mean = lambda key: float(np.mean([s[key] for s in timeline]))  # noqa: E731
        return {
            "backend": self.kind,
            "num_blocks": engine.pool.num_blocks, "block_size": engine.pool.block_size,
            "capacity_tokens": engine.pool.num_blocks * engine.pool.block_size,
            "budget_tokens": engine.kv_budget_tokens, "budget_bytes": self.budget_bytes,
            "kv_bytes_per_token": engine.kv_bytes_per_token,
            "peak_concurrent_requests": max(s["num_requests"] for s in timeline),
            "mean_concurrent_requests": mean("num_requests"),
            "kv_utilization_mean": mean("utilization"),
            "kv_utilization_peak": max(s["utilization"] for s in timeline),
            "kv_reserved_fraction_mean": mean("reserved_fraction"),
            "waste_fraction": waste("internal_waste") + waste("external_waste"),
            "internal_waste_fraction": waste("internal_waste"),
            "external_waste_fraction": waste("external_waste"),
            "reserved_future_fraction": waste("reserved_future"),
            "at_peak": {k: self.peak[k] for k in ("t", "reserved", "written", "internal_waste", "reserved_future",
                                                  "external_waste", "free", "shared", "sharing_saved",
                                                  "num_requests", "utilization", "waste_fraction")},
            "sharing_saved_tokens_peak": max(s["sharing_saved"] for s in timeline),
            "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
            "num_preemptions": stats["num_preemptions"],
            "num_steps": stats["num_steps"],
            "seconds": self.clock,
            "output_tokens": gen,
            "output_tokens_per_s": gen / self.clock,
            "decode_tokens_per_s_full": self._full_decode_rate(),
            "requests_per_s": n / self.clock,
            "latency_mean_s": float(latency.mean()), "latency_p99_s": float(np.percentile(latency, 99)),
            "ttft_mean_s": float(ttft.mean()), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "compilations_during_run": self.compilations,
            "timeline": timeline,
            "block_map_at_peak": self.peak_map,
            # the KV tiers (kv_offload_gb / kv_offload_dir), only when on: occupancy at the peak, counters at the end
            **({"kv_tiers_at_peak": self.peak_tiers, "kv_tiers": tier_counters(engine)}
               if self.peak_tiers is not None else {}),
            "outputs": [[list(c.token_ids) for c in self.done[str(i)].outputs] for i in range(n)],
        }


    def _full_decode_rate(self) -> float:
        """Tokens/s of decode-only steps with every seat busy (as many tokens as the peak
        concurrency): the steady-state rate, without prompt processing, ramp-up or tail."""
        peak = max(s["num_requests"] for s in self.timeline)
        rates = [s["generated_tokens"] / s["step_s"] for s in self.timeline
                 if not s["prompt_tokens"] and s["generated_tokens"] >= peak]
        return float(np.median(rates)) if rates else 0.0


def compare(model: str | None = None, workload: Workload | None = None, budget_tokens: int = 9000, *,
            block_size: int = 16, max_num_seqs: int = 32, dtype: str = "auto", progress: bool = False,
            int8_kv: bool = True, kv_offload_gb: float | None = None, kv_offload_dir: str | None = None,
            kv_offload_disk_gb: float | None = None, log=print) -> dict:
    """Runs the workload on both backends with the same KV budget; returns the report.
    int8_kv: a third run, paged with kv_cache_dtype="int8" in the same bytes (its outputs
    are not expected to equal the others': 8-bit K/V change the logits slightly).
    kv_offload_gb / kv_offload_dir / kv_offload_disk_gb: the KV tiers (host memory, disk) for
    the paged run (not the dense one, nor the int8 one); off (None) by default. The report's
    paged run then has `kv_tiers` (the tiers' counters, the device pool's beside them) and
    `kv_tiers_at_peak` (their occupancy when the pool was fullest).

    The two runs are interleaved step by step, each timed on its own clock, so load from
    other processes on a shared machine falls on both alike."""
    workload = workload or Workload()
    tiers = tier_engine_kwargs(kv_offload_gb, kv_offload_dir, kv_offload_disk_gb)
    runs = {}
    for kind in (*BACKENDS, INT8_KV) if int8_kv else BACKENDS:
        log(f"[{kind}] building the engine and compiling the step shapes the workload needs ...")
        runs[kind] = BackendRun(kind, model, workload, budget_tokens, block_size=block_size,
                                max_num_seqs=max_num_seqs, dtype=dtype, progress=progress,
                                engine_kwargs=tiers if kind == "paged" else None)
    log(f"running {workload.num_requests} requests on both backends, interleaved step by step ...")
    while not all(r.finished for r in runs.values()):
        for r in runs.values():
            if not r.finished:
                r.step()
    results = {kind: r.result() for kind, r in runs.items()}
    for kind, r in results.items():
        log(f"[{kind}] {r['seconds']:.1f} s, {r['output_tokens_per_s']:.1f} tok/s, "
            f"peak {r['peak_concurrent_requests']} concurrent, waste {100 * r['waste_fraction']:.1f}%")
    dense, paged = results["dense"], results["paged"]
    same = sum(a == b for a, b in zip(dense["outputs"], paged["outputs"]))
    return {
        "model": model or "SmolLM2-135M-Instruct (embedded default)",
        "workload": asdict(workload),
        "kv_budget_tokens": budget_tokens,
        "kv_budget_bytes": paged["budget_bytes"],
        "block_size": block_size, "max_num_seqs": max_num_seqs, "kv_tier_options": tiers,
        "identical_outputs": f"{same}/{len(paged['outputs'])}",
        "all_outputs_identical": same == len(paged["outputs"]),
        "ratios": {
            "peak_concurrent_requests": paged["peak_concurrent_requests"] / dense["peak_concurrent_requests"],
            "throughput": paged["output_tokens_per_s"] / dense["output_tokens_per_s"],
            "decode_rate_full": (paged["decode_tokens_per_s_full"] / dense["decode_tokens_per_s_full"]
                                 if dense["decode_tokens_per_s_full"] else None),
            "latency_mean": paged["latency_mean_s"] / dense["latency_mean_s"],
        },
        "dense": dense, "paged": paged,
        **({INT8_KV: results[INT8_KV]} if int8_kv else {}),
    }


TABLE_ROWS = [  # (label, key, format)
    ("KV slots / blocks (tokens each)", None, None),
    ("peak concurrent requests", "peak_concurrent_requests", "{:d}"),
    ("mean concurrent requests", "mean_concurrent_requests", "{:.1f}"),
    ("KV utilization, mean (written / budget)", "kv_utilization_mean", "{:.1%}"),
    ("KV utilization, peak", "kv_utilization_peak", "{:.1%}"),
    ("KV reserved, mean (held / budget)", "kv_reserved_fraction_mean", "{:.1%}"),
    ("waste (of memory taken)", "waste_fraction", "{:.1%}"),
    ("- internal fragmentation", "internal_waste_fraction", "{:.1%}"),
    ("  - of it, reserved for the request's future tokens", "reserved_future_fraction", "{:.1%}"),
    ("- external fragmentation", "external_waste_fraction", "{:.1%}"),
    ("prefix-sharing: tokens stored once (peak saved)", "sharing_saved_tokens_peak", "{:d}"),
    ("preemptions", "num_preemptions", "{:d}"),
    ("throughput (output tok/s, whole run)", "output_tokens_per_s", "{:.1f}"),
    ("decode rate with every seat busy (tok/s)", "decode_tokens_per_s_full", "{:.1f}"),
    ("latency mean (s)", "latency_mean_s", "{:.2f}"),
    ("latency p99 (s)", "latency_p99_s", "{:.2f}"),
    ("time to first token, mean (s)", "ttft_mean_s", "{:.2f}"),
    ("wall time (s)", "seconds", "{:.1f}"),
]


def markdown_table(report: dict) -> str:
    d, p, q = report["dense"], report["paged"], report.get(INT8_KV)
    extra = " paged + int8 KV | int8 KV / dense |" if q else ""
    lines = ["| | dense | paged | paged / dense |" + extra, "|---|---:|---:|---:|" + ("---:|---:|" if q else "")]
    ratio_keys = ("peak_concurrent_requests", "output_tokens_per_s", "decode_tokens_per_s_full", "latency_mean_s",
                  "latency_p99_s")
    for label, key, fmt in TABLE_ROWS:
        if key is None:
            line = f"| {label} | {d['num_blocks']} x {d['block_size']} | {p['num_blocks']} x {p['block_size']} | |"
            lines.append(line + (f" {q['num_blocks']} x {q['block_size']} | |" if q else ""))
            continue
        ratio = lambda r: f"{r[key] / d[key]:.2f}x" if key in ratio_keys and d[key] else ""  # noqa: E731
        line = f"| {label} | {fmt.format(d[key])} | {fmt.format(p[key])} | {ratio(p)} |"
        lines.append(line + (f" {fmt.format(q[key])} | {ratio(q)} |" if q else ""))
    lines += tier_table_rows(report, q is not None)
    lines.append(f"| identical greedy outputs | {report['identical_outputs']} | | |" + (" | |" if q else ""))
    w = report["workload"]
    shared = f" after a shared prefix of {w['shared_prefix_len']}" if w["shared_prefix_len"] else ""
    lines += ["", f"KV budget {report['kv_budget_tokens']} tokens ({_bytes(report['kv_budget_bytes'])}) for "
              f"both; {w['num_requests']} requests (n={w['n']}), prompts of {w['prompt_len'][0]}-{w['prompt_len'][1]} "
              f"tokens{shared}, outputs of {w['output_len'][0]}-{w['output_len'][1]} tokens, max_model_len "
              f"{w['max_model_len']}; model {report['model']}."]
    if report.get("kv_tier_options"):  # absent in reports written before the tiers
        options = ", ".join(f"{k}={v}" for k, v in report["kv_tier_options"].items())
        lines.append(f"KV tiers on the paged run only: {options}"
                     + " (the paged column's tier rows; counters at the end of the run).")
    return "\n".join(lines) + "\n"


def _bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def write_report(report: dict, out_dir: str | Path, *, plots: bool = True) -> dict[str, Path]:
    """Writes compare.json, compare.md and (plots=True) the PNGs into out_dir; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "compare.json", "markdown": out / "compare.md"}
    paths["json"].write_text(json.dumps(report, indent=1))
    paths["markdown"].write_text(markdown_table(report))
    if plots:
        from pagedjax.compare.plots import plot_block_map, plot_utilization

        paths["utilization_png"] = plot_utilization(report, out / "kv_utilization.png")
        paths["block_map_png"] = plot_block_map(report, out / "kv_block_map.png")
    return paths
