"""Latency statistics of a load run, as `vllm bench serve` reports them: TTFT, TPOT, ITL, E2E."""

from __future__ import annotations

import statistics
from typing import Any

from .loadgen import Record

__all__ = ["latency_stats", "percentile", "summarize"]


def percentile(ordered: list[float], fraction: float) -> float:
    """Nearest-rank percentile of an already sorted list (NaN when empty)."""
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def latency_stats(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of ``values`` (seconds) in ms, NaNs left out."""
    vals = sorted(v * 1e3 for v in values if v == v)
    return {"mean": statistics.fmean(vals) if vals else float("nan"), "p50": percentile(vals, 0.5),
            "p90": percentile(vals, 0.9), "p99": percentile(vals, 0.99)}  # percentile: NaN when empty


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    """The run's summary: counts, throughput and latency statistics of the requests that succeeded.
    Per-token ITL spreads each batch's gap evenly over its tokens."""
    ok = [r for r in records if r.ok]
    itl: list[float] = []
    inter_batch: list[float] = []
    for r in ok:
        for prev, cur, n in zip(r.arrivals, r.arrivals[1:], r.batch_tokens[1:], strict=False):
            inter_batch.append(cur - prev)
            itl.extend([(cur - prev) / n] * n if n else [])
    tpot = [(r.e2e - r.ttft) / (r.tokens - 1) for r in ok if r.tokens > 1]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(records), "succeeded": len(ok), "failed": len(records) - len(ok),
        "wall_s": wall, "request_throughput": len(ok) / wall, "output_tokens": tokens,
        "output_tok_s": tokens / wall,
        "ttft_ms": latency_stats([r.ttft for r in ok]), "tpot_ms": latency_stats(tpot),
        "itl_ms": latency_stats(itl), "e2e_ms": latency_stats([r.e2e for r in ok]),
        "inter_batch_ms": latency_stats(inter_batch),
        "tokens_per_batch": statistics.fmean([n for r in ok for n in r.batch_tokens]) if ok else float("nan"),
        "batches": sum(len(r.batch_tokens) for r in ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
    }
