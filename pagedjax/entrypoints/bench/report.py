"""What `pagedjax bench ...` prints and saves: a readable table, a JSON result, a PNG of the
latency distributions."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _num(v, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def serve_table(result: dict) -> str:
    """The serving result as a fixed-width table: counts and throughputs, then the latencies."""
    rate = result["config"]["request_rate"]
    rows = [
        ("Backend", result["base_url"]), ("Model", result["model"]),
        ("Endpoint / dataset", f"{result['endpoint']} / {result['config']['dataset']}"),
        ("Request rate (req/s)", rate if isinstance(rate, str) else f"{rate:g}"),
        ("Burstiness", f"{result['config']['burstiness']:g}"),
        ("Max concurrency", result["config"]["max_concurrency"] or "-"),
        ("Completed / failed requests", f"{result['completed']} / {result['failed']}"),
        ("Duration (s)", _num(result["duration_s"])),
        ("Total input tokens", result["total_input_tokens"]),
        ("Total output tokens", result["total_output_tokens"]),
        ("Request throughput (req/s)", _num(result["request_throughput"])),
        ("Output token throughput (tok/s)", _num(result["output_throughput"])),
        ("Total token throughput (tok/s)", _num(result["total_token_throughput"])),
    ]
    if result.get("goodput"):
        g = result["goodput"]
        slos = " ".join(f"{k}<={v:g}ms" for k, v in g["slos_ms"].items())
        rows.append((f"Goodput (req/s; {slos})", f"{g['request_throughput']:.2f} "
                                                 f"({g['requests_meeting_slos']} requests)"))
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * 28 + " Serving Benchmark Result " + "=" * 28]
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    keys = [k for k in result["ttft_ms"] if k != "std"]
    lines.append("-" * 82)
    lines.append(f"{'latency (ms)':<{width}}" + "".join(f"{k:>11}" for k in keys))
    for key, label in LATENCIES:
        lines.append(f"{label:<{width}}" + "".join(f"{_num(result[key][k]):>11}" for k in keys))
    lines.append("=" * 82)
    notes = []
    if result.get("requests_without_usage"):
        notes.append(f"{result['requests_without_usage']} requests had no `usage` in their stream: their output "
                     "tokens are counted as output chunks")
    if result.get("requests_without_prompt_tokens"):
        notes.append(f"{result['requests_without_prompt_tokens']} requests' prompt tokens are unknown (no `usage`): "
                     "left out of the input totals")
    for e in result.get("errors", [])[:3]:
        notes.append(f"failed x{e['count']}: {e['error']}")
    return "\n".join(lines + [f"note: {n}" for n in notes])


def to_json(obj) -> str:
    """JSON with infinities written as the string "inf" (JSON has none)."""
    def clean(v):
        if isinstance(v, float) and math.isinf(v):
            return "inf" if v > 0 else "-inf"
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), indent=2, default=str)


def save_json(obj: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(to_json(obj) + "\n")
    return path


def plot_latency_cdfs(samples_ms: dict[str, list[float]], path: str | Path, title: str,
                      slos_ms: dict[str, float] | None = None) -> Path:
    """One panel per latency (TTFT, TPOT, ITL, E2E): the fraction of requests (of gaps, for
    ITL) at or below each value, with the SLO as a dashed line where one was given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, LATENCIES):
        values = np.sort(np.asarray(samples_ms.get(key, []), dtype=np.float64))
        if values.size:
            ax.step(values, np.arange(1, values.size + 1) / values.size, where="post")
            for p in (50, 90, 99):
                ax.axhline(p / 100, color="0.85", lw=0.8, zorder=0)
        else:
            ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes)
        slo = (slos_ms or {}).get(key.removesuffix("_ms"))
        if slo is not None:
            ax.axvline(slo, color="tab:red", ls="--", lw=1, label=f"SLO {slo:g} ms")
            ax.legend(loc="lower right")
        ax.set_title(f"{label} (n={values.size})")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction <= x")
        ax.set_ylim(0, 1.02)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def json_config(args: argparse.Namespace) -> dict:
    """The flags of a run, for its JSON (never the API key)."""
    skip = {"api_key", "func", "command", "bench", "no_progress"}
    return {k: v for k, v in vars(args).items() if not k.startswith("_") and k not in skip}
