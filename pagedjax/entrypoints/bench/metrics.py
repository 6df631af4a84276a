"""Latency summaries and the serving metrics of `pagedjax bench serve`.

Per request: TTFT (time to the first chunk with output), E2E (time to the stream's end), ITL
(the gaps between successive output chunks), TPOT = (E2E - TTFT) / (output tokens - 1).
Goodput: the requests per second that met every given SLO.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_METRICS = {"ttft": "ttft", "tpot": "tpot", "e2e": "e2e", "e2el": "e2e"}  # vLLM says e2el


@dataclass(slots=True)
class RequestResult:
    """What one request measured; times in seconds (start: since the run began)."""

    ok: bool = False
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False  # token counts from the server's `usage` (else chunks counted)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def summarize(seconds: list[float], percentiles=PERCENTILES) -> dict:
    """mean, std and percentiles of `seconds`, in milliseconds (None when empty)."""
    keys = ["mean", "std", *(f"p{p}" for p in percentiles)]
    if not seconds:
        return dict.fromkeys(keys)
    a = np.asarray(seconds, dtype=np.float64) * 1000.0
    values = [a.mean(), a.std(), *np.percentile(a, percentiles)]
    return {k: float(v) for k, v in zip(keys, values)}


def goodput_item(text: str) -> tuple[str, float]:
    """One --goodput item `METRIC:MS` (ttft, tpot, e2e), as argparse's `type`."""
    name, sep, value = text.partition(":")
    name = name.strip().lower()
    if not sep or name not in SLO_METRICS:
        raise argparse.ArgumentTypeError(f"{text!r} is not METRIC:MS with METRIC one of ttft, tpot, e2e "
                                         "(e.g. ttft:500)")
    try:
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: {value!r} is not a number of milliseconds") from None
    if not ms > 0 or ms == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: the SLO must be a positive number of milliseconds")
    return SLO_METRICS[name], ms


def meets(r: RequestResult, slos_ms: dict[str, float]) -> bool:
    """Did a completed request meet every SLO? A one-token output has no TPOT (it meets a TPOT
    SLO); with no first-token time (not streamed) a TTFT SLO is not met."""
    if not r.ok:
        return False
    measured = {"ttft": r.ttft, "tpot": r.tpot if r.output_tokens >= 2 else 0.0, "e2e": r.e2e}
    return all(measured[k] is not None and measured[k] * 1000.0 <= ms for k, ms in slos_ms.items())


def serve_metrics(results: list[RequestResult], duration: float, slos_ms: dict[str, float] | None = None) -> dict:
    """The run's counts, throughputs, latency summaries and goodput."""
    ok = [r for r in results if r.ok]
    inputs = sum(r.prompt_tokens or 0 for r in ok)
    outputs = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error or "unknown error"] = errors.get(r.error or "unknown error", 0) + 1
    out = {
        "num_requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "errors": [{"error": e, "count": c} for e, c in sorted(errors.items(), key=lambda x: -x[1])[:10]],
        "duration_s": duration,
        "total_input_tokens": inputs, "total_output_tokens": outputs,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": outputs / duration if duration > 0 else 0.0,
        "total_token_throughput": (inputs + outputs) / duration if duration > 0 else 0.0,
        "requests_without_usage": sum(not r.usage_reported for r in ok),
        "requests_without_prompt_tokens": sum(r.prompt_tokens is None for r in ok),
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": summarize([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": summarize([gap for r in ok for gap in r.itl]),
        "e2e_ms": summarize([r.e2e for r in ok if r.e2e is not None]),
        "goodput": None,
    }
    if slos_ms:
        good = sum(meets(r, slos_ms) for r in ok)
        out["goodput"] = {"slos_ms": dict(slos_ms), "requests_meeting_slos": good,
                          "request_throughput": good / duration if duration > 0 else 0.0}
    return out
